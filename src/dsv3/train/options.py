"""`TrainOptions`: everything that defines a training run, saved as RUN_DIR/run.json.

A resumed run reads its options back from run.json, so it continues the same run; only the
operational knobs (how often to save, evaluate, log; what to recompute, ``--ac``, which changes memory and not
the numbers), the total number of steps and the layout (``--ep``,
``--pp``, ``--dp-shard``, and the number of processes) may change.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv3.errors import DSV3Error
from dsv3.io import atomic_write_text
from dsv3.layout import SCHEDULES
from dsv3.layout import SHARDINGS as DP_SHARDS

PRECISIONS = ("fp32", "bf16", "fp8")
AC_MODES = ("none", "selective", "full")  # what --ac recomputes (dsv3.train.activation_checkpointing)

# May differ between the original run and a resumption without changing what is computed.
OPERATIONAL = {
    "out",
    "steps",
    "save_every",
    "eval_every",
    "keep_last",
    "log_every",
    "sample_tokens",
    "sample_prompt",
    "max_bad_steps",
    "cache_dir",
    "device",
    "threads",
    "dist_timeout",
    "ac",  # activation checkpointing recomputes the same numbers: losses are bit for bit those without it
}
# How the processes split the work: a checkpoint is resharded on load, so a resumption may change these too
# (the losses then agree with the original layout's to fp32 rounding).
LAYOUT = {"ep", "dp_shard", "gpus_per_node", "pp", "pp_schedule", "microbatches"}


@dataclass
class TrainOptions:
    preset: str = "nano"
    config: str | None = None  # a config.json (or checkpoint folder) instead of the preset
    data: list[str] = field(default_factory=list)  # empty: the Python standard library
    out: str = "runs/nano"
    steps: int = 1000  # the schedule's total number of optimizer steps
    batch_size: int = 16  # sequences per optimizer step, over all ranks and micro-steps
    grad_accum: int = 1
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * this (V3: 2.2e-4 -> 2.2e-5)
    warmup: int | None = None  # default: min(100, steps // 10)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    precision: str = "fp32"
    seed: int = 0
    vocab_size: int | None = None  # default: the model config's
    tokenizer: str = "dsv3"  # dsv3: a BPE trained on the data; else a folder holding tokenizer.json
    val_fraction: float = 0.01
    bpe_train_mb: float = 16.0  # BPE is trained on at most this much of the training split
    eval_tokens: int = 32768  # held-out tokens per evaluation
    moe_output_format: str | None = None  # simulate the MoE combine in bf16/e4m3/e5m2/logfmt8/logfmt10
    ep: int | None = None  # expert-parallel world size
    dp_shard: str = "none"  # sharded data parallelism: none, zero1 (optimizer state) or fsdp (everything)
    gpus_per_node: int = 2
    pp: int | None = None  # pipeline stages (ranks); the data-parallel replicas are the processes / pp
    pp_schedule: str = "1f1b"
    microbatches: int | None = None  # per pipeline step; default one per pipeline stage
    # operational
    save_every: int = 200
    eval_every: int = 100
    keep_last: int = 3
    log_every: int = 10
    sample_tokens: int = 0
    sample_prompt: str = "def"
    max_bad_steps: int = 5
    cache_dir: str | None = None
    device: str = "auto"
    threads: int = 0  # torch intra-op threads; 0: torch's default (torchrun sets 1 per process)
    dist_timeout: float = 600.0  # seconds a collective waits for a process that died or hung
    ac: str = "none"  # activation checkpointing: none, selective (RMSNorms and MLA) or full (every block)

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(100, self.steps // 10)

    def check(self) -> TrainOptions:
        """Raise one clear DSV3Error for the first impossible setting."""
        positive = (
            "steps",
            "batch_size",
            "grad_accum",
            "seq_len",
            "save_every",
            "eval_every",
            "keep_last",
            "log_every",
            "eval_tokens",
            "max_bad_steps",
            "gpus_per_node",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise DSV3Error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise DSV3Error(f"--lr must be positive, got {self.lr}")
        if self.precision not in PRECISIONS:
            raise DSV3Error(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.warmup is not None and not 0 <= self.warmup <= self.steps:
            raise DSV3Error(f"--warmup must be between 0 and --steps ({self.steps}), got {self.warmup}")
        if self.batch_size % self.grad_accum:
            raise DSV3Error(
                f"--batch-size ({self.batch_size}) must be a multiple of --grad-accum ({self.grad_accum})"
            )
        if self.ep is not None and self.ep < 1:
            raise DSV3Error(f"--ep must be at least 1, got {self.ep}")
        self._check_pipeline()
        if self.ac not in AC_MODES:
            raise DSV3Error(f"--ac must be one of {', '.join(AC_MODES)}, got {self.ac!r}")
        if self.dp_shard not in DP_SHARDS:
            raise DSV3Error(f"--dp-shard must be one of {', '.join(DP_SHARDS)}, got {self.dp_shard!r}")
        if not self.dist_timeout > 0:
            raise DSV3Error(f"--dist-timeout must be a positive number of seconds, got {self.dist_timeout}")
        if self.threads < 0:
            raise DSV3Error(f"--threads must be >= 0, got {self.threads}")
        if self.sample_tokens < 0:
            raise DSV3Error(f"--sample-tokens must be >= 0, got {self.sample_tokens}")
        return self

    def _check_pipeline(self) -> None:
        if self.pp is not None and self.pp < 1:
            raise DSV3Error(f"--pp must be at least 1, got {self.pp}")
        if self.pp_schedule not in SCHEDULES:
            raise DSV3Error(f"--pp-schedule must be one of {', '.join(SCHEDULES)}, got {self.pp_schedule!r}")
        if self.microbatches is not None and self.microbatches < 1:
            raise DSV3Error(f"--micro-batches must be at least 1, got {self.microbatches}")
        if (self.pp or 1) == 1 and (self.microbatches is not None or self.pp_schedule != "1f1b"):
            raise DSV3Error("--pp-schedule and --micro-batches shape pipeline stages: they need --pp 2 or more")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path: Path, extra: dict[str, Any] | None = None) -> None:
        """Write the options, and ``extra`` fields (run.json's measured ``memory``; `load` ignores them)."""
        atomic_write_text(path, json.dumps({**self.to_dict(), **(extra or {})}, indent=2) + "\n")

    @classmethod
    def load(cls, run_dir: Path) -> TrainOptions:
        path = Path(run_dir) / "run.json"
        if not path.exists():
            raise DSV3Error(f"{run_dir} is not a training run folder (no run.json)")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as exc:
            raise DSV3Error(f"{path} is not a valid run file: {exc}") from None


def resumed_options(saved: TrainOptions, given: dict[str, Any]) -> TrainOptions:
    """The saved options with the operational ones the user gave again; a changed defining option is
    an error (it would silently make a different run)."""
    changes = {}
    for name, value in given.items():
        if value is None or value == getattr(saved, name):
            continue
        if name not in OPERATIONAL | LAYOUT:
            raise DSV3Error(
                f"--{name.replace('_', '-')} {value!r} differs from the resumed run's "
                f"{getattr(saved, name)!r}; start a new run with --out to change it"
            )
        changes[name] = value
    if (changes.get("pp", saved.pp) or 1) == 1:  # a resume without stages drops the saved run's schedule
        changes.setdefault("pp_schedule", "1f1b")
        changes.setdefault("microbatches", None)
    return dataclasses.replace(saved, **changes)


def resume_command(run_dir: str | Path, world_size: int) -> str:
    """The command that continues the run in ``run_dir`` as it ran, runnable as printed: on ``world_size``
    processes (started by ``dsv3 launch``; across nodes, by torchrun) with the run's layout flags."""
    try:
        saved = TrainOptions.load(run_dir)
    except DSV3Error:  # no (readable) run.json: nothing to continue from but the folder
        saved = TrainOptions()
    defaults = TrainOptions()
    flags = [word for name in sorted(LAYOUT) if getattr(saved, name) != getattr(defaults, name)
             for word in (f"--{name.replace('_', '-')}", str(getattr(saved, name)))]
    train = ["train", "--resume", str(run_dir), *flags]
    if world_size == 1:
        return shlex.join(["dsv3", *train])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if per_node == world_size:
        return shlex.join(["dsv3", "launch", "--nproc", str(world_size), *train])
    return shlex.join(["torchrun", "--nnodes", str(world_size // per_node), "--nproc-per-node", str(per_node),
                       "--rdzv-endpoint", "HOST:PORT", "-m", "dsv3", *train])
