"""FP8Linear: the three FP8 GEMMs with the V3 tiling, against float64 autograd and explicit references."""

import pytest
import torch
from torch import nn

from dsv3.errors import DSV3Error
from dsv3.precision import fp8
from dsv3.precision.fp8_linear import FP8Linear, convert_to_fp8, fp8_linear


def make_inputs(m=96, k=320, n=192, seed=0, outliers=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, m // 2, k, generator=gen)
    if outliers:
        x[..., 5] *= 200.0  # a few channels far larger than the rest, as in real activations
        x[..., 77] *= 120.0
    w = torch.randn(n, k, generator=gen) / k**0.5
    dy = torch.randn(2, m // 2, n, generator=gen)
    return x.bfloat16(), w, dy.bfloat16()


def run(x, w, dy, scaling="fine", bias=None):
    x = x.detach().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    b = None if bias is None else bias.detach().clone().requires_grad_(True)
    y = fp8_linear(x, w, b, scaling)
    y.backward(dy)
    return y, x.grad, w.grad, None if b is None else b.grad


def float64_reference(x, w, dy, bias=None):
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    y = x64 @ w64.t() + (0 if bias is None else bias.double())
    y.backward(dy.double())
    return y, x64.grad, w64.grad


def rel(a, b):
    return (torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double())).item()


def test_output_and_gradients_match_float64_within_fp8_tolerance():
    x, w, dy = make_inputs()
    bias = torch.randn(w.shape[0])
    y, gx, gw, gb = run(x, w, dy, bias=bias)
    y64, gx64, gw64 = float64_reference(x, w, dy, bias)
    assert y.dtype == torch.bfloat16 and gx.dtype == torch.bfloat16 and gw.dtype == torch.float32
    for got, want in ((y, y64), (gx, gx64), (gw, gw64)):
        assert 1e-3 < rel(got, want) < 0.06  # E4M3 quantization error: a few percent, never zero
    torch.testing.assert_close(gb, dy.float().sum(dim=(0, 1)), rtol=1e-6, atol=1e-5)


def test_each_gemm_uses_the_v3_tiling_exactly():
    """Rebuild Fprop, Dgrad and Wgrad from explicitly tiled operands; they must agree to FP32 rounding."""
    x, w, dy = make_inputs(m=256, k=384, n=256, seed=3)
    y, gx, gw, _ = run(x, w, dy)
    x2, dy2 = x.reshape(-1, x.shape[-1]).float(), dy.reshape(-1, dy.shape[-1]).float()

    def dq(t, block):
        return fp8.dequantize(*fp8.quantize(t, block=block), block, torch.float64)

    x_fwd, w_blk = dq(x2, (1, 128)), dq(w, (128, 128))
    y_ref = x_fwd @ w_blk.t()
    gx_ref = dq(dy2, (1, 128)) @ w_blk  # Dgrad: dy in 1x128 tiles, the same 128x128 weight blocks
    x_cached = fp8.dequantize(*fp8.quantize(x2, block=(1, 128)), (1, 128))
    gw_ref = dq(dy2, (128, 1)).t() @ dq(x_cached, (128, 1))  # Wgrad: both re-tiled 128x1 along tokens
    assert rel(y.reshape(y_ref.shape), y_ref) < 4e-3  # BF16 output rounding only
    assert rel(gx.reshape(gx_ref.shape), gx_ref) < 4e-3
    assert rel(gw, gw_ref) < 1e-5  # FP32 output: the same numbers


def test_fine_grained_scaling_beats_per_tensor_with_outlier_channels():
    """Outliers 1e5x the rest push a per-tensor scale so high that ordinary values fall to subnormals."""
    x, w, dy = make_inputs(seed=5)
    x = x.float()
    x[..., 5] *= 1e5  # both outlier channels live in the first 128-channel tile
    x[..., 77] *= 3e4
    x = x.bfloat16()
    _, _, gw64 = float64_reference(x, w, dy)
    _, _, fine_gw, _ = run(x, w, dy, "fine")
    _, _, coarse_gw, _ = run(x, w, dy, "tensor")
    clean = slice(128, None)  # weight columns whose input channels share no tile with an outlier
    assert rel(fine_gw[:, clean], gw64[:, clean]) < 0.06
    assert rel(coarse_gw[:, clean], gw64[:, clean]) > 3 * rel(fine_gw[:, clean], gw64[:, clean])


def test_activation_is_cached_in_fp8():
    x, w, _ = make_inputs(m=256, k=512, n=128)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    weight = nn.Parameter(w)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fp8_linear(x.requires_grad_(True), weight)
    activations = [t for t in saved if t.data_ptr() != weight.data_ptr()]
    cached_bytes = sum(t.numel() * t.element_size() for t in activations)
    assert any(t.dtype == torch.float8_e4m3fn and t.numel() == x.numel() for t in activations)
    assert cached_bytes < 0.52 * x.numel() * x.element_size()  # 1 byte + 4/128 per element vs 2 bytes


def test_module_replaces_nn_linear_with_the_same_parameters():
    torch.manual_seed(0)
    linear = nn.Linear(256, 128, bias=True)
    module = FP8Linear.from_linear(linear)
    assert module.weight is linear.weight and module.bias is linear.bias
    x = torch.randn(4, 256).bfloat16()
    assert rel(module(x), linear(x.float())) < 0.06
    fresh = FP8Linear(256, 128)
    assert fresh.weight.shape == (128, 128 * 2) and fresh.weight.dtype == torch.float32 and fresh.bias is None
    bf16 = nn.Linear(128, 128).bfloat16()
    assert FP8Linear.from_linear(bf16).weight.dtype == torch.float32  # master weights stay FP32


def test_convert_to_fp8_swaps_linears_and_honours_skip():
    model = nn.Sequential(nn.Embedding(10, 128))
    model.add_module("mlp", nn.Sequential(nn.Linear(128, 256), nn.SiLU(), nn.Linear(256, 128)))
    model.add_module("gate", nn.Linear(128, 8))
    model.add_module("head", nn.Linear(128, 10))
    names = convert_to_fp8(model, skip=lambda name: name in ("gate", "head"))
    assert names == ["mlp.0", "mlp.2"]
    assert isinstance(model.mlp[0], FP8Linear) and isinstance(model.mlp[2], FP8Linear)
    assert type(model.gate) is nn.Linear and type(model.head) is nn.Linear
    out = model.mlp(torch.randn(3, 128).bfloat16())
    out.float().sum().backward()
    assert model.mlp[0].weight.grad is not None and model.mlp[0].weight.grad.abs().sum() > 0


def test_training_steps_lower_a_regression_loss():
    torch.manual_seed(0)
    teacher = torch.randn(64, 256) / 16
    layer = FP8Linear(256, 64)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    losses = []
    for _ in range(30):
        x = torch.randn(128, 256)
        loss = (layer(x.bfloat16()).float() - x @ teacher.t()).pow(2).sum(dim=1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0]


@pytest.mark.parametrize("m,k,n", [(3, 200, 130), (1, 128, 1), (130, 129, 17)])
def test_odd_shapes_run_and_stay_accurate(m, k, n):
    x, w, dy = make_inputs(m=2 * m, k=k, n=n, seed=m + k)
    y, gx, gw, _ = run(x, w, dy)
    y64, gx64, gw64 = float64_reference(x, w, dy)
    assert y.shape == y64.shape and gx.shape == x.shape and gw.shape == w.shape
    for got, want in ((y, y64), (gx, gx64), (gw, gw64)):
        assert rel(got, want) < 0.06


def test_bad_arguments_are_clear_errors():
    with pytest.raises(DSV3Error, match="scaling"):
        FP8Linear(8, 8, scaling="row")
    with pytest.raises(DSV3Error, match="features"):
        fp8_linear(torch.randn(2, 7), torch.randn(3, 8))


# --- `dsv3 study fp8`: quantization error and activation memory --------------------------------------


def test_fine_scaling_protects_ordinary_channels_from_outliers():
    from dsv3.studies import fp8_training as study

    x = study.synthetic_activations(512, 1024, 1e4, 4, seed=0)
    per_tensor, tile = study.error_metrics(x, "per-tensor"), study.error_metrics(x, "1x128")
    assert study.outlier_channels(x.float()) == 4
    assert per_tensor["median_channel_rel_rmse"] > 1.5 * tile["median_channel_rel_rmse"]
    assert per_tensor["flushed_to_zero"] > 5 * tile["flushed_to_zero"]
    clean = study.synthetic_activations(512, 1024, 0, 0, seed=0)
    assert (
        abs(study.error_metrics(clean, "per-tensor")["rel_rmse"] - study.error_metrics(clean, "1x128")["rel_rmse"])
        < 0.005
    )


def test_fp8_activation_cache_halves_saved_memory():
    from dsv3.studies import fp8_training as study

    mem = study.activation_memory(tokens=256, dim=256, layers=3, seed=0)
    assert mem["bf16_bytes"] == 3 * 256 * 256 * 2
    assert mem["fp8_bytes"] / mem["bf16_bytes"] == pytest.approx(mem["expected_fp8_fraction"], rel=1e-6)


def run_fp8_study(args, capsys):
    import typer

    from dsv3.studies import fp8_training as study

    app = typer.Typer()
    app.command()(study.main)
    app(args=args, standalone_mode=False)
    return capsys.readouterr().out


def test_fp8_study_json_on_captured_activations(tmp_path, capsys):
    import json

    path = tmp_path / "acts.pt"
    torch.save({"layer0.attn_out": torch.randn(2, 64, 256), "layer0.mlp_in": torch.randn(128, 384)}, path)
    small = ["--tokens", "128", "--dim", "256", "--memory-layers", "1"]
    result = json.loads(run_fp8_study(["--activations", str(path), "--json", *small], capsys))
    assert [r["tensor"] for r in result["quantization_error"]] == ["layer0.attn_out", "layer0.mlp_in"]
    assert result["quantization_error"][0]["shape"] == [128, 256]
    assert set(result["quantization_error"][1]["schemes"]) == {"per-tensor", "per-row", "1x128"}
    plot = tmp_path / "fp8.png"
    out = run_fp8_study([*small, "--outlier-scales", "0,1000", "--markdown", "--plot", str(plot)], capsys)
    assert out.count("| synthetic |") == 2 and plot.read_bytes()[:4] == b"\x89PNG"


def test_fp8_study_rejects_a_bad_activations_file(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(DSV3Error, match="cannot read"):
        run_fp8_study(["--activations", str(bad)], capsys)
    torch.save({"x": torch.arange(4)}, bad)
    with pytest.raises(DSV3Error, match="floating-point"):
        run_fp8_study(["--activations", str(bad)], capsys)


def test_bf16_autocast_does_not_touch_the_fp8_gemms():
    """The trainer runs FP8Linear under BF16 autocast; the GEMMs must still accumulate in FP32."""
    x, w, dy = make_inputs(seed=11)
    plain = run(x.float(), w, dy.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = run(x.float(), w, dy.float())
    for a, b in zip(plain[:3], autocast[:3], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


# ---- FP8Experts: the routed experts with FP8 GEMMs -------------------------------------------------


def make_experts(n_experts=4, dim=256, inter=192, tokens=64, top_k=2, seed=0):
    from dsv3.model.experts import GroupedExperts

    gen = torch.Generator().manual_seed(seed)
    experts = GroupedExperts(n_experts, dim, inter)
    with torch.no_grad():
        for p in (experts.gate_proj, experts.up_proj):
            p.copy_(torch.randn(p.shape, generator=gen) / dim**0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) / inter**0.5)
    x = torch.randn(tokens, dim, generator=gen)
    idx = torch.rand(tokens, n_experts, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=gen)
    return experts, x, idx, weights


def run_experts(experts, x, idx, weights):
    """The experts on tokens x routed to idx/weights, with the rows a local dispatcher hands them."""
    from dsv3.model.dispatch import local_rows

    return experts(local_rows(x, idx, weights, experts.n_experts))


def experts_grads(experts, x, idx, weights, dtype):
    x = x.detach().to(dtype).requires_grad_(True)
    out = run_experts(experts, x, idx, weights.to(dtype))
    out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.shape[1], dtype=out.dtype))
    grads = [p.grad.clone() for p in (experts.gate_proj, experts.up_proj, experts.down_proj)]
    return out, x.grad, grads


def test_fp8_experts_output_and_gradients_match_float64_within_fp8_tolerance():
    import copy

    from dsv3.model.experts import FP8Experts

    experts, x, idx, weights = make_experts()
    reference = copy.deepcopy(experts).double()
    fast = FP8Experts.from_experts(experts)
    out, gx, grads = experts_grads(fast, x, idx, weights, torch.bfloat16)
    out64, gx64, grads64 = experts_grads(reference, x, idx, weights, torch.float64)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads)
    for got, want in ((out, out64), (gx, gx64), *zip(grads, grads64, strict=True)):
        assert 1e-3 < rel(got, want) < 0.08  # E4M3 error through two chained GEMMs: a few percent


def test_fp8_experts_share_parameters_and_keep_checkpoint_names():
    from dsv3.model.experts import FP8Experts

    experts, x, idx, weights = make_experts()
    before = {k: v.data_ptr() for k, v in experts.state_dict().items()}
    calls = []
    experts.register_forward_hook(lambda *_: calls.append(1))
    fast = FP8Experts.from_experts(experts, scaling="tensor")
    assert {k: v.data_ptr() for k, v in fast.state_dict().items()} == before
    assert fast.scaling == "tensor"
    run_experts(fast, x, idx, weights)
    assert calls == [1]  # hooks (e.g. the simulated MoE combine) survive the swap


def tiny_transformer(seed=0):
    from dsv3.config import preset
    from dsv3.model import Transformer

    cfg = preset("nano").replace(vocab_size=256, num_hidden_layers=2, n_routed_experts=8, n_group=2)
    torch.manual_seed(seed)
    return Transformer(cfg)


def lm_loss(model, ids):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def test_convert_to_fp8_swaps_the_routed_experts_but_not_gate_head_or_embedding():
    from dsv3.model.experts import FP8Experts, GroupedExperts
    from dsv3.model.moe import Router

    model = tiny_transformer()
    names = convert_to_fp8(model, skip=lambda name: name == "lm_head" or name.endswith("shared_head.head"))
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(isinstance(m, FP8Experts) for m in experts)
    assert sum(name.endswith("mlp.experts") for name in names) == len(experts)
    assert type(model.lm_head) is nn.Linear and isinstance(model.model.embed_tokens, nn.Embedding)
    assert all(type(m) is Router for m in model.modules() if isinstance(m, Router))
    assert not any(type(m) is nn.Linear for n, m in model.named_modules() if n not in ("lm_head",)
                   and not n.endswith("shared_head.head"))


def test_default_scaling_switches_what_convert_to_fp8_builds():
    from dsv3.model.experts import FP8Experts
    from dsv3.precision.fp8_linear import default_scaling

    model = tiny_transformer()
    with default_scaling("tensor"):
        convert_to_fp8(model)
    scalings = {m.scaling for m in model.modules() if isinstance(m, (FP8Linear, FP8Experts))}
    assert scalings == {"tensor"}
    with pytest.raises(DSV3Error):
        with default_scaling("block"):
            pass


def test_fp8_model_loss_is_close_to_the_high_precision_loss():
    ids = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(1))
    model = tiny_transformer()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_loss = lm_loss(model, ids).item()
        convert_to_fp8(model)
        fp8_loss = lm_loss(model, ids).item()
    assert bf16_loss != fp8_loss
    assert abs(fp8_loss - bf16_loss) / bf16_loss < 0.01


def test_a_few_fp8_training_steps_lower_the_loss():
    ids = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(2))
    model = tiny_transformer()
    convert_to_fp8(model, skip=lambda name: name == "lm_head" or name.endswith("shared_head.head"))
    from dsv3.model.experts import FP8Experts

    expert = next(m for m in model.modules() if isinstance(m, FP8Experts))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, ids)
        opt.zero_grad()
        loss.backward()
        assert expert.gate_proj.grad is not None and expert.gate_proj.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
