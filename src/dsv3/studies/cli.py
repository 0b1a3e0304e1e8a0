"""`dsv3 study NAME`: each study module defines ``main`` (a Typer command) and is registered here."""

import typer

from dsv3.studies import accumulation, fp8_training, logfmt_study

app = typer.Typer(help="Numerical studies behind the paper's claims.", no_args_is_help=True, add_completion=False)
app.command("accumulation")(accumulation.main)
app.command("fp8")(fp8_training.main)
app.command("logfmt")(logfmt_study.main)
