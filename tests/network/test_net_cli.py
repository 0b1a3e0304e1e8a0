"""`dsv3 net` commands: one JSON object on stdout, clear errors, PNG plots written."""

import json

from dsv3.cli import main


def run(capsys, *args):
    code = main(["net", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_topology_json_counts_agree(capsys):
    code, out, _ = run(capsys, "topology", "--topology", "ft3", "--radix", "8", "--json")
    d = json.loads(out)
    assert code == 0 and d["counts_agree"]
    assert d["endpoints"] == {"formula": 128, "graph": 128}
    assert d["diameter_switch_hops"] == {"formula": 4, "graph": 4}


def test_topology_slimfly_q28_is_an_error(capsys):
    code, out, err = run(capsys, "topology", "--topology", "sf", "--q", "28", "--json")
    assert code == 2 and out == "" and "not a prime power" in err and "Traceback" not in err


def test_cost_json_reproduces_table3(capsys):
    code, out, _ = run(capsys, "cost", "--json")
    d = json.loads(out)
    paper_rows = [r for r in d["rows"] if "paper" in r]
    assert code == 0 and len(paper_rows) == 5
    assert all(all(r["matches_paper"].values()) for r in paper_rows)
    assert any("not a prime power" in n for n in d["notes"])


def test_cost_markdown_table(capsys):
    code, out, _ = run(capsys, "cost", "--markdown")
    assert code == 0 and out.startswith("| row |") and "| MPFT |" in out


def test_simulate_json_and_utilization_plot(capsys, tmp_path):
    code, out, _ = run(capsys, "simulate", "--topology", "mpft", "--gpus", "64", "--traffic", "alltoall",
                       "--routing", "ecmp", "--message-bytes", "64MiB", "--json", "--plot-dir", str(tmp_path))
    d = json.loads(out)
    assert code == 0 and d["routing"] == "ecmp" and d["algbw_GBps"] > 40
    assert d["traffic"]["size_bytes"] == 64 * 2**20
    assert len(d["plots"]) == 1 and (tmp_path / d["plots"][0].split("/")[-1]).stat().st_size > 1000
    assert not [p for p in tmp_path.iterdir() if p.suffix != ".png"]  # no temp files left behind


def test_simulate_plane_failure_and_text_output(capsys):
    code, out, _ = run(capsys, "simulate", "--gpus", "64", "--fail-plane", "3")
    assert code == 0 and "algbw per GPU" in out


def test_simulate_bad_input(capsys):
    code, out, err = run(capsys, "simulate", "--gpus", "64", "--message-bytes", "lots", "--json")
    assert code == 2 and out == "" and "byte count" in err
    code, _, err = run(capsys, "simulate", "--topology", "ft2", "--gpus", "64", "--fail-plane", "1")
    assert code == 2 and "fail-plane" in err


def test_sweep_writes_plots(capsys, tmp_path):
    code, out, _ = run(capsys, "sweep", "--topologies", "mpft,mrft", "--gpus", "16,32", "--sizes", "1MiB,1GiB",
                       "--routings", "adaptive,ecmp", "--json", "--plot-dir", str(tmp_path))
    d = json.loads(out)
    assert code == 0 and len(d["rows"]) == 2 * 2 * 2 * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alltoall_bw_vs_gpus.png", "alltoall_bw_vs_size.png"]
    bw = {(r["topology"], r["gpus"], r["routing"], r["message_bytes"]): r["algbw_GBps"] for r in d["rows"]}
    for topo, n, routing, size in bw:
        if size == 2**20:  # latency bites small messages
            assert bw[topo, n, routing, size] < 0.9 * bw[topo, n, routing, 2**30]
