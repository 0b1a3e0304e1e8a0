"""CUDA check of the static-shape decode step (``dsv3.kernels.static_decode``, gpt-fast's approach): compiled
as one graph and, on CUDA, captured as a CUDA graph (``mode="reduce-overhead"``). Its greedy tokens must
equal the engine's (tiny model, fp32, two rows); then its time per step on the `small` preset in bf16 at
batch 1, context 2048, next to the memory roofline (weight + latent-cache bytes over the copy bandwidth).

JSON lines on stdout; exit 1 when the check fails, 0 with a "skipped" line without CUDA.
DSV3_GPU_CHECK_DEVICE=cpu runs the same code on the CPU (compiled without CUDA graphs, on the tiny model).
"""

from __future__ import annotations

import sys
import time

import torch

from dsv3.config import preset
from dsv3.infer.engine import Engine, Request
from dsv3.kernels.static_decode import StaticDecode, greedy
from dsv3.model import Transformer
from gpu_decode import DEVICE, TINY, copy_bandwidth, sync  # benchmarks/ is on sys.path when a script runs
from gpu_decode import emit as decode_emit

MODE = "reduce-overhead" if DEVICE == "cuda" else None


def emit(**fields) -> None:
    decode_emit(section="static_decode", mode=MODE, **fields)


def check_tokens() -> bool:
    """The compiled static step's greedy tokens equal the engine's module path, two prompts together."""
    torch.manual_seed(0)
    tiny = Transformer(TINY).to(DEVICE).eval()
    prompts = torch.randint(0, TINY.vocab_size, (2, 9), device=DEVICE)
    engine = Engine(tiny, fast=False, eos_token_ids=frozenset())
    reference = [r.token_ids for r in engine.generate([Request(p, 24) for p in prompts.tolist()])]
    static = StaticDecode(tiny, 2, 64)
    t0 = time.perf_counter()
    tokens = greedy(static.compiled(MODE), static, prompts, 24).tolist()
    same = tokens == reference
    emit(name="static_step_tokens_equal_engine", same=same, compile_and_run_s=time.perf_counter() - t0)
    return same


def prefill_s(static: StaticDecode, prompt: torch.Tensor) -> float:
    """Seconds of one prefill (the timed greedy loop includes one, which is subtracted)."""
    sync()
    t0 = time.perf_counter()
    static.prefill(prompt)
    sync()
    return time.perf_counter() - t0


def step_speed(bandwidth: float) -> None:
    """ms per compiled step at batch 1 (`small`, bf16, context 2048 on CUDA; tiny, context 32 on a CPU)."""
    big = DEVICE == "cuda"
    cfg = preset("small").replace(max_position_embeddings=4096) if big else TINY
    context, new = (2048, 64) if big else (32, 8)
    torch.manual_seed(0)
    model = Transformer(cfg).to(DEVICE, torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    static = StaticDecode(model, 1, context + new + 1)
    step = static.compiled(MODE)
    prompt = torch.randint(0, cfg.vocab_size, (1, context), device=DEVICE)
    t0 = time.perf_counter()
    greedy(step, static, prompt, 4)  # compiles (and captures) the step
    compile_s = time.perf_counter() - t0
    sync()
    t0 = time.perf_counter()
    greedy(step, static, prompt, new + 1)
    sync()
    step_s = (time.perf_counter() - t0 - prefill_s(static, prompt)) / new
    roofline_s = (weight_bytes + static.kv.nbytes + static.pe.nbytes) / bandwidth
    emit(name="static_step_bf16", preset="small" if big else "tiny", batch=1, context=context, compile_s=compile_s,
         ms_per_step=step_s * 1e3, roofline_ms_per_step=roofline_s * 1e3,
         fraction_of_roofline=roofline_s / step_s)  # fmt: skip


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        emit(skipped="no CUDA device")
        return 0
    ok = check_tokens()
    step_speed(copy_bandwidth())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
