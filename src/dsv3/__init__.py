"""dsv3: DeepSeek-V3 as one readable PyTorch codebase."""

__version__ = "0.1.0"

