"""Multi-process checks of expert-parallel serving, run through `launch` by the tests and by
``benchmarks/serve_ep_formats.py``: every rank loads one checkpoint, spreads its experts with the serving
lockstep (``dsv3.infer.cluster``), decodes its share of the prompts greedily through the same `RankWorker`
the server uses, and computes teacher-forced logits of its share of given sequences. The caller compares
both with one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv3.infer.cluster.lockstep import Lockstep, make_lockstep
from dsv3.infer.cluster.rank import Control, RankWorker, WireRequest
from dsv3.infer.engine import Engine
from dsv3.infer.sampling import GREEDY


def ep_generation(rank: int, world: int, checkpoint: str, prompts: list[list[int]], max_tokens: int,
                  sequences: list[list[int]], formats: list[tuple[str, str]]) -> list[dict]:
    """For each (dispatch, combine) in ``formats``: {"tokens": {prompt index: greedy ids}, "logits":
    {sequence index: [T, V]}} for this rank's share (index % world == rank)."""
    import dsv3

    out = []
    for dispatch, combine in formats:
        engine = Engine(dsv3.load_pretrained(checkpoint), None)
        lockstep = make_lockstep(engine.model, [list(range(world))], dispatch, combine)
        worker = RankWorker(engine, lockstep, rank)
        tokens = generate(worker, prompts, max_tokens, world)
        logits = teacher_forced(engine, lockstep, {i: s for i, s in enumerate(sequences) if i % world == rank})
        out.append({"tokens": tokens, "logits": logits})
    return out


def generate(worker: RankWorker, prompts: list[list[int]], max_tokens: int, world: int) -> dict[int, list[int]]:
    """Greedy completions of prompt i on rank i % world, stepping every rank until all are done."""
    new = {r: [WireRequest(i, p, max_tokens, GREEDY, frozenset(), (), None) for i, p in enumerate(prompts)
               if i % world == r] for r in range(world)}
    control, tokens = Control(new=new), {}
    while True:
        for ev in worker.step(control).events:
            tokens.setdefault(ev.rid, []).extend(ev.token_ids)
        control = Control()
        active = torch.tensor([worker.active])
        dist.all_reduce(active)
        if not int(active):
            return tokens


@torch.inference_mode()
def teacher_forced(engine: Engine, lockstep: Lockstep, sequences: dict[int, list[int]]) -> dict:
    """Logits [T, V] of each sequence in one forward (the others' rounds joined afterwards), as numpy arrays
    (a tensor would travel back through shared memory that dies with the worker)."""
    out = {i: engine.model(torch.tensor([s]))[0].float().numpy() for i, s in sequences.items()}
    lockstep.finish()
    return out


def compare_formats(checkpoint: str, prompts: list[list[int]], max_tokens: int, formats: list[tuple[str, str]],
                    world: int = 4, timeout_s: float = 300.0) -> list[dict]:
    """Serving with each wire format on ``world`` processes against one process, per format: completions
    identical, tokens matching before the first divergence (of all generated), positions whose
    teacher-forced argmax agrees, and the largest logit difference (with the logits' own scale)."""
    import dsv3
    from dsv3.infer.engine import Request
    from dsv3.testing.launch import launch

    model = dsv3.load_pretrained(checkpoint)
    engine = Engine(model, None)
    want = [r.token_ids for r in engine.generate([Request(p, max_tokens, GREEDY) for p in prompts])]
    sequences = [p + w for p, w in zip(prompts, want, strict=True)]
    with torch.inference_mode():
        ref = [model(torch.tensor([s]))[0].float() for s in sequences]
    per_rank = launch(ep_generation, world, (checkpoint, prompts, max_tokens, sequences, formats), timeout_s)
    return [_compare(fmt, want, ref, [r[k] for r in per_rank]) for k, fmt in enumerate(formats)]


def _compare(fmt: tuple[str, str], want: list[list[int]], ref: list[torch.Tensor], parts: list[dict]) -> dict:
    tokens = {i: t for p in parts for i, t in p["tokens"].items()}
    logits = {i: torch.from_numpy(x) for p in parts for i, x in p["logits"].items()}
    got = [tokens[i] for i in range(len(want))]
    prefix = [next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
              for g, w in zip(got, want, strict=True)]
    diff = max(float((logits[i] - r).abs().max()) for i, r in enumerate(ref))
    agree = sum(int((logits[i].argmax(-1) == r.argmax(-1)).sum()) for i, r in enumerate(ref))
    return {"dispatch": fmt[0], "combine": fmt[1], "completions": len(want),
            "identical_completions": sum(g == w for g, w in zip(got, want, strict=True)),
            "tokens": sum(len(w) for w in want), "tokens_before_divergence": sum(prefix),
            "positions": sum(r.shape[0] for r in ref), "argmax_agree": agree,
            "max_logit_diff": diff, "max_abs_logit": max(float(r.abs().max()) for r in ref)}

