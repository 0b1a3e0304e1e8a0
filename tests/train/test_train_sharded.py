"""Sharded data parallelism on 4 gloo processes (CPU; the trainer as under torchrun), alone and with expert
parallelism. `--dp-shard zero1` and `--dp-shard fsdp` train the same steps as one process with the same
global batch, hold about a quarter of the optimizer state per rank (fsdp: of the parameters too), save
checkpoints that load as ordinary models, and resume bit for bit under the same layout. With `--ep 4` and
`--ep 2` (experts split over EP groups, replicated over the rest) the same holds for fsdp and zero1 (fp32,
5 steps, router biases included), and per-rank parameter + optimizer bytes fall as the layout says.
`--precision fp8` runs FP8 GEMMs (linears and experts) under every pp1 layout with losses close to the
single-process FP8 run. run.json records every rank's memory for every layout. One launch runs them all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dsv3
from dsv3.errors import DSV3Error
from dsv3.parallel.data_parallel import assign_owners
from dsv3.parallel.memory import SavedTensorMeter
from dsv3.testing.launch import launch
from dsv3.testing.sharded_ep_scenarios import counted_train_worker
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
# sharded x expert parallel (fp32, compared with one process): name -> options
SHARDED_EP = {
    "fsdp-ep4": {"dp_shard": "fsdp", "ep": 4, "gpus_per_node": 2},
    "fsdp-ep2": {"dp_shard": "fsdp", "ep": 2, "gpus_per_node": 1},
    "zero1-ep2": {"dp_shard": "zero1", "ep": 2, "gpus_per_node": 1},
}
# --precision fp8 under every pp1 layout of 4 processes
FP8_STEPS = 3
FP8_LAYOUTS = {
    "ddp": {},
    "ep4": {"ep": 4, "gpus_per_node": 2},
    "ep2": {"ep": 2, "gpus_per_node": 1},
    "zero1": {"dp_shard": "zero1"},
    "fsdp": {"dp_shard": "fsdp"},
    "fsdp-ep2": {"dp_shard": "fsdp", "ep": 2, "gpus_per_node": 1},
    "zero1-ep4": {"dp_shard": "zero1", "ep": 4, "gpus_per_node": 2},
}


@pytest.fixture(scope="module")
def single_fp8_run(tmp_path_factory, base_options):
    out = tmp_path_factory.mktemp("single-fp8") / "run"
    options = {**base_options, "steps": FP8_STEPS, "precision": "fp8"}
    run_training(TrainOptions(**options, out=str(out)), show_progress=False, plots=False)
    return out


@pytest.fixture(scope="module")
def sharded_launch(tmp_path_factory, base_options) -> tuple[Path, dict[str, list[dict]]]:
    """One launch of 4 gloo processes (the trainer as `torchrun --nproc-per-node 4 -m dsv3 train` runs it):
    for each sharding, 5 steps into ROOT/SHARD (checkpoints at 3 and 5), then a copy cut back to step 3
    resumed to 5 in ROOT/SHARD-resumed; the sharded x EP layouts into ROOT/NAME; the FP8 runs into
    ROOT/fp8-NAME. Returns ROOT and every run's summaries, one per rank, by folder name."""
    root = tmp_path_factory.mktemp("sharded")
    runs = []
    for shard in SHARDS:
        options = {**base_options, "dp_shard": shard}
        runs.append({"options": {**options, "out": str(root / shard)}})
        runs.append({"options": {**options, "out": str(root / f"{shard}-resumed")}, "resume": True,
                     "copy_from": str(root / shard), "drop_after": 3})
    for name, extra in SHARDED_EP.items():
        runs.append({"options": {**base_options, **extra, "out": str(root / name)}})
    for name, extra in FP8_LAYOUTS.items():
        options = {**base_options, **extra, "steps": FP8_STEPS, "precision": "fp8"}
        runs.append({"options": {**options, "out": str(root / f"fp8-{name}")}})
    per_rank = launch(counted_train_worker, 4, (runs,), timeout_s=600)
    by_run = {Path(spec["options"]["out"]).name: [r[i] for r in per_rank] for i, spec in enumerate(runs)}
    for name, summaries in by_run.items():
        assert [(s["world_size"], s["step"]) for s in summaries] == [(4, s["steps"]) for s in summaries], name
    return root, by_run


@pytest.fixture(scope="module")
def sharded_runs(sharded_launch) -> Path:
    return sharded_launch[0]


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
    from dsv3.layout import Layout
    from dsv3.parallel.parallelize import Parallelized

    fsdp = Parallelized.__new__(Parallelized)  # only the window rule: no process group needed
    fsdp.world, fsdp.layout, fsdp.pipe = 4, Layout(dp=4, dp_shard="fsdp"), None
    assert fsdp.windows_for_eval(list(range(9))) == list(range(8))
    assert fsdp.windows_for_eval([0]) == [0, 0, 0, 0]
    assert fsdp.windows_for_eval([0, 1, 2]) == [0, 1, 2] * 4  # each window as often: the same mean loss


# ---- sharded data parallelism x expert parallelism ---------------------------------------------------


def _router_biases(folder) -> list[torch.Tensor]:
    model = dsv3.load_pretrained(folder)
    return [m.gate.e_score_correction_bias for m in model.moe_layers()]


@pytest.mark.parametrize("name", SHARDED_EP)
def test_sharded_expert_parallel_trains_like_one_process(name, single_run, sharded_runs):
    """pp1 x ep4 x fsdp, ep2 x fsdp over dp4 and ep2 x zero1 over dp4: per-step losses (relative 1e-5),
    gradient norms (clipping counts every parameter once), expert loads summed over all ranks, the router
    biases after training and the saved model all equal the single-process run's."""
    one, four = _train_rows(single_run), _train_rows(sharded_runs / name)
    assert len(four) == STEPS
    for a, b in zip(one, four, strict=True):
        for key in ("loss", "mtp_loss", "balance_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
        assert a["expert_load"] == b["expert_load"]
    biases, reference = _router_biases(sharded_runs / name / "latest"), _router_biases(single_run / "latest")
    assert all(torch.equal(a, b) for a, b in zip(biases, reference, strict=True))
    assert max(float(b.abs().max()) for b in reference) > 0  # they moved
    torch.testing.assert_close(_logits(sharded_runs / name / "latest"), _logits(single_run / "latest"),
                               rtol=1e-4, atol=1e-5)


def _expert_and_other_bytes(folder) -> tuple[int, int]:
    model = dsv3.load_pretrained(folder)
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".mlp.experts." in n)
    return experts, sum(p.numel() * 4 for p in model.parameters()) - experts


@pytest.mark.parametrize("name", SHARDED_EP)
def test_sharded_expert_parallel_memory_per_rank(name, single_run, sharded_runs):
    """Per rank: fsdp holds 1/D of the non-expert parameters and 1/E of the experts, AdamW moments likewise;
    zero1 keeps every non-expert parameter but 1/D of all AdamW state (experts' split over their replicas)."""
    D, E, shard = 4, SHARDED_EP[name]["ep"], SHARDED_EP[name]["dp_shard"]
    experts, other = _expert_and_other_bytes(single_run / "latest")
    (ref,) = _memory(single_run)
    for m in _memory(sharded_runs / name):
        if shard == "fsdp":
            assert m["parameters"] == pytest.approx(other / D + experts / E, rel=0.02), m
            assert m["gradients"] == m["parameters"]
            assert m["optimizer"] == pytest.approx(2 * (other / D + experts / E), rel=0.02), m
        else:
            assert m["parameters"] == other + experts / E, m
            assert m["optimizer"] == pytest.approx(2 * (other + experts) / D, rel=0.15), m
        assert m["parameters"] + m["optimizer"] < 0.5 * (ref["parameters"] + ref["optimizer"])


# ---- --precision fp8 under every pp1 layout ------------------------------------------------------------


def _single_fp8_kinds(tiny_config) -> dict:
    from dsv3.config import load_config
    from dsv3.model import Transformer
    from dsv3.testing.sharded_ep_scenarios import module_kinds
    from dsv3.train.precision import apply_fp8

    model = Transformer(load_config(tiny_config))
    apply_fp8(model)
    return module_kinds(model)


@pytest.mark.parametrize("name", FP8_LAYOUTS)
def test_fp8_runs_fp8_gemms_under_every_layout(name, sharded_launch, tiny_config):
    """Every rank's model has the single process's FP8 form (only the output heads stay nn.Linear, the
    experts are FP8Experts) and really runs FP8 GEMMs, experts included."""
    expected = _single_fp8_kinds(tiny_config)
    assert expected["experts"] == ["FP8Experts"] and expected["fp8_linear"] > 0
    for rank, summary in enumerate(sharded_launch[1][f"fp8-{name}"]):
        assert summary["kinds"] == expected, rank
        assert summary["fp8_gemms"] > 0 and summary["fp8_expert_mlps"] > 0, rank
        assert summary["precision"] == "fp8"


@pytest.mark.parametrize("name", FP8_LAYOUTS)
def test_fp8_losses_match_the_single_process_fp8_run(name, single_fp8_run, sharded_runs):
    """Equal within FP8's own rounding, not bit for bit: the weight-gradient GEMM quantizes activations and
    output gradients in 128x1 tiles along the tokens, so its tiles (and scales) depend on which of the step's
    128 tokens a rank holds (32 here); the weights then differ at E4M3 rounding after each step (measured:
    gradient norms 1e-3 apart, losses up to 1e-4 over 5 steps). Under EP the V3 FP8 dispatch rounds the
    experts' inputs once more. The first step's forward runs on equal weights: without EP it matches to
    fp32 rounding (1e-6, below the 5e-5 by which a bf16 run differs), with the FP8 wire to 5e-5."""
    one, four = _train_rows(single_fp8_run), _train_rows(sharded_runs / f"fp8-{name}")
    assert [r["step"] for r in four] == list(range(1, FP8_STEPS + 1))
    first = 5e-5 if "ep" in name else 1e-6
    assert four[0]["loss"] == pytest.approx(one[0]["loss"], rel=first)
    for a, b in zip(one, four, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=5e-4), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2), a["step"]


def test_sharded_expert_parallel_layouts_are_checked_before_any_process_group():
    from dsv3.layout import Layout

    assert Layout(dp=4, ep=4, dp_shard="fsdp", gpus_per_node=2).check(4).ep == 4  # no longer refused
    assert Layout(dp=4, ep=2, dp_shard="zero1", gpus_per_node=1).check(4).dp_shard == "zero1"
    with pytest.raises(DSV3Error, match="--ep 3 must divide the number of data-parallel processes"):
        Layout(dp=4, ep=3, dp_shard="fsdp", gpus_per_node=1).check(4)
