"""What one MTP speculative step costs next to a plain step at batch 1, with the full draft head and with the
draft restricted to K tokens (``--draft-vocab``), all in one process with their decode rounds alternating
(so machine load moves them together), beside the bytes each step reads.

    .venv/bin/python benchmarks/mtp_step_cost.py --preset small --dtype bf16 --draft-vocab 512,1024,2048
    .venv/bin/python benchmarks/mtp_step_cost.py --model runs/quickstart/latest --draft-vocab 512,1024,2048

Random weights (``--preset``) draft from the first K ids and accept almost nothing, so every speculative step
there runs the MTP layer over one committed token; a trained checkpoint (``--model``, with its
``draft_vocab.json``) runs it over two when the draft is accepted. ``--baseline-engine FILE`` adds the same
steps through another version of ``dsv3/infer/engine.py`` (e.g. the one before a change, from
``git show REV:src/dsv3/infer/engine.py``) on the same model and kernels: its per-step bookkeeping before
and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import torch

from dsv3.config import preset
from dsv3.infer.draft_vocab import load as load_draft_vocab
from dsv3.infer.engine import Engine, Request
from dsv3.infer.loading import load_model
from dsv3.model import Transformer
from dsv3.option_lists import parse_list
from dsv3.run_dir import resolve_checkpoint

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from decode_speed import mtp_byte_bound  # noqa: E402


def baseline_engine_class(path: str):
    """The Engine class of another engine.py, imported against this dsv3 (its other modules)."""
    spec = importlib.util.spec_from_file_location("baseline_engine", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_engine"] = module
    spec.loader.exec_module(module)
    return module.Engine, module.Request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", help="random weights of this preset (unless --model)")
    ap.add_argument("--model", default=None, help="a trained checkpoint (its draft_vocab.json for --draft-vocab)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                    help="auto: as stored (--model), bf16 (--preset)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--draft-vocab", default="512,1024,2048")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per variant (after one warm-up)")
    ap.add_argument("--baseline-engine", default=None, metavar="FILE")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "auto": None}[args.dtype]
    if args.model:
        folder = resolve_checkpoint(args.model)
        model = load_model(folder, dtype)
    else:
        folder = None
        torch.manual_seed(0)
        model = Transformer(preset(args.preset)).to(dtype or torch.bfloat16).eval()
    V = model.config.vocab_size
    ks = parse_list(args.draft_vocab, "--draft-vocab", int)
    eos = frozenset()
    variants = {"plain": (Engine(model, eos_token_ids=eos), Request), "mtp": (Engine(
        model, eos_token_ids=eos, speculative=True), Request)}
    if args.baseline_engine:
        old, old_request = baseline_engine_class(args.baseline_engine)
        variants["plain (baseline engine)"] = (old(model, eos_token_ids=eos), old_request)
        variants["mtp (baseline engine)"] = (old(model, eos_token_ids=eos, speculative=True), old_request)
    for k in ks:
        ids = load_draft_vocab(folder, k, V) if folder else torch.arange(k)
        variants[f"mtp K={k}"] = (Engine(model, eos_token_ids=eos, speculative=True, draft_vocab=ids), Request)
    prompt = torch.randint(0, V, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    total = args.steps * (args.rounds + 1) + 8
    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        batches = {name: engine.start([request(prompt, 2 * total)]) for name, (engine, request) in variants.items()}
        for rnd in range(args.rounds + 1):
            for name, batch in batches.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    batch.step()
                if rnd:
                    times[name].append((time.perf_counter() - t0) / args.steps)
    step = {name: statistics.median(ts) for name, ts in times.items()}
    rows = []
    for name, batch in batches.items():
        s = batch.stats
        k = next((k for k in ks if name == f"mtp K={k}"), None)
        row = {"variant": name, "ms_per_step": 1000 * step[name], "step_cost_ratio": step[name] / step["plain"],
               "acceptance_rate": s.acceptance_rate, "tokens_per_step": s.tokens / s.main_forwards}
        if name.startswith("mtp"):
            row["speedup_at_acceptance"] = {str(a): (1 + a) / row["step_cost_ratio"] for a in (0.7, 0.8, 0.9)}
            row["byte_bound"] = {str(a): mtp_byte_bound(model, a, k) for a in (0.7, 0.8, 0.9)}
        rows.append(row)
    dtype_name = str(next(model.parameters()).dtype).replace("torch.", "")
    result = {"benchmark": "mtp_step_cost", "model": args.model or args.preset, "dtype": dtype_name,
              "context": args.context, "threads": args.threads, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return
    for r in rows:
        line = f"{r['variant']:24s} {r['ms_per_step']:7.2f} ms/step  {r['step_cost_ratio']:.2f} plain steps"
        if "byte_bound" in r:
            b = r["byte_bound"]["0.7"]
            line += (f"  -> {r['speedup_at_acceptance']['0.7']:.2f}x at 70% acceptance "
                     f"(bytes: {b['step_bytes_ratio']:.2f} plain steps, at most {b['speedup']:.2f}x)")
        print(line)


if __name__ == "__main__":
    main()
