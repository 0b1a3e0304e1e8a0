"""Training checkpoints: RUN_DIR/checkpoints/step-NNNNNN, each written whole into a hidden staging folder
(``.step-NNNNNN.staging``) and renamed into place. A checkpoint folder holds

* ``dcp/``: the model and optimizer state as a torch.distributed.checkpoint (DCP) checkpoint, every rank
  writing only what it holds, keyed by the whole model's names (`dsv3.parallel.checkpoint`), so any
  layout resumes it;
* ``trainer_state.pt`` (scheduler, RNG, data position, optimizer hyperparameters, the layout that wrote it)
  and ``trainer_state.json`` (a readable summary), ``config.json`` and the tokenizer files, from rank 0;
* at the end of a run, the HF-layout export (``model.safetensors``) that transformers loads.

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
from dsv3.io import atomic_write_text, publish_tree
from dsv3.run_dir import SHARDED_DIR

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


def staging_folder(run_dir: Path, step: int) -> Path:
    """Where every rank writes step ``step`` before rank 0 renames it into place (one name all ranks know)."""
    return checkpoint_dir(run_dir) / f".step-{step:06d}.staging"


def prepare_staging(run_dir: Path, step: int) -> Path:
    """Rank 0, before the ranks write: an empty staging folder for step ``step`` (a leftover removed)."""
    staging = staging_folder(run_dir, step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish_checkpoint(
    run_dir: Path,
    step: int,
    trainer_state: dict[str, Any],
    summary: dict[str, Any],
    write_extras,
    keep_last: int,
) -> Path:
    """Rank 0, after every rank wrote its share into the staging folder: ``write_extras(folder)`` (config,
    tokenizer files, the HF export at the end of a run), the trainer state (torch.save) and a readable
    summary; then rename the folder into place, point ``latest`` at it and prune."""
    root = checkpoint_dir(run_dir)
    final = root / f"step-{step:06d}"
    staging = staging_folder(run_dir, step)
    try:
        write_extras(staging)
        _atomic_torch_save(trainer_state, staging / STATE_PT)
        atomic_write_text(staging / STATE_JSON, json.dumps(summary, indent=2) + "\n")
        publish_tree(staging)  # umask permissions, as for any other output
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


def save_checkpoint(
    run_dir: Path,
    step: int,
    model,
    trainer_state: dict[str, Any],
    summary: dict[str, Any],
    write_extras,
    keep_last: int,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """One process, no process group: step ``step`` of ``model`` (and ``optimizer``) written as the trainer
    writes it (tools and tests make run folders with it); ``write_extras(folder)`` adds files such as the
    tokenizer beside the config."""
    from dsv3.parallel.checkpoint import save_state

    staging = prepare_staging(run_dir, step)
    save_state(staging / SHARDED_DIR, model, optimizer)

    def extras(folder: Path) -> None:
        model.config.save_json(folder / "config.json")
        write_extras(folder)

    return publish_checkpoint(run_dir, step, trainer_state, summary, extras, keep_last)


def load_trainer_state(folder: Path) -> dict[str, Any]:
    """The trainer state rank 0 saved (every rank reads it); the model and optimizer are in ``dcp/``."""
    path = Path(folder) / STATE_PT
    if not (Path(folder) / SHARDED_DIR).is_dir():
        raise DSV3Error(f"{folder} has no {SHARDED_DIR}/ folder: it was written by an older dsv3 whose training "
                        "checkpoints cannot be resumed; its weights still load (dsv3.load_pretrained)")
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
    """Every file and folder under ``folder`` (DCP's shards sit in a sub-folder) on disk before the rename."""
    for p in folder.iterdir():
        if p.is_dir():
            _fsync_tree(p)
        elif p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
