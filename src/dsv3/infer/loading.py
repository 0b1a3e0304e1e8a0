"""Loading a checkpoint for inference: weights in the chosen precision, and its tokenizer if it has one."""

from __future__ import annotations

from pathlib import Path

import torch

from dsv3.errors import DSV3Error
from dsv3.infer.fp8_weights import stored_fp8, to_fp8_weights
from dsv3.io import require_regular_file
from dsv3.model.transformer import Transformer
from dsv3.run_dir import resolve_checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
WEIGHT_FORMATS = ("native", "fp8", "int8", "int4")  # what --weights takes
TOKENIZER_FILE = "tokenizer.json"


def parse_dtype(name: str, what: str, allowed: tuple[str, ...]) -> torch.dtype | None:
    """'auto' -> None (the checkpoint's own), else one of ``allowed``."""
    if name == "auto":
        return None
    if name not in allowed:
        raise DSV3Error(f"unknown {what} {name!r}; choose one of auto, {', '.join(allowed)}")
    return DTYPES[name]


def load_model(path: str | Path, dtype: torch.dtype | None = None, weights: str = "native",
               experts: list[int] | None = None) -> Transformer:
    """``weights="fp8"`` keeps the projections resident in FP8 blocks (exactly as stored when the
    checkpoint is FP8, quantized at load otherwise); ``"int8"``/``"int4"`` keep the routed and shared experts
    as integer groups (as stored when the checkpoint has them at that width, quantized at load otherwise).
    ``dtype`` is the compute dtype. ``experts``: read and keep only these routed experts of every MoE layer
    (an expert-parallel rank's share, `load_pretrained`)."""
    from dsv3.checkpoint import load_pretrained

    check_weights(weights)
    path = resolve_checkpoint(path)
    model = load_pretrained(path, dtype=dtype, experts=experts)
    return with_weights(model, weights, path, experts).eval()


def check_weights(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise DSV3Error(f"unknown weights format {weights!r}; choose {', '.join(WEIGHT_FORMATS[:-1])} or int4")


def with_weights(model: Transformer, weights: str, path: Path | None = None,
                 experts: list[int] | None = None) -> Transformer:
    """The model with its weights resident in format ``weights`` (taken as stored in checkpoint ``path`` where
    it holds them in that format, else quantized here)."""
    from dsv3.kernels.int_weights import to_int_weights
    from dsv3.precision.int_groups import BITS

    check_weights(weights)
    if weights == "fp8":
        to_fp8_weights(model, stored_fp8(path) if path is not None else None)
    elif weights in BITS:
        to_int_weights(model, BITS[weights], stored_int(path) if path is not None else None, held=experts)
    return model


def stored_int(path: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The integer weights of a checkpoint exactly as stored: name -> (values, fp16 scales)."""
    from dsv3.checkpoint import checkpoint_files, read_tensors
    from dsv3.precision.int_groups import SCALE_SUFFIX

    tensors = dict(read_tensors(checkpoint_files(Path(path))))
    return {name: (t, tensors[name + SCALE_SUFFIX]) for name, t in tensors.items()
            if t.dtype in (torch.int8, torch.uint8) and name + SCALE_SUFFIX in tensors}


TOKENIZER_HINTS = {  # why a command needs the tokenizer -> what the user can do without one
    "--prompt": "pass token ids with --prompt-ids instead",
    "--stop": "stop strings need it; drop --stop",
    "chat": "chat turns text into tokens with it; use dsv3 generate --prompt-ids instead",
}


def load_tokenizer(path: str | Path, needed_for: str | None = None):
    """The HF ``tokenizers`` tokenizer saved beside the weights, or None. ``needed_for`` (a key of
    TOKENIZER_HINTS) makes a missing one an error that says what to do instead."""
    file = Path(path) / TOKENIZER_FILE
    if not file.exists():
        if needed_for is not None:
            hint = TOKENIZER_HINTS.get(needed_for, f"{needed_for} needs it")
            raise DSV3Error(f"{path} has no {TOKENIZER_FILE}; {hint}")
        return None
    from tokenizers import Tokenizer

    require_regular_file(file)  # a FIFO would block the read
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise DSV3Error(f"cannot read {file}: {exc}") from None


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def eos_ids(model: Transformer, tokenizer) -> frozenset[int]:
    """End-of-sequence ids: the config's, plus the tokenizer's usual end tokens when it defines them."""
    ids = set(model.config.eos_token_ids)  # eos_token_id may be a list (valid HF)
    if tokenizer is not None:
        for token in ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<｜end▁of▁sentence｜>"):
            tid = tokenizer.token_to_id(token)
            if tid is not None:
                ids.add(tid)
    return frozenset(ids)
