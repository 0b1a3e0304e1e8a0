"""The model does not drag in the server or the plotting stack: `import dsv3.model` (and loading a
checkpoint, training, analysing) imports no fastapi, uvicorn, networkx or matplotlib; each is imported
where it is used. Checked in a fresh interpreter, where nothing else has imported them."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("fastapi", "uvicorn", "networkx", "matplotlib")


def test_core_imports_pull_in_no_server_or_plotting_library():
    modules = ["dsv3", "dsv3.model", "dsv3.checkpoint", "dsv3.train.run", "dsv3.analysis.cli", "dsv3.network.report"]
    code = (
        f"import sys\nimport {', '.join(modules)}\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_nothing_points_to_notes_a_user_does_not_have():
    """The code and docs cite docs/references.md or the public papers, never the maintainers' private
    fact sheets (named here in pieces, so that this file does not match itself)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = [stem + ".md" for stem in ("PAPER", "NETWORK", "ANCHORS", "DESIGN")] + ["PAPER" + " §"]
    files = [root / "README.md", *(p for d in ("src", "docs", "tests", "benchmarks", "scripts")
                                   for p in (root / d).rglob("*") if p.suffix in {".py", ".md", ".sh"})]
    hits = [f"{f.relative_to(root)}: {n}" for f in files for n in names if n in f.read_text(errors="replace")]
    assert hits == []
    assert (root / "docs" / "references.md").exists()
