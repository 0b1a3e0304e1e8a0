"""benchmarks/results/ holds the runs behind the docs' figures: every file must parse and every record
must say which commit, machine and command produced it, or the figure cannot be traced. record_result.py,
which appends a new run, must write such a record around the benchmark's own JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RECORD = ROOT / "benchmarks" / "record_result.py"
RESULT_FILES = sorted(RESULTS.glob("*.json"))


def named(value) -> bool:
    return isinstance(value, str | list) and len(value) > 0


def check_record(record: dict) -> None:
    for key in ("name", "commit", "date", "command"):
        assert isinstance(record.get(key), str) and record[key].strip(), f"record lacks {key}: {record.get('name')}"
    machine = record.get("machine")
    assert isinstance(machine, dict), f"record lacks a machine: {record['name']}"
    for key in ("description", "cpu_flags", "threads"):
        assert named(machine.get(key)), f"machine lacks {key}: {record['name']}"
    assert any(k in record for k in ("result", "ratios", "summary", "bounds")), f"no figures: {record['name']}"


def test_results_folder_has_files_and_a_readme():
    assert len(RESULT_FILES) >= 10
    readme = (RESULTS / "README.md").read_text()
    for path in RESULT_FILES:
        assert f"`{path.name}`" in readme, f"README.md does not describe {path.name}"


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_every_record_names_commit_machine_and_command(path: Path):
    data = json.loads(path.read_text())
    assert set(data) >= {"benchmark", "script", "records"}
    assert data["records"], f"{path.name} has no records"
    for record in data["records"]:
        check_record(record)


def test_the_checker_rejects_a_record_without_a_commit():
    record = {"name": "x", "commit": "abc1234", "date": "2026-12-02", "command": "c", "result": {},
              "machine": {"description": "d", "cpu_flags": "AVX2 only", "threads": [1]}}
    check_record(record)
    with pytest.raises(AssertionError, match="commit"):
        check_record({k: v for k, v in record.items() if k != "commit"})


def record(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RECORD), *args], input=stdin, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_record_result_wraps_a_run_with_commit_machine_and_command(tmp_path: Path):
    run = {"benchmark": "decode_speed", "batch1": [{"threads": 1, "context": 256, "dsv3 fp32": {"tokens_per_s": 1.5}}]}
    target = tmp_path / "decode_speed.json"
    command = ".venv/bin/python benchmarks/decode_speed.py --json"
    first = record(str(target), "-", "--name", "first", "--command", command, "--threads", "1,2", stdin=json.dumps(run))
    assert first.returncode == 0, first.stderr
    (tmp_path / "run.json").write_text(json.dumps({"second": True}))
    second = record(str(target), str(tmp_path / "run.json"), "--name", "second", "--command", command)
    assert second.returncode == 0, second.stderr

    data = json.loads(target.read_text())
    assert data["benchmark"] == "decode_speed" and data["script"] == "benchmarks/decode_speed.py"
    assert [r["name"] for r in data["records"]] == ["first", "second"]
    one = data["records"][0]
    check_record(one)
    assert one["result"] == run and one["command"] == command and one["machine"]["threads"] == "1,2"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert one["commit"].removesuffix("-dirty") == head.stdout.strip()
    assert data["records"][1]["machine"]["threads"] == "not recorded"


def test_record_result_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path: Path):
    target = tmp_path / "r.json"
    (tmp_path / "bad.json").write_text("tokens/s: 12")
    bad_run = record(str(target), str(tmp_path / "bad.json"), "--name", "n", "--command", "c")
    assert bad_run.returncode == 2
    assert bad_run.stderr.strip().splitlines() == [bad_run.stderr.strip()] and bad_run.stderr.startswith("error: ")
    assert "--json" in bad_run.stderr and not target.exists()

    target.write_text(json.dumps([1, 2]))
    not_results = record(str(target), "-", "--name", "n", "--command", "c", stdin="{}")
    assert not_results.returncode == 2 and not_results.stderr.startswith("error: ")
    assert "not a results file" in not_results.stderr
    assert json.loads(target.read_text()) == [1, 2]

    missing = record(str(tmp_path / "x.json"), str(tmp_path / "absent.json"), "--name", "n", "--command", "c")
    assert missing.returncode == 2 and missing.stderr.startswith("error: cannot read")


def test_cpu_flags_name_what_the_decode_kernels_use():
    sys.path.insert(0, str(RECORD.parent))
    try:
        from record_result import cpu_flags
    finally:
        sys.path.remove(str(RECORD.parent))
    assert cpu_flags("flags\t: fpu avx2 avx512f avx512_bf16\n") == "AVX512-BF16"
    assert cpu_flags("flags\t: fpu avx2 avx512f\n") == "AVX-512 (no BF16)"
    assert cpu_flags("flags\t: fpu sse4_2 avx2 fma\n") == "AVX2 only"
    assert cpu_flags("processor: 0\n") == "not recorded"
