"""Append one benchmark run to a file of benchmarks/results/, with the commit, date and machine that
produced it, so that a figure in the docs can be traced to its run (benchmarks/results/README.md).

    .venv/bin/python benchmarks/decode_speed.py --repeats 5 --json > /tmp/run.json
    .venv/bin/python benchmarks/record_result.py benchmarks/results/decode_speed.json /tmp/run.json \\
        --name "batch 1, this host" --command ".venv/bin/python benchmarks/decode_speed.py --repeats 5 --json"

The run's JSON (``-`` reads stdin) becomes the record's ``result`` unchanged. The file is created when
missing and replaced atomically; a file that is not a results file is left alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_RECORDED = "not recorded"


def git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def current_commit() -> str:
    """The short hash of HEAD, with ``-dirty`` when tracked files differ from it (the run measured them)."""
    head = git("rev-parse", "--short", "HEAD")
    if head is None:
        return NOT_RECORDED
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_flags(cpuinfo: str) -> str:
    """What the decode kernels care about: bf16 dot products (AVX512-BF16), AVX-512, or AVX2 only."""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if not flags:
        return NOT_RECORDED
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    if "avx512f" in flags:
        return "AVX-512 (no BF16)"
    return "AVX2 only" if "avx2" in flags else "no AVX2"


def this_machine(threads: str | None) -> dict:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 NOT_RECORDED)
    return {"description": f"{model}, {os.cpu_count()} CPUs", "cpu_flags": cpu_flags(cpuinfo),
            "threads": threads or NOT_RECORDED}


def load_results(path: Path, command: str) -> dict:
    if not path.exists():
        script = next((word for word in command.split() if word.startswith("benchmarks/")), command)
        return {"benchmark": path.stem, "script": script, "records": []}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{path} is not a results file (an object with a 'records' list)")
    return data


def read_run(source: str) -> object:
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {source}: {exc.strerror}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not JSON (run the benchmark with --json): {exc}") from exc


def write_atomically(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, help="benchmarks/results/NAME.json (created when missing)")
    ap.add_argument("run", help="the benchmark's --json output (a file, or - for stdin)")
    ap.add_argument("--name", required=True, help="what was measured, in a few words")
    ap.add_argument("--command", required=True, help="the command that produced the run")
    ap.add_argument("--threads", default=None, help="threads the run used, e.g. 1,2")
    args = ap.parse_args()
    try:
        data = load_results(args.results, args.command)
        result = read_run(args.run)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data["records"].append({"name": args.name, "commit": current_commit(),
                            "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
                            "machine": this_machine(args.threads), "command": args.command, "result": result})
    write_atomically(args.results, data)
    print(f"appended record {len(data['records'])} to {args.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
