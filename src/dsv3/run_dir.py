"""Where a ``--model PATH`` points: a checkpoint folder, or a training run folder resolved to its latest
checkpoint.

`dsv3 train --out RUN` writes ``RUN/checkpoints/step-NNNNNN`` (each a config.json, the tokenizer and a
sharded ``dcp/`` state that `dsv3.load_pretrained` reads; the last one of a finished run also the HF-layout
export) and points ``RUN/latest`` at the newest. A newcomer naturally passes ``RUN`` itself; every command that
loads a model calls :func:`resolve_checkpoint` so that this works everywhere in the same way. Only the
standard library is used here: the layout is a contract of the training layer, not its code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dsv3.errors import DSV3Error

CONFIG = "config.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
RUN_MARKERS = ("checkpoints", "run.json", "metrics.jsonl", "latest")
SHARDED_DIR = "dcp"  # a training checkpoint's torch.distributed.checkpoint folder


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a training checkpoint without HF-layout weights (only its ``dcp/`` state)."""
    path = Path(path)
    return (path / SHARDED_DIR / ".metadata").is_file() and not any(path.glob("*.safetensors"))


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself when it holds a config.json; for a training run folder its ``latest`` checkpoint
    (or, when that link is missing, its newest complete ``checkpoints/step-*``). Anything else is a
    DSV3Error that says what was expected."""
    path = Path(path)
    if not path.exists():
        raise DSV3Error(f"model folder not found: {path}")
    if not path.is_dir():
        raise DSV3Error(f"{path} is a file; --model takes a checkpoint folder (config.json + safetensors) "
                        "or a training run folder")
    if (path / CONFIG).exists():  # a config.json that is no regular file is refused by the loader, by name
        return path
    if (path / "latest" / CONFIG).is_file():
        return path / "latest"
    steps = _complete_steps(path / "checkpoints")
    if steps:
        return steps[-1]
    if any((path / marker).exists() for marker in RUN_MARKERS):
        raise DSV3Error(f"{path} is a training run folder that holds no checkpoint yet (dsv3 train writes one "
                        "every --save-every steps and at the end; resume it with dsv3 train --resume)")
    raise DSV3Error(f"{path} has no {CONFIG}: give a checkpoint folder (config.json + safetensors) or a "
                    "training run folder (RUN with RUN/latest)")


def _complete_steps(root: Path) -> list[Path]:
    """step-* folders holding a config.json, oldest first (staging and trash folders start with '.')."""
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / CONFIG).is_file()]
    return [p for _, p in sorted(found)]
