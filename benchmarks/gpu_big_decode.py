"""CUDA check of the engine's decode on a model the size of DeepSeek-V2-Lite (27 layers, 64 routed experts of
which 6 a token, 2 shared; random bf16 weights, about 31 GB): its time per step at batch 1 and 32 through the
engine's CUDA graphs (``dsv3.kernels.graph_decode``), each set against the memory roofline, the bytes a step
must read over the measured copy bandwidth. The goals it reports: batch 1 at least 0.4 of the roofline, batch
32 at least 10x batch 1's tokens/s.

The bytes of a step: every weight but the embedding table and the routed experts (attention, the dense layer,
shared experts, routers, norms, head), the routed experts the rows choose (batch 1: 6 a layer; batch 32: the
distinct experts 192 uniform choices of 64 touch, 61.3 expected), and the latent cache of every row. So a batch
of 32 reads about six times batch 1's bytes, and at the same fraction of the roofline gives 32 / 6 = 5.3x its
tokens/s: ``bound_b32_over_b1`` is that byte bound, and 10x needs batch 32 nearer its roofline than batch 1.

The model is built on the meta device and made on the GPU (no copy through the host), in bf16 throughout.
JSON lines on stdout; exit 1 when a step fails; 0 with a "skipped" line without CUDA. DSV3_GPU_CHECK_DEVICE=cpu
rehearses the same code on the CPU with a much smaller model of the same structure (the static steps uncompiled).
"""

from __future__ import annotations

import sys
import time

import torch

from dsv3.config import preset
from dsv3.infer.engine import Engine, Request
from dsv3.kernels.graph_decode import GraphDecode
from dsv3.model import Transformer
from gpu_decode import DEVICE, copy_bandwidth, sync  # benchmarks/ is on sys.path when a script runs
from gpu_decode import emit as decode_emit

BIG = DEVICE == "cuda"
V2_LITE = preset("deepseek-v2-lite").replace(num_nextn_predict_layers=0)
# the rehearsal's model: V2-Lite's structure (no q LoRA, 64 experts, 6 a token, 2 shared) at a size a CPU runs
REHEARSAL = V2_LITE.replace(num_hidden_layers=3, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                            vocab_size=2048, num_attention_heads=4, kv_lora_rank=64)
CONTEXT, NEW_TOKENS = (512, 64) if BIG else (32, 8)
BATCHES = (1, 32) if BIG else (1, 4)


def emit(**fields) -> None:
    decode_emit(section="big_decode", **fields)


def on_meta(cfg) -> Transformer:
    """The model in bf16 on the meta device: shapes and dtypes, no storage."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return Transformer(cfg)
    finally:
        torch.set_default_dtype(default)


def build(cfg) -> Transformer:
    """Random bf16 weights made where the model runs: built on meta, storage on DEVICE, then initialized there."""
    model = on_meta(cfg)
    model.to_empty(device=DEVICE)
    torch.manual_seed(0)
    model.reset_parameters()
    model.init_buffers(DEVICE)  # fp32 RoPE frequencies, expert-load counters
    return model.eval()


def experts_touched(cfg, batch: int) -> float:
    """The distinct routed experts a layer that ``batch`` rows choose, expected under uniform choices."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return E * (1 - (1 - k / E) ** batch)


def step_bytes(model: Transformer, batch: int, context: int) -> float:
    """The bytes a decode step of ``batch`` rows must read (see the module docstring)."""
    cfg = model.config
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    moes = model.moe_layers()
    routed = [p for m in moes for p in (m.experts.gate_proj, m.experts.up_proj, m.experts.down_proj)]
    fixed = size(model.parameters()) - size([model.model.embed_tokens.weight]) - size(routed)
    E, touched = cfg.n_routed_experts, experts_touched(cfg, batch)
    per_expert = size(routed) / len(moes) / E
    cache = batch * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * cfg.num_hidden_layers
    return fixed + len(moes) * touched * per_expert + cache


def decode(model: Transformer, batch: int, bandwidth: float) -> dict:
    """The engine's decode steps at ``batch`` rows after a ``CONTEXT``-token prompt each, timed after a first
    run that compiles and captures the batch's graph."""
    cfg = model.config
    engine = Engine(model, eos_token_ids=frozenset())
    if not BIG:
        engine.decoder = GraphDecode(model, compile=False)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, cfg.vocab_size, (CONTEXT,), generator=g).tolist() for _ in range(batch)]
    t0 = time.perf_counter()
    engine.generate([Request(p, 4) for p in prompts])  # compiles and captures this batch's rung
    sync()
    first_s = time.perf_counter() - t0
    for _ in engine.stream([Request(p, NEW_TOKENS + 1) for p in prompts]):
        pass
    sync()
    stats = engine.last_stats
    step_s = stats.decode_s / stats.main_forwards
    roofline_s = step_bytes(model, batch, CONTEXT + NEW_TOKENS // 2) / bandwidth
    rungs = getattr(engine.decoder, "rungs", {})
    experts = {"cpu ops" if static.plans is not None else "grouped" if static.grouped else "gathered"
               for static, _ in rungs.values()}  # what ran the routed experts
    row = dict(name="engine_decode_v2_lite_shape_bf16", batch=batch, context=CONTEXT,
               decoder=type(engine.decoder).__name__, rungs=sorted(rungs), routed_experts=sorted(experts),
               first_run_s=first_s, tokens_per_s=stats.tokens / stats.decode_s, ms_per_step=step_s * 1e3,
               roofline_ms_per_step=roofline_s * 1e3, fraction_of_roofline=roofline_s / step_s)
    emit(**row)
    return row


def main() -> int:
    if BIG and not torch.cuda.is_available():
        emit(skipped="no CUDA device")
        return 0
    shape = on_meta(V2_LITE)  # the byte bound of V2-Lite's shape, also in a rehearsal
    one, many = step_bytes(shape, 1, CONTEXT), step_bytes(shape, 32, CONTEXT)
    emit(name="v2_lite_step_bytes", context=CONTEXT, b1_gb=one / 1e9, b32_gb=many / 1e9,
         experts_a_layer_b32=experts_touched(V2_LITE, 32), bound_b32_over_b1=32 * one / many)  # fmt: skip
    t0 = time.perf_counter()
    model = build(V2_LITE if BIG else REHEARSAL)
    sync()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    emit(name="model", layers=model.config.num_hidden_layers, weight_gb=weights / 1e9,
         build_s=time.perf_counter() - t0)  # fmt: skip
    bandwidth = copy_bandwidth()
    rows = [decode(model, batch, bandwidth) for batch in BATCHES]
    one, many = rows[0], rows[-1]
    bound = many["batch"] * step_bytes(model, 1, CONTEXT) / step_bytes(model, many["batch"], CONTEXT)
    ratio = many["tokens_per_s"] / one["tokens_per_s"]
    emit(name="goals", b1_fraction_of_roofline=one["fraction_of_roofline"], b1_goal=0.4,
         b32_over_b1=ratio, b32_over_b1_goal=10.0, bound_b32_over_b1=bound,
         b1_met=one["fraction_of_roofline"] >= 0.4, b32_met=ratio >= 10.0)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
