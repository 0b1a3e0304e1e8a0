"""CUDA checks of the decoding engine: greedy tokens on the GPU equal the CPU's (fp32, plain and with MTP
speculation), then batch-1 and batched decode speed of the `small` preset in bf16 on the GPU, each set
against the memory roofline (weight + latent-cache bytes read per step over the measured copy bandwidth).

JSON lines on stdout; exit 1 when a check fails, 0 with a "skipped" line without CUDA.
DSV3_GPU_CHECK_DEVICE=cpu runs the same code on the CPU (to test this script without a GPU).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from dsv3.config import preset
from dsv3.infer.engine import Engine, Request
from dsv3.model import Transformer
from gpu_model import TINY as GPU_MODEL_TINY  # benchmarks/ is on sys.path when a script runs

DEVICE = os.environ.get("DSV3_GPU_CHECK_DEVICE", "cuda")
# the model check's tiny V3 with one MTP layer, for speculation (YaRN off: positions stay short)
TINY = GPU_MODEL_TINY.replace(num_nextn_predict_layers=1, rope_scaling=None)


def emit(**fields) -> None:
    print(json.dumps({"check": "decode", **fields}), flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def check_tokens() -> bool:
    """Same greedy continuation on both devices, for two prompts of different lengths decoded together."""
    torch.manual_seed(0)
    cpu = Transformer(TINY).eval()
    gpu = Transformer(TINY).to(DEVICE).eval()
    gpu.load_state_dict(cpu.state_dict())
    prompts = [[1, 5, 9, 33, 7], [4, 2, 250, 17, 99, 3, 8, 100]]
    ok = True
    for speculative in (False, True):
        runs = {}
        for name, model in (("cpu", cpu), ("gpu", gpu)):
            engine = Engine(model, speculative=speculative)
            runs[name] = [r.token_ids for r in engine.generate([Request(p, 40) for p in prompts])]
        same = runs["cpu"] == runs["gpu"]
        ok &= same
        emit(name="greedy_tokens_gpu_equal_cpu", speculative=speculative, same=same,
             gpu_tokens=runs["gpu"][0][:12])  # fmt: skip
    return ok


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy (the roofline's bandwidth)."""
    n = (1 << 30) if DEVICE == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync()
    return 2 * n * 10 / (time.perf_counter() - t0)


def decode_speed(bandwidth: float) -> None:
    """Tokens/s at batch 1 and 32, context 2048, through the engine and through bare model calls."""
    cfg = preset("small").replace(max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Transformer(cfg).to(DEVICE, torch.bfloat16).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    big = DEVICE == "cuda"  # the CPU rehearsal only checks that the code runs
    context, new = (2048, 64) if big else (128, 8)
    for batch in (1, 32) if big else (1, 2):
        prompts = [torch.randint(0, cfg.vocab_size, (context,)).tolist() for _ in range(batch)]
        engine = Engine(model)
        engine.generate([Request(p, 4) for p in prompts])  # warm-up
        for _ in engine.stream([Request(p, new + 1) for p in prompts]):
            pass
        stats = engine.last_stats
        step_s = stats.decode_s / stats.main_forwards
        cache_read = stats.cache_bytes_per_token_per_layer * cfg.num_hidden_layers * batch * (context + new // 2)
        roofline_s = (weight_bytes + cache_read) / bandwidth
        emit(name="engine_decode_small_bf16", batch=batch, context=context, tokens_per_s=stats.tokens / stats.decode_s,
             ms_per_step=step_s * 1e3, roofline_ms_per_step=roofline_s * 1e3,
             fraction_of_roofline=roofline_s / step_s)  # fmt: skip
    ids = torch.randint(0, cfg.vocab_size, (1, context), device=DEVICE)
    with torch.inference_mode():
        cache = model.new_cache(1, context + new, dtype=torch.bfloat16)
        model(ids, cache=cache)
        sync()
        t0 = time.perf_counter()
        for t in range(context, context + new):
            model(ids[:, -1:], cache=cache, start_pos=t)
        sync()
    step_s = (time.perf_counter() - t0) / new
    emit(name="model_step_small_bf16", batch=1, context=context, ms_per_step=step_s * 1e3,
         roofline_ms_per_step=(weight_bytes + cache.nbytes) / bandwidth * 1e3)  # fmt: skip


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        emit(skipped="no CUDA device")
        return 0
    ok = check_tokens()
    bandwidth = copy_bandwidth()
    emit(name="copy_bandwidth", gb_per_s=bandwidth / 1e9)
    decode_speed(bandwidth)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
