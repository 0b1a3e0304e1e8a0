"""`dsv3 bench NAME`: benchmarks that need the package (the peer comparisons live in benchmarks/)."""

import typer

from dsv3 import bench_ep as ep_bench
from dsv3.infer import bench as decode_bench
from dsv3.infer import bench_serve
from dsv3.parallel import pipeline_bench_cli as pipeline_bench

app = typer.Typer(help="Benchmarks: expert-parallel layer, pipeline bubble, decode speed, serving load.",
                  no_args_is_help=True, add_completion=False)
app.command("ep")(ep_bench.main)
app.command("decode")(decode_bench.main)
app.command("pipeline")(pipeline_bench.main)
app.command("serve")(bench_serve.main)
