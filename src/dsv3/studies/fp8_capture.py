"""Real activations for the FP8 quantization-error table: the inputs of a trained model's linear layers.

A forward pass of a checkpoint over held-out standard-library text, with forward pre-hooks on the
attention projections, the dense MLP's down projection, the routed experts (the input of every
expert's gate and up projection) and the shared experts' down projection. Each captured input is
tabulated as it is, with its own outlier channels zeroed (when it has any), and with artificial
outlier channels added, which is what shows why fine-grained scaling matters.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dsv3.errors import DSV3Error

# Modules whose input is captured, by the suffix of their qualified name in a decoder layer.
CAPTURED = ("self_attn.q_proj", "self_attn.kv_b_proj", "self_attn.o_proj", "mlp.down_proj", "mlp.experts",
            "mlp.shared_experts.down_proj")
# Artificial outliers: LLMs show a few "massive" channels 10^3-10^4 x the typical magnitude.
ARTIFICIAL_CHANNELS, ARTIFICIAL_FACTORS = 2, (1000.0, 10000.0)


def heldout_token_batches(tokenizer_file: Path, batches: int, seq_len: int) -> torch.Tensor:
    """``batches`` windows [batches, seq_len] of the standard library's held-out documents (the split
    the trainer never trains on), tokenized with the checkpoint's own tokenizer."""
    from tokenizers import Tokenizer

    from dsv3.data.corpus import load_corpus

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    ids: list[int] = []
    for doc in load_corpus().val:
        ids += tokenizer.encode(doc.text).ids
        if len(ids) >= batches * seq_len:
            break
    if len(ids) < batches * seq_len:
        raise DSV3Error(f"the held-out split has only {len(ids)} tokens; ask for fewer --capture-batches")
    return torch.tensor(ids[: batches * seq_len]).view(batches, seq_len)


def capture_inputs(model: nn.Module, input_ids: torch.Tensor, layers: list[int]) -> dict[str, torch.Tensor]:
    """Run ``model`` on ``input_ids`` and return the inputs [tokens, features] of the ``CAPTURED``
    modules of decoder ``layers``, named ``L{layer}.{suffix}``."""
    captured: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if "layers" not in parts[:-1]:
            continue
        at = parts.index("layers")
        layer, suffix = int(parts[at + 1]), ".".join(parts[at + 2:])
        if layer in layers and suffix in CAPTURED:
            key = f"L{layer}.{suffix}"

            def hook(_module, args, key=key):
                x = getattr(args[0], "x", args[0])  # grouped experts receive ExpertRows: their rows are .x
                captured[key] = x.detach().float().reshape(-1, x.shape[-1]).clone()

            handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def capture_activations(checkpoint: Path, batches: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Linear inputs of the first and last decoder layers of a trained checkpoint on held-out text."""
    from dsv3 import load_pretrained

    checkpoint = Path(checkpoint)
    if not (checkpoint / "tokenizer.json").is_file():
        raise DSV3Error(f"{checkpoint} has no tokenizer.json; --capture-from needs a trained checkpoint folder")
    torch.manual_seed(seed)
    model = load_pretrained(checkpoint, dtype=torch.float32).eval()
    input_ids = heldout_token_batches(checkpoint / "tokenizer.json", batches, seq_len)
    last = model.config.num_hidden_layers - 1
    return capture_inputs(model, input_ids, sorted({0, last}))


def with_outliers_zeroed(x: torch.Tensor, factor: float) -> tuple[torch.Tensor, int]:
    """``x`` with the channels whose amax exceeds ``factor`` x the median channel amax set to zero."""
    amax = x.abs().amax(dim=0)
    mask = amax > factor * amax.median()
    return x.masked_fill(mask, 0.0), int(mask.sum())


def with_artificial_outliers(x: torch.Tensor, channels: int, factor: float, seed: int) -> torch.Tensor:
    """``x`` with ``channels`` randomly chosen channels multiplied by ``factor``."""
    gen = torch.Generator().manual_seed(seed)
    picked = torch.randperm(x.shape[1], generator=gen)[: min(channels, x.shape[1])]
    out = x.clone()
    out[:, picked] *= factor
    return out


def real_activation_rows(captured: dict[str, torch.Tensor], seed: int) -> list[dict]:
    """Error-table rows per captured tensor: as is, outlier channels zeroed (if any), artificial outliers."""
    from dsv3.studies.fp8_training import OUTLIER_FACTOR, quantization_rows

    channels = ARTIFICIAL_CHANNELS
    rows = []
    for name, x in captured.items():
        rows += quantization_rows({name: x}, None)
        zeroed, n = with_outliers_zeroed(x, OUTLIER_FACTOR)
        if n:
            rows += quantization_rows({f"{name}, its {n} outlier channels zeroed": zeroed}, None)
        for factor in ARTIFICIAL_FACTORS:
            spiked = with_artificial_outliers(x, channels, factor, seed)
            rows += quantization_rows({f"{name}, {channels} channels x{factor:g}": spiked}, factor)
    return rows
