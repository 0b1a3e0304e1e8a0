"""CUDA check of the engine's decode step on a GPU (``dsv3.kernels.graph_decode``): ``StaticDecode`` compiled and
captured as CUDA graphs for a ladder of batch sizes, reading and writing the engine's pool of cache pages in
place. Its greedy tokens must equal the CPU engine's (tiny model, fp32) at batch 1, 3 (in the 4-row graph) and
32, then its time per step at each.

JSON lines on stdout; exit 1 when a check fails, 0 with a "skipped" line without CUDA.
DSV3_GPU_CHECK_DEVICE=cpu runs the same code on the CPU (GraphDecode compiled without CUDA graphs).
"""

from __future__ import annotations

import sys
import time

import torch

from dsv3.infer.engine import Engine, Request
from dsv3.kernels.graph_decode import GraphDecode
from dsv3.model import Transformer
from gpu_decode import DEVICE, TINY, sync  # benchmarks/ is on sys.path when a script runs
from gpu_decode import emit as decode_emit

BATCHES = (1, 3, 32)
NEW_TOKENS = 16


def emit(**fields) -> None:
    decode_emit(section="graph_decode", **fields)


def check(batch: int, cpu: Transformer, gpu: Transformer) -> bool:
    """One batch of prompts of different lengths: the same greedy tokens on both devices."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, TINY.vocab_size, (4 + b % 5,), generator=g).tolist() for b in range(batch)]
    requests = [Request(p, NEW_TOKENS) for p in prompts]
    want = [r.token_ids for r in Engine(cpu, eos_token_ids=frozenset()).generate(requests)]
    engine = Engine(gpu, eos_token_ids=frozenset())
    if DEVICE != "cuda":
        engine.decoder = GraphDecode(gpu, mode=None)
    graphs = isinstance(engine.decoder, GraphDecode)
    t0 = time.perf_counter()
    got = [r.token_ids for r in engine.generate([Request(p, NEW_TOKENS) for p in prompts])]  # compiles, captures
    first_s = time.perf_counter() - t0
    sync()
    t0 = time.perf_counter()
    engine.generate([Request(p, NEW_TOKENS) for p in prompts])  # prefill, then the graphs replayed
    sync()
    same = graphs and got == want
    emit(name="graph_step_tokens_equal_cpu", batch=batch, same=same, decoder=type(engine.decoder).__name__,
         rungs=sorted(getattr(engine.decoder, "rungs", {})), first_run_s=first_s,
         second_run_ms_per_token=(time.perf_counter() - t0) / NEW_TOKENS * 1e3)  # prefill included; fmt: skip
    return same


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        emit(skipped="no CUDA device")
        return 0
    torch.manual_seed(0)
    cpu = Transformer(TINY.replace(num_nextn_predict_layers=0)).eval()
    gpu = Transformer(cpu.config).to(DEVICE).eval()
    gpu.load_state_dict(cpu.state_dict())
    results = [check(batch, cpu, gpu) for batch in BATCHES]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
