"""Small file helpers every layer shares: atomic writes, permissions, and reading input files safely.

A write that matters goes to a temporary file beside its target, is flushed to disk, then renamed over
it: a reader (or a crash) sees the old file or the new one, never half of one. ``tempfile`` creates
its files 0600 and folders 0700 (and safetensors writes 0600 files); what we publish gets the user's
umask instead, as any other program's output (and Hugging Face's own checkpoints) would.
An input file must be a regular file: opening a FIFO blocks until someone writes to it, and a device
such as /dev/zero never ends, so both are refused before anything opens them.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dsv3.errors import DSV3Error

MAX_JSON_BYTES = 64 << 20  # configs are kilobytes; a 671B model's safetensors index is about 10 MB


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds it is fsynced, given the user's
    umask permissions (0644 under the usual umask 022) and renamed onto ``path``; when it fails it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())  # mkstemp makes 0600 files; ours are meant to be read
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask can only set it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """Permissions a new file would get from open(): 0666 less the umask."""
    return 0o666 & ~current_umask()


def publish_tree(folder: str | os.PathLike) -> None:
    """Give ``folder`` and everything in it the umask permissions (folders 0777, files 0666 less the umask):
    undoes mkdtemp's 0700 and the 0600 of files written by safetensors and mkstemp."""
    folder = Path(folder)
    dir_mode, mode = 0o777 & ~current_umask(), file_mode()
    os.chmod(folder, dir_mode)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(Path(root) / d, dir_mode)
        for f in files:
            os.chmod(Path(root) / f, mode)


def staging_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A new empty folder in ``parent`` with the umask permissions, to be filled and renamed into place."""
    path = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    os.chmod(path, 0o777 & ~current_umask())
    return path


def require_regular_file(path: str | os.PathLike) -> Path:
    """``path`` when it is a regular file (or a link to one); one clear DSV3Error otherwise, raised before
    anything opens it (a FIFO would block the open, a device would never end)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DSV3Error(f"file not found: {path}") from None
    except OSError as exc:
        raise DSV3Error(f"cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise DSV3Error(f"{path} is not a regular file")
    return path


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
    if require_regular_file(path).stat().st_size > MAX_JSON_BYTES:
        raise DSV3Error(f"{path} is larger than {MAX_JSON_BYTES >> 20} MiB: not a config file")
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise DSV3Error(f"cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise DSV3Error(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DSV3Error(f"{path} must hold a JSON object")
    return data
