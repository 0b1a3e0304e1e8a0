"""How a training run spreads over processes: one `Layout`, shared by the trainer (`dsv3.parallel.parallelize`
builds its device mesh from it), the planner (`dsv3 plan train` reasons about it and prints the `dsv3 train`
flags that give it) and the checkpoints (a run records it and a resume may pick another).

This module imports no torch: the planner stays light, and the layout's arithmetic (how many processes,
what divides what, which flags) is testable without processes.

The world of ``pp x dp`` processes is one mesh (torchtitan's ``ParallelDims`` in spirit):

* ``pp`` pipeline stages (schedules from `torch.distributed.pipelining`, DualPipeV among them);
* ``dp`` data-parallel replicas of each stage, replicated (``dp_shard="none"``), with the AdamW state
  sharded (``"zero1"``) or with parameters, gradients and AdamW state sharded (``"fsdp"``, FSDP2);
* ``ep`` of those replicas sharing each MoE layer's routed experts, as V3 borrows its data-parallel ranks for
  EP (``ep`` divides ``dp``; the experts are replicated over the ``dp / ep`` EP groups);
* ``tp``: tensor parallelism, which the planner models and the trainer does not run (it refuses tp > 1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from dsv3.errors import DSV3Error

SCHEDULES = ("1f1b", "interleaved", "zbv", "dualpipev")  # the pipeline schedules the trainer runs
PLANNED_SCHEDULES = ("dualpipe", *SCHEDULES)  # and the bidirectional DualPipe, which the planner models
STAGES_PER_RANK = {"1f1b": 1, "interleaved": 2, "zbv": 2, "dualpipev": 2, "dualpipe": 2}
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, folded: rank r holds stages r and 2P-1-r
SHARDINGS = ("none", "zero1", "fsdp")
DISPATCH_FORMATS = ("bf16", "fp8", "fp32")  # the EP all-to-all's wire formats (dsv3.parallel.wire)
COMBINE_FORMATS = ("bf16", "logfmt8", "logfmt10", "fp32")
SIMULATED_COMBINE_FORMATS = ("bf16", "e4m3", "e5m2", "logfmt8", "logfmt10")  # without EP (dsv3.precision.logfmt)
COMBINE_FOR_DISPATCH = {"fp32": "fp32", "bf16": "bf16", "fp8": "bf16"}  # V3: FP8 dispatch, BF16 combine


@dataclass(frozen=True)
class Layout:
    """``pp`` pipeline stages x ``dp`` data-parallel replicas (the world), ``ep`` of the replicas sharing each
    MoE layer's routed experts, ``dp_shard`` how the replicas are sharded, ``tp`` (planner only).
    ``gpus_per_node``, ``dispatch`` and ``combine`` shape the EP all-to-all (nodes of the two-hop dispatch,
    wire formats); ``combine`` None: the dispatch format's counterpart under EP (fp8 -> bf16), exact
    without EP; a format without EP simulates the combine. ``schedule`` and ``microbatches`` (None: one per
    pipeline stage) drive the pipeline."""

    pp: int = 1
    dp: int = 1
    ep: int = 1
    dp_shard: str = "none"
    tp: int = 1
    gpus_per_node: int = 1
    dispatch: str = "fp32"
    combine: str | None = None
    schedule: str = "1f1b"
    microbatches: int | None = None

    # ---- derived ----------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def ep_replicas(self) -> int:
        """How many copies of every routed expert there are (the number of EP groups in a stage)."""
        return self.dp // self.ep

    @property
    def node_size(self) -> int:
        """Processes per node of the EP all-to-all (one without EP, whatever ``gpus_per_node`` says)."""
        return self.gpus_per_node if self.ep > 1 else 1

    @property
    def ep_combine(self) -> str:
        """The EP combine's wire format."""
        return self.combine or COMBINE_FOR_DISPATCH.get(self.dispatch, "bf16")

    @property
    def stages(self) -> int:
        """Pipeline stages of the model (two per rank under the V schedules and interleaved 1F1B)."""
        return self.pp * STAGES_PER_RANK.get(self.schedule, 1) if self.pp > 1 else 1

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches per pipeline step: as asked, or one per stage (the fewest every schedule accepts)."""
        return self.microbatches or self.stages

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> Layout:
        """A layout that `to_dict` wrote (keys it does not know, from other versions, are dropped)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in known})

    def describe(self) -> str:
        """The layout in the trainer's flags' terms, e.g. ``pp=2 (1f1b) x dp=2, ep=2, dp_shard=none``."""
        pp = f"pp={self.pp} ({self.schedule}) x " if self.pp > 1 else ""
        tp = f", tp={self.tp}" if self.tp > 1 else ""
        return f"{pp}dp={self.dp}, ep={self.ep}, dp_shard={self.dp_shard}{tp}"

    def train_args(self) -> list[str]:
        """The ``dsv3 train`` flags that ask for this layout (the world size comes from torchrun)."""
        args: list[str] = []
        if self.pp > 1:
            args += ["--pp", str(self.pp), "--pp-schedule", self.schedule]
            if self.microbatches is not None:
                args += ["--micro-batches", str(self.microbatches)]
        if self.ep > 1:
            args += ["--ep", str(self.ep), "--gpus-per-node", str(self.gpus_per_node)]
        if self.dp_shard != "none":
            args += ["--dp-shard", self.dp_shard]
        return args

    # ---- checks -----------------------------------------------------------------------------------
    def check(self, world_size: int | None = None) -> Layout:
        """Itself when the trainer can run it (on ``world_size`` processes, when given), else a DSV3Error
        saying why, in the flags' terms."""
        for name in ("pp", "dp", "ep", "tp", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise DSV3Error(f"layout: {name} must be at least 1, got {getattr(self, name)}")
        if self.tp != 1:
            raise DSV3Error(f"tensor parallelism (tp={self.tp}) is modelled by `dsv3 plan` only; the trainer "
                            "runs pipeline, expert and data parallelism")
        if self.dp_shard not in SHARDINGS:
            raise DSV3Error(f"--dp-shard must be one of {', '.join(SHARDINGS)}, got {self.dp_shard!r}")
        if self.pp > 1:
            self._check_pipeline()
        if self.dp_shard != "none" and self.dp < 2:
            if self.pp > 1:
                raise DSV3Error(f"--pp {self.pp} with --dp-shard {self.dp_shard} shards each stage over its "
                                f"data-parallel replicas, but there is one; start a multiple of {self.pp} "
                                f"processes, at least {2 * self.pp}")
            raise DSV3Error(f"--dp-shard {self.dp_shard} shards over the data-parallel processes but only one is "
                            "running; start several with dsv3 launch --nproc N train ...")
        if self.ep > 1:
            self._check_ep()
        if world_size is not None and self.world != world_size:
            raise DSV3Error(f"the layout needs pp x dp = {self.world} processes, but {world_size} are running")
        if self.ep == 1 and self.combine is not None and self.combine not in SIMULATED_COMBINE_FORMATS:
            raise DSV3Error(f"--moe-output-format must be one of {', '.join(SIMULATED_COMBINE_FORMATS)}, "
                            f"got {self.combine!r}")
        return self

    def _check_pipeline(self) -> None:
        if self.schedule not in SCHEDULES:
            raise DSV3Error(f"--pp-schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.microbatches is not None and self.microbatches < 1:
            raise DSV3Error(f"--micro-batches must be at least 1, got {self.microbatches}")

    def _check_ep(self) -> None:
        if self.dp % self.ep:
            stage = f" of each pipeline stage (processes / --pp {self.pp})" if self.pp > 1 else ""
            raise DSV3Error(
                f"--ep {self.ep} must divide the number of data-parallel processes{stage} ({self.dp}): the "
                f"experts are split over groups of {self.ep} processes and replicated across the groups"
            )
        if self.ep % self.gpus_per_node:
            raise DSV3Error(f"--gpus-per-node {self.gpus_per_node} must divide --ep ({self.ep})")
        if self.dispatch not in DISPATCH_FORMATS or self.ep_combine not in COMBINE_FORMATS:
            raise DSV3Error(
                f"EP wire formats: dispatch must be one of {', '.join(DISPATCH_FORMATS)} and combine one of "
                f"{', '.join(COMBINE_FORMATS)}; got {self.dispatch!r} and {self.ep_combine!r}"
            )

    # ---- another world ----------------------------------------------------------------------------
    def fitted(self, world_size: int, n_experts: int | None = None) -> Layout:
        """This layout moved onto ``world_size`` processes, keeping what still fits: the pipeline stages when
        they divide the world, then the largest ``ep`` (at most the saved one) that divides the replicas, the
        experts and is a whole number of nodes, and the sharding when there are replicas to shard over.
        For a resume on a world that cannot hold the saved layout."""
        pp = self.pp if world_size % self.pp == 0 else 1
        dp = world_size // pp
        ep = 1
        for e in range(min(self.ep, dp), 0, -1):
            if dp % e == 0 and e % self.gpus_per_node == 0 and (n_experts is None or n_experts % e == 0):
                ep = e
                break
        gpus = self.gpus_per_node if ep > 1 else 1
        combines = COMBINE_FORMATS if ep > 1 else SIMULATED_COMBINE_FORMATS
        return Layout(pp=pp, dp=dp, ep=ep, dp_shard=self.dp_shard if dp > 1 else "none", gpus_per_node=gpus,
                      dispatch=self.dispatch, combine=self.combine if self.combine in combines else None,
                      schedule=self.schedule if pp > 1 else "1f1b",
                      microbatches=self.microbatches if pp > 1 else None)


# ---- the pipeline bubble ------------------------------------------------------------------------------
def pipeline_bubble(schedule: str, pp: int, F: float, B: float, W: float,
                    FB: float | None = None) -> tuple[str | None, float | None]:
    """The idle time of one pipeline step on ``pp`` ranks, as the DualPipe README gives it: (formula, seconds).

    ``F``, ``B`` and ``W`` are one micro-batch's forward, full backward and weight-gradient backward through
    one stage (one chunk); ``FB`` an overlapped forward-and-backward pair (the README's F&B), F + B when
    nothing overlaps. The README's PP counts stages: ``pp`` for 1F1B and the bidirectional DualPipe (two
    stages per rank, of the model's two copies), ``2 pp`` for DualPipeV (one copy folded in a V), so both
    DualPipes' (PP/2-1) is ``pp/2 - 1`` and ``pp - 1`` here. Never below zero (a W larger than the pair it
    fills in would be). ZBV's bubble is zero when F = B = W and the README gives no formula for it: (None,
    None). The one formula for the planner (`dsv3 plan train`) and the bubble benchmark (`dsv3 bench
    pipeline`)."""
    pair, pair_text = (F + B, "F&B = F+B") if FB is None else (FB, "F&B overlapped")
    if schedule == "1f1b":
        return "(PP-1)(F+B)", (pp - 1) * (F + B)
    if schedule == "interleaved":
        return "(PP-1)(F+B), F and B of one of a rank's stages (Megatron's interleaved bubble)", (pp - 1) * (F + B)
    if schedule == "dualpipev":
        return f"(PP/2-1)(F&B+B-3W), PP = 2P stages, {pair_text}", max(0.0, (pp - 1) * (pair + B - 3 * W))
    if schedule == "dualpipe":
        return f"(PP/2-1)(F&B+B-3W), PP = P stages, {pair_text}", max(0.0, (pp / 2 - 1) * (pair + B - 3 * W))
    if schedule == "zbv":
        return None, None
    raise DSV3Error(f"no bubble formula for schedule {schedule!r}; one of {', '.join(PLANNED_SCHEDULES)}")
