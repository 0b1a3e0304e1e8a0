"""Multi-process checks of pipeline stages x ZeRO-1 (`dsv3.parallel.pipeline_zero1`), run by the tests
through `launch`: the specs of `pipeline_scenarios` trained through ``parallelize(model, Layout(...,
dp_shard="zero1"))`` and the trainer's own calls on its object (``attach_optimizer`` included). Every rank
returns its losses, router biases, which of its parameters it owns and which its AdamW holds state for.
"""

from __future__ import annotations

import torch

from dsv3.errors import DSV3Error
from dsv3.layout import Layout
from dsv3.model.transformer import Transformer
from dsv3.parallel.parallelize import parallelize
from dsv3.testing.pipeline_scenarios import PipeSpec, _optimizer, _state, spec_config, train_steps


def zero1_worker(rank: int, world: int, base, specs: list[PipeSpec]) -> list[dict]:
    """Runs every spec (each on all ``world`` ranks) under ZeRO-1 and returns this rank's results."""
    return [_zero1_run(rank, world, base, spec) for spec in specs]


def _zero1_run(rank: int, world: int, base, spec: PipeSpec) -> dict:
    if spec.world != world:
        raise DSV3Error(f"spec {spec.schedule} needs {spec.world} processes, {world} are running")
    cfg = spec_config(base, spec)
    torch.manual_seed(spec.seed)
    model = Transformer(cfg).train()
    layout = Layout(pp=spec.pp, dp=spec.dp, ep=spec.ep, schedule=spec.schedule, microbatches=spec.microbatches,
                    dp_shard="zero1")
    parallel = parallelize(model, layout)
    optimizer = _optimizer(parallel.model.parameters(), spec)
    parallel.attach_optimizer(optimizer)
    losses = train_steps(parallel, optimizer, spec, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    full = parallel.full_model()  # a collective
    biases = {k: v for k, v in _state(model).items() if k.endswith("e_score_correction_bias")}
    return {"losses": losses, "biases": biases, "layout": parallel.layout.describe(), "pp_rank": parallel.pipe.pp_rank,
            "data_rank": parallel.data_rank,
            "held": sorted(names[id(p)] for p in parallel.pipe.parameters()),
            "owned": sorted(names[id(p)] for p in parallel.updated_parameters()),
            "with_state": sorted(names[id(p)] for p in optimizer.state if optimizer.state[p]),
            "full_state": _state(full) if rank == 0 else None}
