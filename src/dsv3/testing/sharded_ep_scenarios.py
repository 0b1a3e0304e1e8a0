"""Training runs on the processes of `dsv3.testing.launch` (as `dsv3.testing.sharding_scenarios` does) that
also record whether FP8 really ran: the kinds of linear layers and experts the trainer built, and how many
FP8 GEMMs and FP8 expert MLPs executed on this rank. A layout that silently dropped FP8 (kept nn.Linear, or
plain experts, or bypassed them) shows up here even when its losses look close."""

from __future__ import annotations

from collections import Counter

from torch import nn


def module_kinds(model: nn.Module) -> dict:
    """The high-precision ``nn.Linear`` layers left (their names), the number of FP8Linear layers, and the
    kinds of routed experts, of a built (possibly expert-parallel or sharded) model."""
    from dsv3.model.moe import MoE
    from dsv3.precision.fp8_linear import FP8Linear

    return {
        "linear": sorted(name for name, m in model.named_modules() if type(m) is nn.Linear),
        "fp8_linear": sum(isinstance(m, FP8Linear) for m in model.modules()),
        "experts": sorted({type(m.experts).__name__ for m in model.modules() if isinstance(m, MoE)}),
    }


def counted_train_worker(rank: int, world: int, runs: list[dict]) -> list[dict]:
    """`sharding_scenarios.train_worker` run by run, each summary with ``kinds`` (`module_kinds` of the model
    the trainer built), ``fp8_gemms`` and ``fp8_expert_mlps`` (calls on this rank during the run)."""
    from dsv3.model import experts
    from dsv3.precision import fp8_linear
    from dsv3.testing.sharding_scenarios import train_worker
    from dsv3.train import run

    counts: Counter = Counter()
    kinds: list[dict] = []
    gemm, mlp, build = fp8_linear._gemm, experts.FP8Experts.expert_mlp, run.build_model

    def counted_gemm(*args, **kwargs):
        counts["fp8_gemms"] += 1
        return gemm(*args, **kwargs)

    def counted_mlp(self, *args):
        counts["fp8_expert_mlps"] += 1
        return mlp(self, *args)

    def recorded_build(*args, **kwargs):
        parallel = build(*args, **kwargs)
        kinds.append(module_kinds(parallel.model))
        return parallel

    fp8_linear._gemm, experts.FP8Experts.expert_mlp, run.build_model = counted_gemm, counted_mlp, recorded_build
    summaries = []
    for spec in runs:
        counts.clear()
        (summary,) = train_worker(rank, world, [spec])
        summaries.append({**summary, "kinds": kinds[-1], **counts})
    return summaries
