"""CUDA checks of the model: logits on the GPU equal the CPU's (fp32), absorbed decode over the latent
cache equals the expanded path on the GPU, the training loss and every gradient equal the CPU's (the
fused routed experts, the fused head loss and the attention kernels in backward), and decode/training-step
timings of the `small` preset in bf16.

JSON lines on stdout; exit 1 when a check fails, 0 with a "skipped" line without CUDA.
DSV3_GPU_CHECK_DEVICE=cpu runs the same code on the CPU (to test this script without a GPU).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from dsv3.config import ModelConfig, RopeScaling, preset
from dsv3.model import Transformer

DEVICE = os.environ.get("DSV3_GPU_CHECK_DEVICE", "cuda")
TINY = ModelConfig(vocab_size=257, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                   num_hidden_layers=3, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64,
                   qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
                   num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                   rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=64)).validate()


def emit(**fields) -> None:
    print(json.dumps({"check": "model", **fields}), flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def check_parity() -> bool:
    torch.manual_seed(0)
    cpu = Transformer(TINY).eval()
    gpu = Transformer(TINY).to(DEVICE).eval()
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(0, TINY.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = cpu(ids)
        full = gpu(ids.to(DEVICE))
        cache = gpu.new_cache(2, 128)
        steps = [gpu(ids[:, :64].to(DEVICE), cache=cache)]
        steps += [gpu(ids[:, t : t + 1].to(DEVICE), cache=cache, start_pos=t) for t in range(64, 96)]
    gpu_vs_cpu = (full.cpu() - ref).abs().max().item()
    absorbed_vs_expanded = (torch.cat(steps, 1) - full).abs().max().item()
    ok = gpu_vs_cpu < 1e-3 and absorbed_vs_expanded < 1e-3
    emit(name="parity_fp32", gpu_vs_cpu=gpu_vs_cpu, absorbed_vs_expanded=absorbed_vs_expanded, ok=ok)
    return ok


def check_training_gradients() -> bool:
    """One loss + backward in fp32 on both devices: loss and the worst relative gradient difference."""
    torch.manual_seed(0)
    cfg = TINY.replace(num_nextn_predict_layers=1)
    cpu = Transformer(cfg).train()
    gpu = Transformer(cfg).to(DEVICE).train()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randint(0, cfg.vocab_size, (2, 97), generator=torch.Generator().manual_seed(2))
    losses = []
    for model, ids in ((cpu, x), (gpu, x.to(DEVICE))):
        out = model.loss(ids[:, :-1], ids[:, 1:])
        out.loss.backward()
        losses.append(out.loss.item())
    worst = max(
        ((pg.grad.cpu() - pc.grad).norm() / pc.grad.norm().clamp(min=1e-12)).item()
        for pc, pg in zip(cpu.parameters(), gpu.parameters(), strict=True)
        if pc.grad is not None
    )
    ok = abs(losses[0] - losses[1]) < 1e-4 * abs(losses[0]) and worst < 1e-3
    emit(name="train_grads_fp32", loss_cpu=losses[0], loss_gpu=losses[1], worst_rel_grad_diff=worst, ok=ok)
    return ok


def time_small() -> None:
    cfg = preset("small")
    torch.manual_seed(0)
    model = Transformer(cfg).to(DEVICE, torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (8, 2048), device=DEVICE)
    with torch.no_grad():
        cache = model.new_cache(8, 2048 + 64)
        model(ids, cache=cache)
        sync()
        t0 = time.perf_counter()
        for t in range(2048, 2048 + 64):
            model(ids[:, -1:], cache=cache, start_pos=t)
        sync()
    emit(name="decode_small_bf16", batch=8, context=2048, tokens_per_s=8 * 64 / (time.perf_counter() - t0))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (8, 1025), device=DEVICE)
    for i in range(4):
        if i == 1:
            sync()
            t0 = time.perf_counter()
        model.loss(x[:, :-1], x[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()
    sync()
    emit(name="train_step_small_bf16", tokens_per_s=3 * 8 * 1024 / (time.perf_counter() - t0))


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        emit(skipped="no CUDA device")
        return 0
    ok = check_parity()
    ok = check_training_gradients() and ok
    time_small()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
