"""Training throughput on CPU: dsv3's training step vs transformers' DeepseekV3ForCausalLM, same weights.

Both models hold the same weights (ours saved with ``save_pretrained``, transformers' loaded from that
folder with ``from_pretrained``); both run forward, next-token cross-entropy, backward and an AdamW step
on the same batch. Ours also does what V3 training needs and transformers does not: the sequence-wise
balance loss, the expert-load count and the aux-loss-free bias update. The MTP module is left out of
the comparison (transformers has none); ``--mtp`` adds a third measurement of our step with it.
Steps alternate between the implementations so machine load hits both alike; after warm-up, the
median of the timed steps is reported.

    .venv/bin/python benchmarks/train_throughput.py --preset nano --batch-size 8 --steps 7 --json

Prints one JSON object: tokens/s of each, and ``speedup`` = dsv3 tokens/s / transformers tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from dsv3.config import preset
from dsv3.model import Transformer


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_models(preset_name: str, mtp: bool):
    """(ours without MTP, transformers' on the same weights, ours with MTP or None)."""
    import transformers

    cfg = preset(preset_name).replace(num_nextn_predict_layers=0)
    torch.manual_seed(0)
    ours = Transformer(cfg).train()
    with tempfile.TemporaryDirectory() as folder:
        ours.save_pretrained(folder, rope_layout="new")
        hf_cfg = transformers.DeepseekV3Config.from_dict(cfg.to_dict(rope_layout="new"))
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
            folder, config=hf_cfg, dtype=torch.float32
        ).train()
    with_mtp = None
    if mtp:
        torch.manual_seed(0)
        with_mtp = Transformer(preset(preset_name)).train()
    return ours, hf, with_mtp


def ours_step(model: Transformer, optimizer, inputs, labels) -> None:
    out = model.loss(inputs, labels)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.update_router_biases()


def hf_step(model, optimizer, inputs, labels) -> None:
    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(step, *args, precision: str = "fp32") -> float:
    """Wall time of one step; bf16 runs it under CPU autocast (both models alike)."""
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        step(*args)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per implementation (>= 5)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--mtp", action="store_true", help="also time our step with the MTP module")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: CPU autocast for both")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ours, hf, with_mtp = build_models(args.preset, args.mtp)
    vocab = ours.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=g)
    inputs, labels = rows[:, :-1], rows[:, 1:]
    runs = {"dsv3": (ours_step, ours), "transformers": (hf_step, hf)}
    if with_mtp is not None:
        runs["dsv3_with_mtp"] = (ours_step, with_mtp)
    optimizers = {
        name: torch.optim.AdamW(m.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        for name, (_, m) in runs.items()
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.warmup + args.steps):
        for name, (step, model) in runs.items():
            dt = timed(step, model, optimizers[name], inputs, labels, precision=args.precision)
            if i >= args.warmup:
                times[name].append(dt)
        log(f"step {i}: " + ", ".join(f"{n} {t[-1] * 1e3:.0f} ms" for n, t in times.items() if t))
    tokens = args.batch_size * args.seq_len
    result = {
        "preset": args.preset,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "timed_steps": args.steps,
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "hf_experts_implementation": getattr(hf.config, "_experts_implementation", None),
        **{f"{name}_tokens_per_s": tokens / statistics.median(t) for name, t in times.items()},
        **{f"{name}_step_ms": [round(x * 1e3, 1) for x in t] for name, t in times.items()},
    }
    result["speedup"] = result["dsv3_tokens_per_s"] / result["transformers_tokens_per_s"]
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
