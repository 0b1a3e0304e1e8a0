"""Sharded data parallelism on 4 gloo processes (CPU, fp32; the trainer as under torchrun): `--dp-shard
zero1` and `--dp-shard fsdp` train the same steps as one process with the same global batch, hold about a quarter of
the optimizer state per rank (fsdp: of the parameters too), save checkpoints that load as ordinary models,
and resume bit for bit under the same layout. run.json records every rank's memory for every layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dsv3
from dsv3.errors import DSV3Error
from dsv3.parallel.memory import SavedTensorMeter
from dsv3.parallel.sharding import assign_owners
from dsv3.testing.launch import launch
from dsv3.testing.sharding_scenarios import train_worker
from dsv3.train.metrics import read_rows
from dsv3.train.options import TrainOptions
from dsv3.train.run import run_training

STEPS = 5


@pytest.fixture(scope="module")
def base_options(tiny_config, corpus_dir, cache_dir) -> dict:
    return dict(config=str(tiny_config), data=[str(corpus_dir)], steps=STEPS, batch_size=4, seq_len=32, lr=3e-3,
                save_every=3, eval_every=100, eval_tokens=128, cache_dir=str(cache_dir), device="cpu",
                val_fraction=0.1)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, base_options):
    """The one-process reference: 5 steps, a checkpoint at 3 and 5."""
    out = tmp_path_factory.mktemp("single") / "run"
    run_training(TrainOptions(**base_options, out=str(out)), show_progress=False, plots=False)
    return out


SHARDS = ("zero1", "fsdp")


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory, base_options) -> Path:
    """One launch of 4 gloo processes (the trainer as `torchrun --nproc-per-node 4 -m dsv3 train` runs it),
    for each sharding: 5 steps into ROOT/SHARD (checkpoints at 3 and 5), then a copy cut back to step 3
    resumed to 5 in ROOT/SHARD-resumed."""
    root = tmp_path_factory.mktemp("sharded")
    runs = []
    for shard in SHARDS:
        options = {**base_options, "dp_shard": shard}
        runs.append({"options": {**options, "out": str(root / shard)}})
        runs.append({"options": {**options, "out": str(root / f"{shard}-resumed")}, "resume": True,
                     "copy_from": str(root / shard), "drop_after": 3})
    summaries = launch(train_worker, 4, (runs,), timeout_s=300)[0]
    assert [(s["world_size"], s["step"]) for s in summaries] == [(4, STEPS)] * len(runs)
    return root


def _train_rows(run_dir) -> list[dict]:
    return [r for r in read_rows(Path(run_dir) / "metrics.jsonl") if r["kind"] == "train"]


def _memory(run_dir) -> list[dict]:
    return json.loads((Path(run_dir) / "run.json").read_text())["memory"]["per_rank"]


def _logits(folder) -> torch.Tensor:
    model = dsv3.load_pretrained(folder).eval()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids)


def test_memory_of_the_plain_layout_is_in_run_json(single_run):
    (mem,) = _memory(single_run)
    model = dsv3.load_pretrained(Path(single_run) / "latest")
    n_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert mem["rank"] == 0 and mem["parameters"] == mem["gradients"] == n_bytes
    assert mem["optimizer"] == 2 * n_bytes + 4 * len(list(model.parameters()))  # exp_avg, exp_avg_sq, step
    assert mem["activations_peak"] > 0


@pytest.mark.parametrize("shard", SHARDS)
def test_dp4_sharded_matches_one_process(shard, single_run, sharded_runs):
    one, four = _train_rows(single_run), _train_rows(sharded_runs / shard)
    for a, b in zip(one, four, strict=True):
        for key in ("loss", "mtp_loss", "balance_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
        assert a["expert_load"] == b["expert_load"]
    # the checkpoint is an ordinary model with the single process's weights
    torch.testing.assert_close(_logits(sharded_runs / shard / "latest"), _logits(single_run / "latest"),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shard", SHARDS)
def test_dp4_sharded_holds_a_quarter_of_the_optimizer_state_per_rank(shard, single_run, sharded_runs):
    (ref,) = _memory(single_run)
    ranks = _memory(sharded_runs / shard)
    assert [m["rank"] for m in ranks] == [0, 1, 2, 3]
    for m in ranks:
        assert 0.15 < m["optimizer"] / ref["optimizer"] < 0.35, m
        assert 0 < m["activations_peak"] < ref["activations_peak"] / 2  # 1 of the step's 4 sequences
        if shard == "fsdp":  # parameters and gradients too
            assert 0.2 < m["parameters"] / ref["parameters"] < 0.3 and m["gradients"] == m["parameters"]
        else:
            assert m["parameters"] == ref["parameters"] and m["gradients"] == ref["gradients"]
    assert sum(m["optimizer"] for m in ranks) >= ref["optimizer"]


@pytest.mark.parametrize("shard", SHARDS)
def test_dp4_sharded_resumes_bit_for_bit(shard, sharded_runs):
    a, b = _train_rows(sharded_runs / shard), _train_rows(sharded_runs / f"{shard}-resumed")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for key in ("loss", "total_loss", "grad_norm", "lr"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    ma = dsv3.load_pretrained(sharded_runs / shard / "latest")
    mb = dsv3.load_pretrained(sharded_runs / f"{shard}-resumed" / "latest")
    for (name, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


def test_dp_shard_option_is_checked_and_a_single_process_is_refused(make_opts):
    with pytest.raises(DSV3Error, match="--dp-shard must be one of none, zero1, fsdp"):
        make_opts(dp_shard="zero3").check()
    with pytest.raises(DSV3Error, match="only one is running"):
        run_training(make_opts(dp_shard="fsdp"), show_progress=False, plots=False)


def test_cli_refuses_dp_shard_on_one_process_with_one_error_line(train_argv, tmp_path, capsys):
    from dsv3.cli import main

    assert main(train_argv(tmp_path / "one", "--steps", "1", "--dp-shard", "zero1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --dp-shard zero1 shards over the data-parallel processes but only one")
    assert main(train_argv(tmp_path / "bad", "--dp-shard", "zero2")) == 2
    assert "error: --dp-shard must be one of none, zero1, fsdp" in capsys.readouterr().err


def test_owners_balance_the_elements_over_ranks():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 9, 8, 1, 1, 1, 6)]
    owners = assign_owners(params, 4)
    loads = [sum(p.numel() for p, r in zip(params, owners, strict=True) if r == rank) for rank in range(4)]
    assert owners == assign_owners(params, 4)
    assert max(loads) == 10 and min(loads) >= 8  # 36 elements: 10 | 9 | 8+1 | 6+1+1


def test_saved_tensor_meter_counts_the_peak_of_saved_activations_and_releases_them():
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(16, 32))
    meter = SavedTensorMeter()
    with meter.active():
        loss = (x @ w).relu().sum()  # saves x (for w's gradient; w itself is a parameter) and relu's output
    assert meter.peak == meter.live == 8 * 16 * 4 + 8 * 32 * 4
    loss.backward()
    assert meter.live == 0 and meter.peak == 8 * 16 * 4 + 8 * 32 * 4


def test_fsdp_gives_every_rank_as_many_eval_windows_even_when_there_are_fewer_than_ranks():
    from dsv3.parallel.sharding import FSDPParallelized

    fsdp = FSDPParallelized.__new__(FSDPParallelized)  # only the window rule: no process group needed
    fsdp.world = 4
    assert fsdp.windows_for_eval(list(range(9))) == list(range(8))
    assert fsdp.windows_for_eval([0]) == [0, 0, 0, 0]
    assert fsdp.windows_for_eval([0, 1, 2]) == [0, 1, 2] * 4  # each window as often: the same mean loss
