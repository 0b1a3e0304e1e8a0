"""`dsv3 train`: train a V3-architecture model on the Python standard library (or your files).

Progress goes to stderr; with --json the run's summary is the one JSON object on stdout. Under
``dsv3 launch --nproc N train ...`` (or ``torchrun --nproc-per-node N -m dsv3 train ...``) the same command
trains data-parallel (with ``--pp P``: in P pipeline stages times N/P data-parallel replicas).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import typer

from dsv3.errors import DSV3Error, speaks_for_the_run
from dsv3.train.options import LAYOUT, PRECISIONS, TrainOptions, resume_command, resumed_options

app = typer.Typer(add_completion=False, help=__doc__, no_args_is_help=False)


@app.command()
def train(
    preset: str = typer.Option(
        None,
        help="Model preset (default nano: 3.2M parameters, learns in minutes on 2 "
        "CPU cores; small: about 100M).",
    ),
    config: str = typer.Option(
        None, help="A model config.json (or a folder holding one) instead of --preset."
    ),
    init_from: str = typer.Option(
        None, help="Fine-tune a DeepSeek-format checkpoint (HF-layout safetensors and config.json: V2, V3, FP8 "
        "blocks): the model's config and weights come from it, so --preset and --config cannot be given. Each "
        "process reads only the tensors its layout gives it.",
    ),
    data: list[str] = typer.Option(
        None,
        help="Text files, folders, globs, or JSONL of {\"text\": ...} or {\"messages\": [...]} chats "
        "(repeatable). Default: the running Python's standard library.",
    ),
    tokenizer: str = typer.Option(
        None, metavar="DIR", help="A folder with tokenizer.json (and tokenizer_config.json: BOS, EOS, chat "
        "template) to train with, or dsv3: a BPE trained on the data (default: dsv3).",
    ),
    out: str = typer.Option(
        None, help="Run folder for checkpoints, metrics and plots (default runs/PRESET-TIME)."
    ),
    steps: int = typer.Option(None, help="Total optimizer steps of the schedule (default: 1000)."),
    batch_size: int = typer.Option(
        None, help="Sequences per optimizer step, over all processes (default: 16)."
    ),
    grad_accum: int = typer.Option(None, help="Micro-steps per optimizer step (default: 1)."),
    seq_len: int = typer.Option(None, help="Tokens per sequence (default: 256)."),
    lr: float = typer.Option(None, help="Peak learning rate (default: 2e-3)."),
    min_lr_ratio: float = typer.Option(None, help="Cosine decays to lr times this (default: 0.1)."),
    warmup: int = typer.Option(None, help="Linear warmup steps (default: min(100, steps/10))."),
    weight_decay: float = typer.Option(None, help="AdamW weight decay (default: 0.1)."),
    grad_clip: float = typer.Option(None, help="Gradient-norm clipping (default: 1.0)."),
    precision: str = typer.Option(None, help=f"One of {', '.join(PRECISIONS)} (default: fp32)."),
    seed: int = typer.Option(None, help="Seeds the weights and the data order (default: 0)."),
    vocab_size: int = typer.Option(None, help="BPE vocabulary size (default: the model config's)."),
    val_fraction: float = typer.Option(
        None, help="Share of documents held out, by hash of name (default: 0.01)."
    ),
    eval_tokens: int = typer.Option(None, help="Held-out tokens per evaluation (default: 32768)."),
    moe_output_format: str = typer.Option(
        None, help="Simulate the MoE combine in bf16, e4m3, e5m2, logfmt8 or logfmt10 (straight-through)."
    ),
    ep: int = typer.Option(
        None,
        help="Expert parallelism over groups of N torchrun processes (N divides the number of "
        "processes): each holds 1/N of every MoE layer's routed experts, replicated across the groups.",
    ),
    dp_shard: str = typer.Option(
        None,
        help="Shard the data-parallel copies over the torchrun processes: none, zero1 (AdamW state) or "
        "fsdp (parameters, gradients and AdamW state: FSDP2) (default: none).",
    ),
    gpus_per_node: int = typer.Option(
        None, help="Processes per node for --ep's two-hop dispatch (default: 2)."
    ),
    pp: int = typer.Option(
        None,
        help="Pipeline parallelism: P stages on P torchrun processes (the processes / P are data-parallel "
        "replicas of the pipeline).",
    ),
    pp_schedule: str = typer.Option(
        None, help="Pipeline schedule with --pp: 1f1b, interleaved, zbv or dualpipev (default: 1f1b)."
    ),
    microbatches: int = typer.Option(
        None, "--micro-batches", help="Micro-batches per pipeline step with --pp (default: one per stage: P, or 2P for "
        "interleaved, zbv and dualpipev)."
    ),
    ac: str = typer.Option(
        None, help="Activation checkpointing: recompute in the backward instead of keeping activations. selective: "
        "the RMSNorms and MLA (V3's choice); full: every block. Same losses, less memory (default: none).",
    ),
    save_every: int = typer.Option(None, help="Checkpoint every N steps (default: 200)."),
    eval_every: int = typer.Option(None, help="Evaluate every N steps (default: 100)."),
    keep_last: int = typer.Option(None, help="Checkpoints kept (default: 3)."),
    log_every: int = typer.Option(
        None, help="Log line every N steps when stderr is not a terminal (default: 10)."
    ),
    sample_tokens: int = typer.Option(
        None, help="Tokens to sample at the end (0: none) (default: 0). Under --pp, --ep or --dp-shard fsdp "
        "this gathers the whole model on every rank; `dsv3 generate` on the export is the bounded way."
    ),
    sample_prompt: str = typer.Option(None, help="Prompt of the end-of-run sample (default: 'def')."),
    max_bad_steps: int = typer.Option(
        None, help="Stop after this many non-finite steps in a row (default: 5)."
    ),
    cache_dir: str = typer.Option(
        None, help="Tokenizer and token cache (default: $DSV3_CACHE or ~/.cache/dsv3)."
    ),
    device: str = typer.Option(None, help="auto, cpu or cuda (default: auto)."),
    threads: int = typer.Option(
        None,
        help="torch CPU threads (0: torch's default). On a small model and a busy "
        "machine, 1 thread is often as fast and far steadier (default: 0).",
    ),
    dist_timeout: float = typer.Option(
        None, help="Under torchrun: seconds a collective waits for another process before the run stops "
        "with an error (a process that died is noticed at once; this bounds one that hangs) (default: 600).",
    ),
    resume: str = typer.Option(None, help="Continue the run in this folder from its latest checkpoint."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON summary on stdout."),
) -> None:
    """Train a V3 model (MLA, DeepSeekMoE with aux-loss-free balancing, MTP) end to end."""
    given = {k: v for k, v in locals().items() if k not in ("resume", "json_out")}
    if given["data"] == []:
        given["data"] = None
    opts = _options(given, resume)
    from dsv3.train.run import run_training

    main_rank = speaks_for_the_run()  # under a launcher, rank 0 speaks for the run
    try:
        fit = resume is not None and all(given.get(name) is None for name in LAYOUT)  # no layout flags given
        summary = run_training(opts, resume=resume is not None, fit_layout=fit)
    except KeyboardInterrupt:
        if main_rank:
            print(interrupted_message(opts.out, int(os.environ.get("WORLD_SIZE", "1"))), file=sys.stderr)
        raise typer.Exit(130) from None
    if main_rank:
        print(summary_message(summary), file=sys.stderr)
        if json_out:
            print(json.dumps(summary))


def summary_message(summary: dict[str, Any]) -> str:
    """The run's outcome in one or two lines for stderr: what was trained and how well, or, for a run
    stopped early, that it stopped, where its last checkpoint is and how to continue. Fields a short
    run lacks (no evaluation yet, no step timed) are left out rather than printed as null."""
    parts = [f"{summary['step']} steps, {summary['tokens']:,} tokens"]
    if summary.get("tokens_per_s"):
        parts[0] += f" at {summary['tokens_per_s']:,.0f} tokens/s"
    if summary.get("first_loss") is not None and summary.get("final_loss") is not None:
        parts.append(f"train loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}")
    if summary.get("val_loss") is not None:
        parts.append(f"held-out {summary['val_loss']:.3f} nats/token = {summary['val_bpb']:.3f} bits/byte")
    text = "; ".join(parts)
    if summary.get("stopped", "completed") == "completed":
        return f"== {text}"
    where = summary.get("checkpoint")
    saved = f"last checkpoint {where}" if where else "no checkpoint was saved"
    resume = resume_command(summary["run_dir"], summary.get("world_size", 1))
    return (
        f"== stopped at step {summary['step']} of {summary['steps']} ({summary['stopped']}): {text}\n"
        f"== {saved}; continue with: {resume}"
    )


def interrupted_message(run_dir: str, world_size: int) -> str:
    """What an interrupted run (a second Ctrl-C, or one before training began) left on disk."""
    from dsv3.train.checkpoints import latest_checkpoint

    if not (Path(run_dir) / "run.json").exists():
        return f"interrupted before the run began; nothing was written to {run_dir}"
    resume = resume_command(run_dir, world_size)
    latest = latest_checkpoint(Path(run_dir))
    if latest is None:
        return f"interrupted before the first checkpoint: {run_dir} holds none; `{resume}` starts it afresh"
    return f"interrupted; last checkpoint {latest}; continue with: {resume}"


def _options(given: dict[str, Any], resume: str | None) -> TrainOptions:
    if resume is not None:
        if given.get("out") not in (None, resume):
            raise DSV3Error("--out and --resume name different folders; --resume continues the run in place")
        return resumed_options(TrainOptions.load(resume), {**given, "out": resume}).check()
    chosen = {k: v for k, v in given.items() if v is not None}
    if "init_from" in chosen and "preset" in chosen:  # TrainOptions has a default preset, so it says --config only
        raise DSV3Error("--init-from takes the model's config from the checkpoint; drop --preset and --config")
    if "out" not in chosen:
        name = chosen.get("preset", "nano") if not {"config", "init_from"} & set(chosen) else "custom"
        chosen["out"] = f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    opts = TrainOptions(**chosen).check()
    if opts.init_from and "tokenizer" not in chosen:
        opts.tokenizer = _checkpoint_tokenizer(opts.init_from)
    return opts


def _checkpoint_tokenizer(folder: str) -> str:
    """A fine-tuned model keeps its checkpoint's tokenizer (and chat template) unless told otherwise:
    training it on another tokenizer's ids would be a different model. A checkpoint without one is an
    error that names the two choices, never a silent switch to dsv3's own."""
    if not Path(folder).is_dir():
        raise DSV3Error(f"checkpoint folder not found: {folder}")
    if not (Path(folder) / "tokenizer.json").is_file():
        raise DSV3Error(f"--init-from {folder} has no tokenizer.json; pass --tokenizer DIR (a folder holding "
                        "the checkpoint's tokenizer) or --tokenizer dsv3 (train dsv3's own BPE on the data)")
    return folder
