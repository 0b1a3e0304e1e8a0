"""A whole training run: data, model, optimizer, the step loop with evaluation, checkpoints and a
graceful stop, then plots, a sample and the summary. ``run_training`` is the Python API behind
``dsv3 train``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from dsv3.checkpoint import CheckpointValues, export_sharded, pretrained_config
from dsv3.config import ModelConfig, load_config, preset
from dsv3.data import (
    PackedSequences,
    SampleOrder,
    load_corpus,
    token_byte_lengths,
    tokenize_corpus,
    train_or_load_tokenizer,
)
from dsv3.data.tokenizer import OWN, TrainingTokenizer, default_cache_dir, load_tokenizer_folder, own_tokenizer
from dsv3.errors import DSV3Error
from dsv3.layout import Layout
from dsv3.model.init import seeded_values
from dsv3.model.transformer import Transformer
from dsv3.parallel.materialize import materialize
from dsv3.parallel.memory import FIELDS, SavedTensorMeter, gather_memory, rank_memory, resident_peak
from dsv3.parallel.parallelize import Parallelized, parallelize
from dsv3.run_dir import SHARDED_DIR
from dsv3.train import checkpoints as ckpt
from dsv3.train.activation_checkpointing import apply_activation_checkpointing
from dsv3.train.distributed import World, peer_failures, setup_world, teardown_world, training_layout
from dsv3.train.evaluate import eval_windows, evaluate
from dsv3.train.loop import RunState, StepRunner
from dsv3.train.metrics import MetricsLog, read_rows
from dsv3.train.options import TrainOptions
from dsv3.train.precision import apply_fp8, autocast
from dsv3.train.progress import TrainProgress
from dsv3.train.schedule import lr_factor
from dsv3.train.signals import GracefulStop

StepCallback = Callable[[dict[str, Any]], None]


@dataclass
class TrainingData:
    encoding: TrainingTokenizer  # the tokenizer, its BOS/EOS and chat template; saved with each checkpoint
    train: PackedSequences
    val: PackedSequences
    token_bytes: np.ndarray
    description: str

    @property
    def tokenizer(self) -> Tokenizer:
        return self.encoding.tokenizer


def model_config(opts: TrainOptions, resume_from: Path | None = None) -> ModelConfig:
    """The model's config: ``--init-from``'s checkpoint's (checked against its tensors; a resumed run's own
    checkpoint's, which saved it), else ``--config``'s or the preset's."""
    if opts.init_from:
        if opts.vocab_size:
            raise DSV3Error("--vocab-size cannot change the vocabulary of the --init-from checkpoint")
        cfg = (ModelConfig.from_json(resume_from / "config.json") if resume_from is not None
               else pretrained_config(opts.init_from))
    else:
        cfg = load_config(opts.config) if opts.config else preset(opts.preset)
    if opts.vocab_size:
        cfg = cfg.replace(vocab_size=opts.vocab_size)
    if opts.seq_len > cfg.max_position_embeddings:
        raise DSV3Error(
            f"--seq-len {opts.seq_len} exceeds the model's max_position_embeddings "
            f"({cfg.max_position_embeddings})"
        )
    return cfg.validate()


def prepare_data(opts: TrainOptions, vocab_size: int, world: World, progress: TrainProgress) -> TrainingData:
    """Corpus -> tokenizer -> token streams; rank 0 builds the caches while the others wait."""
    cache = Path(opts.cache_dir) if opts.cache_dir else default_cache_dir()
    if not world.is_main:
        world.barrier()
    t0 = time.perf_counter()
    checkpoint = load_tokenizer_folder(opts.tokenizer) if opts.tokenizer != OWN else None
    if checkpoint is not None:
        _check_vocab(checkpoint.tokenizer.get_vocab_size(), vocab_size, opts.tokenizer)
    corpus = load_corpus(opts.data or None, opts.val_fraction)
    encoding = checkpoint or own_tokenizer(
        train_or_load_tokenizer(corpus, vocab_size, cache, int(opts.bpe_train_mb * 2**20)))
    streams = tokenize_corpus(corpus, encoding, cache)
    if world.is_main:
        world.barrier()
    kind = f"tokenizer {opts.tokenizer}" if checkpoint is not None else "BPE"
    progress.note(
        f"data: {corpus.description}; {len(corpus.train)} documents "
        f"({len(streams.train):,} tokens) for training, {len(corpus.val)} held out "
        f"({len(streams.val):,} tokens); {kind} vocab {encoding.tokenizer.get_vocab_size()}; "
        f"ready in {time.perf_counter() - t0:.1f}s (cache: {cache})"
    )
    val_len = min(opts.seq_len, len(streams.val) - 1)
    if val_len < 1:
        raise DSV3Error("the held-out split has fewer than 2 tokens; add data or raise --val-fraction")
    return TrainingData(
        encoding,
        PackedSequences(streams.train, opts.seq_len, streams.train_mask),
        PackedSequences(streams.val, val_len, streams.val_mask),
        token_byte_lengths(encoding.tokenizer),
        corpus.description,
    )


def _check_vocab(tokenizer_size: int, vocab_size: int, folder: str) -> None:
    """The model's embedding must hold every id the tokenizer can produce."""
    if tokenizer_size > vocab_size:
        raise DSV3Error(f"--tokenizer {folder} has {tokenizer_size} token ids but the model's vocab_size is "
                        f"{vocab_size}; use --vocab-size {tokenizer_size} (or more), or a config that holds them")


def build_optimizer(model: torch.nn.Module, opts: TrainOptions):
    """AdamW with weight decay on matrices only (not norms or biases), and the warmup-cosine schedule.

    The fused AdamW kernel: on CPU torch's default is a per-tensor loop, which costs about half of a
    training step of the ``small`` preset (measured: 1.47 s of a 5 s step; fused: 0.06 s)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": part, "weight_decay": wd} for params, wd in ((decay, opts.weight_decay), (no_decay, 0.0))
              for part in _by_tensor_kind(params)]
    fused = all(p.device.type in ("cpu", "cuda") for p in model.parameters())
    optimizer = torch.optim.AdamW(groups, lr=opts.lr, betas=(opts.beta1, opts.beta2), fused=fused)
    warmup = opts.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, opts.steps, warmup, opts.min_lr_ratio)
    )
    return optimizer, scheduler


def _by_tensor_kind(params: list) -> list[list]:
    """``params`` split into plain tensors and DTensors (FSDP2 shards beside an EP rank's plain experts),
    since one fused AdamW call cannot mix them; one list when they are all of one kind."""
    from torch.distributed.tensor import DTensor

    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [sharded, plain] if sharded and plain else [params]


def build_model(cfg: ModelConfig, opts: TrainOptions, world: World, layout: Layout | None = None,
                init_from: CheckpointValues | None = None) -> Parallelized:
    """The model to train, with the numerics the options ask for, spread by ``layout`` (default: the one the
    options ask for on this world). The whole model is built on ``meta`` (no memory), laid out, then each rank
    materializes only its share (`materialize`): read from the checkpoint ``init_from`` (only the tensors,
    experts and rows this rank holds), or fresh from the seed, every tensor from its own name
    (`dsv3.model.init`), so any layout holds the values one process has. A resumed run then loads each rank's
    share from its own checkpoint (`Parallelized.load_state`), whatever layout wrote it."""
    torch.manual_seed(opts.seed)
    with torch.device("meta"):
        model = Transformer(cfg).train()
    if opts.precision == "fp8":
        apply_fp8(model)
    apply_activation_checkpointing(model, opts.ac)
    parallel = parallelize(model, layout or training_layout(opts, world), device=world.device)
    values = init_from if init_from is not None else seeded_values(cfg.initializer_range, opts.seed)
    materialize(parallel.model, world.device, values)
    return parallel


def with_layout(opts: TrainOptions, layout: Layout) -> TrainOptions:
    """``opts`` whose layout flags give ``layout`` (what run.json records after a resume chose another)."""
    return dataclasses.replace(opts, pp=layout.pp if layout.pp > 1 else None, ep=layout.ep if layout.ep > 1 else None,
                               dp_shard=layout.dp_shard, pp_schedule=layout.schedule,
                               microbatches=layout.microbatches)


def run_training(
    opts: TrainOptions,
    resume: bool = False,
    on_step: StepCallback | None = None,
    show_progress: bool = True,
    plots: bool = True,
    fit_layout: bool = False,
) -> dict[str, Any]:
    """Train (or continue) the run in ``opts.out`` to ``opts.steps``; returns the summary.
    ``on_step(row)`` sees every step's metrics row; ``plots=False`` skips the end-of-run PNGs.
    ``fit_layout``: a resume whose saved layout this world cannot hold takes the nearest one it can."""
    opts.check()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    world = setup_world(opts.device, opts.dist_timeout)
    try:
        with peer_failures(world, Path(opts.out), opts.dist_timeout):  # a dead or hung peer: one error line
            return _Run(opts, world, resume, on_step, show_progress, plots, fit_layout).execute()
    finally:
        teardown_world(world)


class _Run:
    def __init__(
        self,
        opts: TrainOptions,
        world: World,
        resume: bool,
        on_step: StepCallback | None,
        show_progress: bool,
        plots: bool,
        fit_layout: bool = False,
    ):
        self.opts, self.world, self.on_step, self.plots = opts, world, on_step, plots
        self.run_dir = Path(opts.out)
        self.progress = TrainProgress(opts.steps, opts.log_every, enabled=show_progress and world.is_main)
        # Everything that can refuse the run (its folder, model, layout, data, checkpoint) comes before the
        # run folder is written, so that a refused start leaves nothing behind (nor rewrites a run.json).
        self.resume_from = self._checkpoint_to_resume(resume)
        self.cfg = model_config(opts, self.resume_from)
        layout = self._layout(fit_layout)  # before the data, which may take minutes to prepare
        self.data = prepare_data(opts, self.cfg.vocab_size, world, self.progress)
        # a resumed run's weights come from its own checkpoint (`_restore`), not from --init-from's
        init_from = CheckpointValues(opts.init_from, self.cfg) if opts.init_from and not self.resume_from else None
        self.parallel = build_model(self.cfg, self.opts, world, layout, init_from)
        if init_from is not None:
            self.progress.note(f"weights from {opts.init_from}: this process read {init_from.bytes_read / 1e9:.3f} "
                               f"GB of the checkpoint's {init_from.total_bytes / 1e9:.3f} GB (what its layout holds)")
        self.model = self.parallel.model
        self.n_params = self.parallel.parameter_count()
        self.optimizer, self.scheduler = build_optimizer(self.model, opts)
        self.parallel.attach_optimizer(self.optimizer)
        self.memory_recorded = False
        self.state = RunState()
        self.autocast = autocast(opts.precision, world.device)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", enabled=world.is_main)
        self.last_eval: dict[str, Any] | None = None
        if self.resume_from is not None:
            self._restore(self.resume_from)
        self._claim_run_dir()
        self.order = SampleOrder(len(self.data.train), opts.seed)
        self.stepper = StepRunner(
            self.parallel,
            self.optimizer,
            self.scheduler,
            self.data.train,
            self.order,
            world,
            opts.batch_size,
            opts.grad_accum,
            opts.grad_clip,
            self.autocast,
        )
        self.val_windows = self.parallel.windows_for_eval(eval_windows(self.data.val, opts.eval_tokens))
        self.last_checkpoint: Path | None = self.resume_from
        self.stop_reason = "completed"

    # ---- start / resume -----------------------------------------------------------------
    def _checkpoint_to_resume(self, resume: bool) -> Path | None:
        """The checkpoint to continue from, or None for a fresh start. A run stopped before its first
        checkpoint left nothing to continue, so ``--resume`` then starts it afresh (and says so) rather
        than refusing: re-running the same command must always work."""
        latest = ckpt.latest_checkpoint(self.run_dir)
        if latest is not None and not resume:
            raise DSV3Error(
                f"{self.run_dir} already holds a run; continue it with --resume {self.run_dir} "
                "or choose another --out"
            )
        if resume and latest is None:
            self.progress.note(f"{self.run_dir} holds no complete checkpoint yet; starting the run afresh")
        return latest

    def _claim_run_dir(self) -> None:
        """Make the run folder this run's, once nothing can refuse the run: its options in run.json (so
        that ``--resume`` works from the first step on), without a killed process's leftovers."""
        if self.world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.clean_leftovers(self.run_dir)
            if self.resume_from is None:  # rows of an earlier attempt that saved nothing would mix with ours
                (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
            self.opts.save(self.run_dir / "run.json")
        self.world.barrier()

    def _layout(self, fit: bool) -> Layout:
        """The layout the options ask for on this world; on a resume without layout flags whose saved layout
        this world cannot hold, the nearest one it can, said (run.json records it once the run starts)."""
        opts, world = self.opts, self.world
        layout = training_layout(opts, world, fit, self.cfg.n_routed_experts)
        if layout.ep > 1 and self.cfg.n_routed_experts % layout.ep:
            source = f"the checkpoint {opts.init_from}" if opts.init_from else "the model"
            raise DSV3Error(f"--ep {layout.ep} must divide the routed experts, but {source} has "
                            f"{self.cfg.n_routed_experts} per MoE layer")
        chosen = with_layout(opts, layout)
        if chosen != opts:
            self.progress.note(f"the run's layout ({_layout_flags(opts)}) does not fit {world.size} process(es); "
                               f"resuming as {layout.describe()} (choose another with --pp, --ep, --dp-shard)")
            self.opts = chosen
        return layout

    def _restore(self, folder: Path) -> None:
        """Continue from ``folder``: each rank loads its share of the model and optimizer state (resharded
        when the layout changed), then the trainer state rank 0 saved."""
        saved = ckpt.load_trainer_state(folder)
        self.parallel.load_state(folder / SHARDED_DIR, self.optimizer)
        restore_hyperparameters(self.optimizer, saved["param_groups"])
        restore_schedule(self.scheduler, saved["scheduler"])
        self.state = RunState(**saved["run"])
        self.last_eval = ckpt.saved_summary(folder).get("last_eval")
        ckpt.restore_rng_state(saved["rng"])
        self.metrics.truncate_after(self.state.step)
        was, now = saved.get("layout"), self.parallel.layout.to_dict()
        moved = f" (saved under {_layout_text(was)}, now {_layout_text(now)})" if was and was != now else ""
        self.progress.note(f"resumed from {folder} at step {self.state.step}{moved}")

    # ---- the loop -----------------------------------------------------------------------
    def execute(self) -> dict[str, Any]:
        opts = self.opts
        self.progress.note(
            f"model: {self.n_params / 1e6:.2f}M parameters; {self.world.size} process(es) on "
            f"{self.world.device}; {opts.precision}; {opts.batch_size} x {opts.seq_len} tokens "
            f"per step; run folder {self.run_dir}"
        )
        self.progress.start(self.state.step)
        with GracefulStop() as stop:
            while self.state.step < opts.steps:
                row = self._step()
                self.metrics.write(row)
                self.progress.step(row)
                if self.on_step is not None:
                    self.on_step(row)
                self._after_step(self.world.any(stop.requested))
                if self.stop_reason != "completed":
                    break
        self.progress.close()
        return self._finish()

    def _step(self) -> dict[str, Any]:
        """One optimizer step; this process's first also measures every rank's memory into run.json."""
        if self.memory_recorded:
            return self.stepper.run(self.state)
        meter = SavedTensorMeter()
        with meter.active():
            row = self.stepper.run(self.state)
        self._record_memory(meter.peak)
        return row

    def _record_memory(self, activations_peak: int) -> None:
        """run.json's ``memory``: per-rank bytes of parameters, gradients, optimizer state and the peak of
        activations saved for backward over one step, and each rank's peak resident memory up to then (the
        load, the step and the optimizer state it created; a collective)."""
        mine = {**rank_memory(self.model, self.optimizer, activations_peak), "resident_peak": resident_peak()}
        per_rank = gather_memory(mine, self.world.rank, self.world.size, self.world.device, (*FIELDS, "resident_peak"))
        peaks = [rank.pop("resident_peak") for rank in per_rank]
        self.memory_recorded = True
        if self.world.is_main:
            layout = self.parallel.layout.to_dict()
            memory = {"step": self.state.step, "layout": layout, "per_rank": per_rank, "resident_peak": peaks}
            self.opts.save(self.run_dir / "run.json", extra={"memory": memory})

    def _after_step(self, stop_requested: bool) -> None:
        opts, step = self.opts, self.state.step
        if self.state.bad_in_a_row >= opts.max_bad_steps:
            self.stop_reason = "non-finite"
        elif stop_requested:
            self.stop_reason = "signal"
        if step % opts.eval_every == 0 or step == opts.steps:
            self._evaluate()
        if step % opts.save_every == 0 or step == opts.steps or self.stop_reason != "completed":
            self._save()
        if self.stop_reason == "non-finite":
            raise DSV3Error(
                f"the loss or gradient was non-finite for {self.state.bad_in_a_row} steps in a row "
                f"(up to step {step}); stopped. The last checkpoint, {self.last_checkpoint}, holds "
                "the weights from before those steps: lower --lr or check the data, then --resume"
            )

    def _evaluate(self) -> None:
        result = evaluate(
            self.parallel,
            self.data.val,
            self.val_windows,
            self.data.token_bytes,
            self.world,
            max(1, self.stepper.per_rank),
            self.autocast,
        )
        self.last_eval = {"kind": "eval", "step": self.state.step, **result}
        self.metrics.write(self.last_eval)
        self.progress.note(
            f"eval step {self.state.step}: val loss {result['val_loss']:.4f}, "
            f"{result['val_bpb']:.4f} bits/byte"
        )

    def _save(self) -> None:
        """Checkpoint this step (a collective): every rank writes its share of the model and optimizer state
        into the staging folder (DCP), then rank 0 adds the trainer state, the config and tokenizer (and at
        the end of the run the HF export) and renames the folder into place."""
        step = self.state.step
        if self.world.is_main:
            ckpt.prepare_staging(self.run_dir, step)
        self.world.barrier()
        staging = ckpt.staging_folder(self.run_dir, step)
        self.parallel.save_state(staging / SHARDED_DIR, self.optimizer)
        if self.world.is_main:
            self._publish(step)
        self.world.barrier()
        self.last_checkpoint = ckpt.latest_checkpoint(self.run_dir)

    def _publish(self, step: int) -> None:
        """Rank 0's part of a checkpoint, once every rank wrote its share."""
        trainer_state = {
            "scheduler": self.scheduler.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "rng": ckpt.rng_state(),
            "run": dataclasses.asdict(self.state),
            **self.parallel.checkpoint_fields(),
        }
        summary = {
            "step": step,
            "samples": self.state.samples,
            "tokens": self.state.tokens,
            "epoch": self.order.epoch_of(self.state.samples),
            "last_eval": self.last_eval,
            "options": self.opts.to_dict(),
        }
        export = step == self.opts.steps  # the run's end: its model in the HF layout too

        def write_extras(folder: Path) -> None:
            if export:
                export_sharded(folder / SHARDED_DIR, self.cfg, folder)  # a shard at a time, never whole
            else:
                self.cfg.save_json(folder / "config.json")
            self.data.encoding.save(folder, self.cfg.max_position_embeddings)

        ckpt.publish_checkpoint(self.run_dir, step, trainer_state, summary, write_extras, self.opts.keep_last)

    # ---- the end ------------------------------------------------------------------------
    def _finish(self) -> dict[str, Any]:
        rows = read_rows(self.run_dir / "metrics.jsonl") if self.world.is_main else []
        train_rows = [r for r in rows if r.get("kind") == "train" and r.get("loss") is not None]
        plots = {}
        sample = None
        if self.world.is_main and self.plots:
            from dsv3.train.plots import write_plots

            with torch.device("meta"):  # the layer names only: no weights, nothing gathered
                names = moe_layer_names(Transformer(self.cfg))
            plots = write_plots(rows, self.run_dir, names)
        if self.opts.sample_tokens:
            full = self.parallel.full_model()  # a collective: sampling needs the whole model
            if self.world.is_main:
                sample = self._sample(full)
        recent = [r["loss"] for r in train_rows[-10:]]
        return {
            "run_dir": str(self.run_dir),
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "stopped": self.stop_reason,
            "step": self.state.step,
            "steps": self.opts.steps,
            "tokens": self.state.tokens,
            "first_loss": train_rows[0]["loss"] if train_rows else None,
            "final_loss": sum(recent) / len(recent) if recent else None,
            "val_loss": self.last_eval["val_loss"] if self.last_eval else None,
            "val_bpb": self.last_eval["val_bpb"] if self.last_eval else None,
            "tokens_per_s": self.state.tokens / self.state.train_seconds
            if self.state.train_seconds
            else None,
            "train_seconds": self.state.train_seconds,
            "skipped_steps": self.state.skipped,
            "parameters": self.n_params,
            "world_size": self.world.size,
            "precision": self.opts.precision,
            "data": self.data.description,
            "plots": plots,
            "sample": sample,
        }

    def _sample(self, model) -> str:
        from dsv3.train.sample import sample_text

        text = sample_text(
            model, self.data.tokenizer, self.opts.sample_prompt, self.opts.sample_tokens, seed=self.opts.seed,
            eos_id=self.data.encoding.eos_id,
        )
        self.progress.note(f"sample (temperature 0.8, top-k 40):\n{self.opts.sample_prompt}{text}")
        return self.opts.sample_prompt + text


def moe_layer_names(model: Transformer) -> list[str]:
    """ "layer 3", ... for the main model's MoE layers and "MTP 1", ... for the MTP modules', in the order
    of ``model.moe_layers()`` (the order of the metrics' expert loads)."""
    n_main = model.config.num_hidden_layers
    names = {
        id(block.mlp): (f"layer {i}" if i < n_main else f"MTP {i - n_main + 1}")
        for i, block in enumerate(model.model.layers)
    }
    return [names.get(id(m), "MoE") for m in model.moe_layers()]


def restore_hyperparameters(optimizer: torch.optim.Optimizer, saved: list[dict]) -> None:
    """The saved param groups' hyper-parameters (the learning rate of the step to come, among others) onto
    this optimizer's groups, matched by weight decay: a layout may split the same two kinds of parameters
    (decayed matrices, the rest) into more groups (FSDP shards beside plain experts), so the groups' number
    and order need not match the run that saved them."""
    by_decay = {g["weight_decay"]: g for g in saved}
    for group in optimizer.param_groups:
        hyper = by_decay.get(group["weight_decay"])
        if hyper is None:
            raise DSV3Error(f"the checkpoint has no optimizer settings for weight decay {group['weight_decay']}; "
                            "it was saved by another run")
        group.update(hyper)


def restore_schedule(scheduler, saved: dict) -> None:
    """The saved learning-rate schedule (where it is: ``last_epoch``), onto a scheduler whose optimizer may
    have another number of param groups than the saved one's (see `restore_hyperparameters`); every group
    follows one schedule from one base learning rate, so each per-group list takes the first saved value."""
    groups = len(scheduler.optimizer.param_groups)
    state = {k: ([v[0]] * groups if isinstance(v, list) and v else v) for k, v in saved.items()}
    if "lr_lambdas" in state:
        state["lr_lambdas"] = [None] * groups  # plain functions are not saved; the scheduler keeps its own
    scheduler.load_state_dict(state)


def _layout_flags(opts: TrainOptions) -> str:
    """The layout options of a run, as its flags say them."""
    pp = f"--pp {opts.pp} --pp-schedule {opts.pp_schedule}, " if (opts.pp or 1) > 1 else ""
    return f"{pp}--ep {opts.ep or 1}, --dp-shard {opts.dp_shard}"


def _layout_text(layout: dict) -> str:
    """A layout as the flags that give it, e.g. "pp=1 dp=2 ep=2 dp_shard=none"."""
    return " ".join(f"{k}={layout.get(k)}" for k in ("pp", "dp", "ep", "dp_shard"))
