"""Training checkpoints: RUN_DIR/checkpoints/step-NNNNNN, each a complete HF-layout model folder plus
the trainer state, written whole into a hidden staging folder and renamed into place.

A ``kill -9`` at any moment therefore leaves only complete ``step-*`` folders (and perhaps a hidden
staging or trash folder, cleaned on the next start). Old checkpoints are renamed to trash before they
are deleted, so a half-deleted one never looks complete. RUN_DIR/latest points at the newest.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsv3.errors import DSV3Error
from dsv3.io import atomic_write_text, staging_dir

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_PT, STATE_JSON = "trainer_state.pt", "trainer_state.json"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / STATE_JSON).exists() and (p / STATE_PT).exists():
            found.append((int(m[1]), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def clean_leftovers(run_dir: Path) -> None:
    """Remove staging and trash folders a killed process left behind."""
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("."):
                shutil.rmtree(p, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: Path,
    step: int,
    model,
    trainer_state: dict[str, Any],
    summary: dict[str, Any],
    write_extras,
    keep_last: int,
) -> Path:
    """Write step ``step``: model (fp32 HF layout), ``write_extras(folder)`` (tokenizer files), the
    trainer state (torch.save) and a readable summary; then point ``latest`` at it and prune."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    staging = staging_dir(root, f".{final.name}.tmp-")  # umask permissions, not mkdtemp's 0700
    try:
        model.save_pretrained(staging)
        write_extras(staging)
        _atomic_torch_save(trainer_state, staging / STATE_PT)
        atomic_write_text(staging / STATE_JSON, json.dumps(summary, indent=2) + "\n")
        _fsync_tree(staging)
        if final.exists():  # the same step saved again (a resume that stopped at once)
            _trash(final)
        os.replace(staging, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _point_latest(Path(run_dir), final)
    for _, old in complete_checkpoints(run_dir)[:-keep_last]:
        _trash(old)
    return final


def load_trainer_state(folder: Path, rank: int = 0) -> dict[str, Any]:
    """Rank 0's full trainer state, or (rank > 0, expert parallel) that rank's own optimizer state."""
    path = Path(folder) / (STATE_PT if rank == 0 else f"trainer_state.rank{rank}.pt")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as exc:
        raise DSV3Error(f"cannot read {path}: {exc}") from None


def saved_summary(folder: Path) -> dict[str, Any]:
    """The readable summary a checkpoint was saved with (its last evaluation among others); {} when it
    cannot be read, since nothing in it is needed to continue training."""
    try:
        summary = json.loads((Path(folder) / STATE_JSON).read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


# Under expert parallelism each rank > 0 writes its optimizer state beside the checkpoint being built;
# rank 0 moves those files into the staging folder before the rename, so they appear atomically with it.


def save_rank_state(run_dir: Path, step: int, rank: int, state: dict[str, Any]) -> None:
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    _atomic_torch_save(state, root / f".pending-step-{step:06d}-rank{rank}.pt")


def pending_rank_states(run_dir: Path, step: int, world_size: int) -> list[tuple[int, Path]]:
    root = checkpoint_dir(run_dir)
    return [(r, root / f".pending-step-{step:06d}-rank{r}.pt") for r in range(1, world_size)]


def adopt_rank_states(pending: list[tuple[int, Path]], folder: Path) -> None:
    for rank, path in pending:
        if not path.exists():
            raise DSV3Error(f"rank {rank} did not write its optimizer state ({path})")
        os.replace(path, Path(folder) / f"trainer_state.rank{rank}.pt")


def _point_latest(run_dir: Path, target: Path) -> None:
    link = run_dir / "latest"
    tmp = run_dir / f".latest.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, run_dir), tmp)
    os.replace(tmp, link)


def _trash(folder: Path) -> None:
    trash = folder.parent / f".trash-{folder.name}-{os.getpid()}"
    os.replace(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
