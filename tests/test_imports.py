"""The model does not drag in the server or the plotting stack: `import dsv3.model` (and loading a
checkpoint, training, analysing) imports no fastapi, uvicorn, networkx or matplotlib; each is imported
where it is used. Checked in a fresh interpreter, where nothing else has imported them."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("fastapi", "uvicorn", "networkx", "matplotlib")


def test_core_imports_pull_in_no_server_or_plotting_library():
    modules = ["dsv3", "dsv3.model", "dsv3.checkpoint", "dsv3.infer.engine", "dsv3.train.run", "dsv3.analysis.cli",
               "dsv3.studies.cli", "dsv3.network.report"]
    code = (
        f"import sys\nimport {', '.join(modules)}\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
