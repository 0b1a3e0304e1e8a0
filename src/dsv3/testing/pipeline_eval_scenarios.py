"""Held-out evaluation under a pipeline, run by the tests through `launch`: each gloo process builds the same
model, keeps its stages (`parallelize`), and evaluates a few batches through the stages; it reports the
summed loss and how much its peak resident memory grew meanwhile, against the same evaluation done by
gathering the whole model on every rank first (`Parallelized.full_model`, what evaluation did before)."""

from __future__ import annotations

import gc

import torch

from dsv3.config import ModelConfig
from dsv3.layout import Layout
from dsv3.model.transformer import Transformer
from dsv3.parallel.parallelize import parallelize
from dsv3.parallel.pipeline import token_nats


def eval_batches(cfg: ModelConfig, n: int = 2, batch: int = 2,
                 seq: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of random tokens and their next-token labels (the same on every process)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def model_for(cfg: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    return Transformer(cfg)


def one_process_nats(cfg: ModelConfig) -> float:
    """The reference: the whole model's summed held-out loss over `eval_batches`."""
    model = model_for(cfg).eval()
    with torch.no_grad():
        return float(sum(token_nats(model(ids), labels) for ids, labels in eval_batches(cfg)))


def pipeline_eval_worker(rank: int, world: int, cfg: ModelConfig, gather: bool) -> dict:
    """This rank's summed loss over `eval_batches` through the pipeline stages (``gather``: through the
    gathered whole model instead), and the growth of its peak resident memory (VmHWM) during it."""
    parallel = parallelize(model_for(cfg), Layout(pp=world, dp=1, schedule="1f1b", microbatches=world))
    held = sum(p.numel() * p.element_size() for p in parallel.model.parameters())
    gc.collect()
    before = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    parallel.model.eval()
    with torch.no_grad():
        if gather:
            full = parallel.full_model().eval()
            nats = sum(token_nats(full(ids), labels) for ids, labels in eval_batches(cfg))
        else:
            nats = sum(parallel.eval_nats(ids, labels) for ids, labels in eval_batches(cfg))
    return {"nats": float(nats), "grown": _status_bytes("VmHWM") - before, "held": held}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
