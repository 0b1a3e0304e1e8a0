"""A decode step over a paged latent cache against the same step over the plain cache, at the same context.

    .venv/bin/python benchmarks/paged_decode.py --threads 1 --contexts 256,2048 --batches 1,16 --json

The engine will give a batch a paged cache (``LatentCache.paged``: rows found through a page table and a shift,
pages of one pool shared between rows) that the C decode kernels read and write in place, finding each key's
page inside a tile. This times what that costs: for each dtype, batch size and context, the ``--preset`` shape
(``small`` by default) with random weights (on huge pages, as the engine keeps them) decodes ``--steps`` steps
per round through ``FastDecode``'s step kernel over a plain cache [L, B, S, .] and over a copy of it in
scattered pages of ``--page-tokens`` slots (a random permutation of a pool's pages), the two taking turns for
``--rounds`` rounds so that machine load hits them alike; each figure is the median over rounds of the mean
time per step. The caches hold random values (attention's cost does not depend on them), so no prefill is
timed or needed. Every row holds every slot (shift 0), so neither step needs a mask and the difference is the
paging alone. ``--ordered`` puts row b's pages one after another in the pool (the page table's look-ups
without the scattered reads: what the kernels' addressing costs); ``--huge-pages`` puts both caches on
transparent huge pages (``dsv3.model.huge_pages``, as the weights are), where a pool allocated once could live.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dsv3.config import preset
from dsv3.errors import DSV3Error
from dsv3.kernels.decode import FastDecode
from dsv3.kernels.decode_kernels import kernel_status
from dsv3.model import Transformer, huge_pages
from dsv3.model.mla import LatentCache
from dsv3.option_lists import parse_list

sys.path.insert(0, str(Path(__file__).parent))
from serve_scaling import parse_ints  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def paged_copy(cache: LatentCache, page_tokens: int, seed: int = 0, ordered: bool = False) -> LatentCache:
    """The plain cache's rows [L, B, S, .] in pages of ``page_tokens`` slots, each a random page (``ordered``: the
    next one) of a pool of exactly the pages needed (row b's slots [0, S) at shift 0)."""
    L, B, S, _ = cache.kv.shape
    cols = -(-S // page_tokens)
    order = (torch.arange(B * cols) if ordered
             else torch.randperm(B * cols, generator=torch.Generator().manual_seed(seed)))
    table = order.view(B, cols).to(torch.int32)
    pools = []
    for t in (cache.kv, cache.pe):
        padded = torch.zeros(L, B, cols * page_tokens, t.shape[-1], dtype=t.dtype)
        padded[:, :, :S] = t
        pool = torch.empty(L, B * cols, page_tokens, t.shape[-1], dtype=t.dtype)
        pool[:, order] = padded.view(L, B * cols, page_tokens, -1)
        pools.append(pool)
    return LatentCache.paged(*pools, table, torch.zeros(B, dtype=torch.int64))


def on_huge_pages(cache: LatentCache) -> LatentCache:
    """The same cache, its tensors copied onto huge pages."""
    kv, pe = huge_pages.clone(cache.kv), huge_pages.clone(cache.pe)
    if cache.table is not None:
        return LatentCache.paged(kv, pe, cache.table, cache.shift)
    view = LatentCache.__new__(LatentCache)
    view.kv, view.pe = kv, pe
    return view


def time_steps(model: Transformer, caches: dict[str, LatentCache], ctx: int, steps: int, rounds: int) -> dict:
    """Median seconds per step of each cache's decode, the caches taking turns; each has its own FastDecode (so
    its reused step descriptor stays its own) and decodes from slot ``ctx`` on, a new slot per step."""
    B = caches["plain"].rows
    decoders = {name: FastDecode(model) for name in caches}
    ids = torch.randint(0, model.config.vocab_size, (B, 1), generator=torch.Generator().manual_seed(ctx))
    at = {name: ctx for name in caches}
    times: dict[str, list[float]] = {name: [] for name in caches}
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms up
            for name, cache in caches.items():
                t0 = time.perf_counter()
                for _ in range(steps):
                    decoders[name].hidden_and_logits(ids, cache=cache, start_pos=at[name])
                    at[name] += 1
                if r:
                    times[name].append((time.perf_counter() - t0) / steps)
    for name, d in decoders.items():
        if d._step_kernel is None:
            raise DSV3Error(f"the {name} cache's steps did not run the step kernel ({kernel_status()})")
    return {name: statistics.median(t) for name, t in times.items()}


def run(args) -> dict:
    rows = []
    for dtype in args.dtypes:
        torch.manual_seed(0)
        model = Transformer(preset(args.preset)).to(DTYPES[dtype]).eval()
        huge_pages.move_module(model)  # where the engine keeps the weights it streams
        cfg = model.config
        for ctx in args.contexts:
            for b in args.batches:
                log(f"{dtype}, batch {b}, context {ctx}")
                plain = model.new_cache(b, ctx + args.steps * (args.rounds + 1) + 1, dtype=DTYPES[dtype])
                g = torch.Generator().manual_seed(1)
                for t in (plain.kv, plain.pe):
                    t.copy_(torch.randn(t.shape, generator=g))
                caches = {"plain": plain, "paged": paged_copy(plain, args.page_tokens, ordered=args.ordered)}
                if args.huge_pages:
                    caches = {name: on_huge_pages(c) for name, c in caches.items()}
                secs = time_steps(model, caches, ctx, args.steps, args.rounds)
                row = {"dtype": dtype, "batch": b, "context": ctx, "layers": cfg.num_hidden_layers,
                       "plain_ms": 1000 * secs["plain"], "paged_ms": 1000 * secs["paged"],
                       "paged_over_plain": secs["paged"] / secs["plain"]}
                log(f"  plain {row['plain_ms']:.2f} ms, paged {row['paged_ms']:.2f} ms: "
                    f"{row['paged_over_plain']:.3f}")
                rows.append(row)
    return {"benchmark": "paged_decode", "preset": args.preset, "page_tokens": args.page_tokens,
            "ordered": args.ordered, "huge_pages": args.huge_pages and huge_pages.available(),
            "threads": torch.get_num_threads(), "kernels": kernel_status(), "steps": args.steps,
            "rounds": args.rounds, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", help="the model's shape (random weights)")
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--contexts", default="256,2048")
    ap.add_argument("--batches", default="1,16", help="rows per decode step")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round and cache")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--ordered", action="store_true", help="each row's pages in order (not scattered)")
    ap.add_argument("--huge-pages", action="store_true", help="both caches on transparent huge pages")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        args.contexts, args.batches = parse_ints(args.contexts, "--contexts"), parse_ints(args.batches, "--batches")
        args.dtypes = parse_list(args.dtypes, "--dtypes")
        if any(d not in DTYPES for d in args.dtypes):
            raise DSV3Error(f"--dtypes: each one of {', '.join(DTYPES)}, got {','.join(args.dtypes)!r}")
        if min(args.page_tokens, args.threads, args.steps, args.rounds) < 1:
            raise DSV3Error("--page-tokens, --threads, --steps and --rounds must be >= 1")
        preset(args.preset)
        torch.set_num_threads(args.threads)
        result = run(args)
    except DSV3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"kernels: {result['kernels']}; {result['threads']} thread(s); pages of {result['page_tokens']} slots"
          f"{', in order' if result['ordered'] else ', scattered'}{'; on huge pages' if result['huge_pages'] else ''}")
    for row in result["rows"]:
        print(f"{row['dtype']} batch {row['batch']} context {row['context']}: plain {row['plain_ms']:.2f} ms/step, "
              f"paged {row['paged_ms']:.2f} ms/step ({row['paged_over_plain']:.3f}x)")


if __name__ == "__main__":
    main()
