"""Small file helpers every layer shares: atomic writes and reading a JSON object with clear errors.

A write that matters goes to a temporary file beside its target, is flushed to disk, then renamed over
it: a reader (or a crash) sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dsv3.errors import DSV3Error


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds it is fsynced, given ordinary
    permissions (0644) and renamed onto ``path``; when it fails it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; ours are meant to be read
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def save_figure(fig, path: str | os.PathLike, **savefig_kwargs: Any) -> Path:
    """Write a matplotlib figure as PNG atomically and close it."""
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, format="png", **savefig_kwargs)
    finally:
        plt.close(fig)
    return Path(path)


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object from ``path`` (or ``path/config.json`` for a folder), or one clear DSV3Error."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise DSV3Error(f"config file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DSV3Error(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DSV3Error(f"{path} must hold a JSON object")
    return data
