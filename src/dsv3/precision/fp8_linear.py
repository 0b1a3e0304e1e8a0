"""`FP8Linear`: a linear layer whose three GEMMs (Fprop, Dgrad, Wgrad) all run in FP8 E4M3, the V3 way.

Fine-grained scaling (the V3 recipe): activations in 1x128 tiles for Fprop, re-tiled as 128x1 for
Wgrad; output gradients in 1x128 tiles for Dgrad and 128x1 for Wgrad; weights in 128x128 blocks, whose
transpose is again 128x128 blocks, so Dgrad reuses the same scales. The activation is cached for
backward in FP8 (1 byte per element plus one scale per 128) instead of BF16; the weight is the FP32
master and is re-quantized in backward rather than cached. ``scaling="tensor"`` is the coarse
baseline: one scale per tensor, same GEMMs, for the study's comparison.

`FP8BlockLinear` is inference's counterpart: a frozen weight kept in the 128x128-block FP8 format
DeepSeek ships, dequantized when the layer runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from dsv3.errors import DSV3Error
from dsv3.precision import fp8

SCALINGS = ("fine", "tensor")
ROW_TILE, COL_TILE, WEIGHT_BLOCK = (1, fp8.TILE), (fp8.TILE, 1), (fp8.TILE, fp8.TILE)


# What convert_to_fp8 uses when no scaling is given: lets a study switch a whole training run (built by
# the trainer, which calls convert_to_fp8 without a scaling) to the per-tensor baseline.
_DEFAULT_SCALING: contextvars.ContextVar[str] = contextvars.ContextVar("fp8_default_scaling", default="fine")


@contextlib.contextmanager
def default_scaling(scaling: str) -> Iterator[None]:
    """Within the block, ``convert_to_fp8(...)`` without ``scaling`` converts to ``scaling``."""
    token = _DEFAULT_SCALING.set(check_scaling(scaling))
    try:
        yield
    finally:
        _DEFAULT_SCALING.reset(token)


def check_scaling(scaling: str) -> str:
    """``scaling`` itself when it is one of SCALINGS, else a clear DSV3Error."""
    if scaling not in SCALINGS:
        raise DSV3Error(f"unknown FP8 scaling {scaling!r}; expected one of {SCALINGS}")
    return scaling


def _quantize(x: torch.Tensor, block: tuple[int, int], scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with ``block`` scales; per-tensor scaling broadcasts its one scale to that layout."""
    if scaling == "fine":
        return fp8.quantize(x, block=block)
    q, scale = fp8.quantize_per_tensor(x)
    return q, scale.expand(fp8.scale_shape(x.shape, block))


def _gemm(a, a_scale, b, b_scale, b_block) -> torch.Tensor:
    """``a @ b.T`` in FP32: a [M, K] in 1x128 tiles, b [N, K] in ``b_block`` (FP32 out keeps grads exact)."""
    return fp8.scaled_mm(a, a_scale, b, b_scale, out_dtype=torch.float32, b_block=b_block)


class FP8LinearFunction(torch.autograd.Function):
    """``y = x @ W.T (+ b)`` with FP8 GEMMs in both directions; x: [..., K], W: [N, K] FP32 master."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scaling: str):
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)  # [M, K]
        x_q, x_s = _quantize(x2, ROW_TILE, scaling)  # Fprop activation: 1x128 tiles along K
        w_q, w_s = _quantize(weight, WEIGHT_BLOCK, scaling)  # 128x128 blocks
        y = _gemm(x_q, x_s, w_q, w_s, WEIGHT_BLOCK)  # [M, N] FP32
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x_q, x_s, weight)  # activation cached in FP8, weight is the parameter
        ctx.scaling, ctx.x_dtype, ctx.has_bias = scaling, x.dtype, bias is not None
        return y.to(x.dtype).reshape(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x_q, x_s, weight = ctx.saved_tensors
        scaling = ctx.scaling
        n = weight.shape[0]
        dy = grad_out.reshape(-1, n)  # [M, N]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # Dgrad: dx = dy @ W; inner dim N; W.T is [K, N] in 128x128 blocks
            dy_q, dy_s = _quantize(dy, ROW_TILE, scaling)
            w_q, w_s = _quantize(weight, WEIGHT_BLOCK, scaling)
            grad_x = _gemm(dy_q, dy_s, w_q.t().contiguous(), w_s.t(), WEIGHT_BLOCK)  # [M, K]
            grad_x = grad_x.to(ctx.x_dtype).reshape(*grad_out.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:  # Wgrad: dW = dy.T @ x; inner dim M: both operands in 128x1 tiles
            dyt_q, dyt_s = _quantize(dy, COL_TILE, scaling)  # [M, N] in 128x1 tiles = dy.T in 1x128
            x = fp8.dequantize(x_q, x_s, ROW_TILE) if scaling == "fine" else x_q.float() * x_s[0, 0]
            xt_q, xt_s = _quantize(x, COL_TILE, scaling)  # re-tile the cached activation: 1x128 -> 128x1
            grad_w = _gemm(dyt_q.t().contiguous(), dyt_s.t(), xt_q.t().contiguous(), xt_s.t(), ROW_TILE)
            grad_w = grad_w.to(weight.dtype)  # [N, K], FP32 like the master weight
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy.float().sum(dim=0)
        return grad_x, grad_w, grad_b, None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scaling: str = "fine"
) -> torch.Tensor:
    """Functional form of :class:`FP8Linear`; output has ``x``'s dtype (BF16 under the recipe)."""
    check_scaling(scaling)
    if x.shape[-1] != weight.shape[1]:
        raise DSV3Error(f"input has {x.shape[-1]} features but the weight expects {weight.shape[1]}")
    return FP8LinearFunction.apply(x, weight, bias, scaling)


class FP8Linear(nn.Module):
    """Drop-in replacement for ``nn.Linear`` (same ``weight: [out, in]`` and ``bias``) with FP8 GEMMs."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        scaling: str = "fine",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_scaling(scaling)
        self.in_features, self.out_features, self.scaling = in_features, out_features, scaling
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=torch.float32))
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features, device=device)) if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation, so a fresh FP8Linear starts where an nn.Linear would."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.scaling)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, scaling={self.scaling}"

    @classmethod
    def from_linear(cls, linear: nn.Linear, scaling: str = "fine") -> FP8Linear:
        """Wrap an existing ``nn.Linear``; an FP32 weight Parameter is shared, not copied."""
        module = cls(linear.in_features, linear.out_features, bias=False, scaling=scaling, device="meta")
        module.weight = fp32_parameter(linear.weight)
        module.register_parameter("bias", None if linear.bias is None else fp32_parameter(linear.bias))
        return module


def fp32_parameter(p: nn.Parameter) -> nn.Parameter:
    """The master weight is FP32: keep the Parameter itself when it already is, else make an FP32 copy."""
    if p.dtype == torch.float32:
        return p
    return nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)


def convert_to_fp8(
    module: nn.Module, skip: Callable[[str], bool] | None = None, scaling: str | None = None
) -> list[str]:
    """Swap every ``nn.Linear`` for an :class:`FP8Linear`, and every module that offers an FP8 training
    form (``fp8_training_form(scaling)``: the routed experts) for that form, in place; returns the
    converted modules' names. The module knows its FP8 form, so number formats need not know the model.

    ``skip(name)`` gets each candidate's qualified name (``"layers.0.mlp.gate"``) and keeps it in high
    precision when true: the V3 recipe keeps the embedding, output head, router gate, norms and the
    attention core out of FP8 (the last four are not ``nn.Linear`` here, so they never convert).
    ``scaling`` defaults to "fine", or to what an enclosing :func:`default_scaling` says.
    """
    scaling = check_scaling(scaling if scaling is not None else _DEFAULT_SCALING.get())
    converted = []
    for name, child in list(module.named_modules()):
        if skip is not None and skip(name):
            continue
        replacement = _fp8_form(child, scaling)
        if replacement is None:
            continue
        if not name:
            raise DSV3Error("convert_to_fp8 swaps modules inside a module; wrap a bare one with from_linear")
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, replacement)
        converted.append(name)
    return converted


def _fp8_form(child: nn.Module, scaling: str) -> nn.Module | None:
    if isinstance(child, nn.Linear):
        return FP8Linear.from_linear(child, scaling=scaling)
    form = getattr(child, "fp8_training_form", None)
    return form(scaling) if callable(form) else None


class FP8BlockLinear(nn.Module):
    """A bias-free nn.Linear whose weight lives in FP8 blocks; ``weight`` dequantizes on access (inference's
    resident FP8 weights, `dsv3.infer.fp8_weights`; the decode kernels read its blocks as they are)."""

    def __init__(self, q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight_fp8", q)
        self.register_buffer("weight_scale_inv", scale_inv.float())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        return fp8.dequantize_weight_blocks(self.weight_fp8, self.weight_scale_inv, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)
