"""dsv3: DeepSeek-V3 as one readable PyTorch codebase.

``dsv3.load_pretrained(path)`` returns a :class:`dsv3.model.Transformer`; ``model.save_pretrained(path)``
writes HF-layout safetensors in DeepSeek's naming.
"""

__version__ = "0.1.0"


def load_pretrained(path, dtype=None, device="cpu"):
    """Load a DeepSeek/HF-layout checkpoint folder (FP8 block-scaled weights included)."""
    from dsv3.checkpoint import load_pretrained as _load

    return _load(path, dtype=dtype, device=device)
