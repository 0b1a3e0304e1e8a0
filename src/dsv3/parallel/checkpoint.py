"""Sharded training checkpoints with torch.distributed.checkpoint (DCP), keyed by the WHOLE model's names, so
that any layout reads what any other layout wrote (resharding on load).

Every rank writes only what it holds. What it holds follows from a few per-piece rules, applied to its own
modules, so that a layout composed of several pieces (pipeline stages x expert parallelism x FSDP) needs no
code of its own:

* **replicated tensors** (one process, DDP, the dense part under EP, the tied embedding on two pipeline
  stages) are plain tensors under their model names; DCP writes one copy of a key that several ranks hold;
* **FSDP2 parameters** are DTensors: DCP writes each rank's shard and reshards on load;
* **pipeline stages**: a pipeline rank's model holds only its stages' modules, so its state dict names only
  their tensors;
* **routed experts**: a MoE layer's stacked experts ``[n_held, ...]`` become one key per expert
  (``model.layers.3.mlp.experts.5.gate_proj``), under every layout, so an EP rank writes and reads exactly
  its experts (its dispatcher's ``expert_ids`` say which; a local dispatcher holds them all);
* **optimizer state** follows its parameter's key (``optim/<key>.<state>``), split the same way (a scalar
  such as AdamW's ``step`` once, under expert 0's key); each rank writes the state it keeps and
  loads the state of the parameters it updates (ZeRO-1: those it owns).

Keys: ``model/<name>`` for the model (parameters and persistent buffers, the router biases among them) and
``optim/<name>.<state>`` for the optimizer (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dsv3.errors import DSV3Error
from dsv3.model.moe import MoE

MODEL, OPTIM = "model/", "optim/"
Piece = tuple[str, list[int] | None]  # (whole-model key, local expert slots holding it; None: the whole tensor)


# ---- the per-piece rules ------------------------------------------------------------------------


def held_experts(moe: MoE) -> list[int]:
    """The logical expert held in each of this rank's expert slots: the dispatcher's ``expert_ids`` when it
    holds a share (expert parallelism), else every expert in order."""
    ids = getattr(moe.dispatcher, "expert_ids", None)
    return [int(e) for e in ids.tolist()] if ids is not None else list(range(moe.experts.n_experts))


def expert_rules(model: nn.Module) -> dict[str, list[Piece]]:
    """State-dict name of every stacked expert tensor held here -> one piece per logical expert (its key and
    the local slots that hold it; a placement with redundant experts may hold one in several slots)."""
    rules: dict[str, list[Piece]] = {}
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE):
            continue
        slots: dict[int, list[int]] = {}
        for slot, expert in enumerate(held_experts(moe)):
            slots.setdefault(expert, []).append(slot)
        for pname, _ in moe.experts.named_parameters():
            stacked = f"{name}.experts.{pname}"
            rules[stacked] = [(expert_key(stacked, e), s) for e, s in sorted(slots.items())]
    return rules


def expert_key(stacked: str, expert: int) -> str:
    """The key of one routed expert's tensor: ``model.layers.3.mlp.experts.5.gate_proj`` for expert 5 of the
    stacked ``model.layers.3.mlp.experts.gate_proj``."""
    head, _, pname = stacked.rpartition(".")
    return f"{head}.{expert}.{pname}"


def pieces(name: str, rules: dict[str, list[Piece]]) -> list[Piece]:
    """The whole-model keys of the local tensor ``name``: itself, or one per expert for stacked experts."""
    return rules.get(name, [(name, None)])


def first_key(name: str, rules: dict[str, list[Piece]]) -> str:
    """The one key of the local tensor ``name`` whatever the layout: itself, or for stacked experts expert 0's
    (where a scalar such as AdamW's ``step``, the same for every expert, is kept once)."""
    if name not in rules:
        return name
    stacked, _, pname = name.rpartition(".")
    return f"{stacked}.0.{pname}"


def tensor_pieces(name: str, t: torch.Tensor,
                  rules: dict[str, list[Piece]]) -> Iterator[tuple[str, torch.Tensor, list[int] | None]]:
    """(key, tensor, local rows) of every piece of ``t`` held here: the tensor itself (a DTensor included),
    or a view of each held expert's row (rows: where that expert sits in the local rows). Stacked experts
    that FSDP shards along the expert dimension give each rank the experts of its rows."""
    if name not in rules:
        yield name, t, None
        return
    local, first = local_rows(t)
    for key, slots in rules[name]:
        here = [s - first for s in slots if first <= s < first + local.shape[0]]
        if here:
            yield key, local[here[0]], here


def local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the rows of dim 0 held here, the index of the first): the tensor itself, or a DTensor's local shard,
    which must hold whole rows (sharded along dim 0 only, as FSDP2 shards)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape[1:]) != tuple(t.shape[1:]):
        raise DSV3Error(f"stacked experts sharded along another dimension than the experts' ({t.placements}) "
                        "have no checkpoint rule")
    return t.to_local(), offset[0]


def parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


# ---- save ----------------------------------------------------------------------------------------


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """This rank's share of the model and of the optimizer state (None: the model only), keyed by the whole
    model's names (views of the live tensors: nothing is copied)."""
    rules = expert_rules(model)
    state = {MODEL + key: part for name, t in model.state_dict().items()
             for key, part, _ in tensor_pieces(name, t, rules)}
    names = parameter_names(model)
    for p, saved in (optimizer.state.items() if optimizer is not None else ()):
        if id(p) not in names or not saved:
            continue
        name = names[id(p)]
        for k, v in saved.items():
            if not torch.is_tensor(v):
                raise DSV3Error(f"optimizer state {k!r} of {name} is not a tensor; DCP saves tensors only")
            if v.dim() == 0:  # a scalar (AdamW's step), the same for every piece: once, under expert 0's key
                state[f"{OPTIM}{first_key(name, rules)}.{k}"] = v
            else:
                state.update({f"{OPTIM}{key}.{k}": part for key, part, _ in tensor_pieces(name, v, rules)})
    return state


def save_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Write this rank's share into the DCP folder ``folder`` (a collective over every rank)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(checkpoint_state(model, optimizer), storage_writer=FileSystemWriter(str(folder)),
                     no_dist=not _distributed())
    except CheckpointException as exc:  # every rank raises it, whichever rank failed
        raise DSV3Error(f"cannot write the sharded checkpoint {folder}: {_first_failure(exc)}") from None


# ---- load ----------------------------------------------------------------------------------------


def stored_tensors(folder: Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor key of the DCP checkpoint in ``folder`` with its global size and dtype."""
    try:
        meta = FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a missing or corrupt .metadata fails in many ways (it is a pickle)
        raise DSV3Error(f"cannot read the sharded checkpoint {folder}: {type(exc).__name__}: {exc}") from None
    return {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def load_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               updated: Iterable[nn.Parameter] = ()) -> None:
    """Fill this rank's model tensors (in place) and the optimizer state of the parameters it ``updated``
    from the DCP checkpoint in ``folder``, whatever layout wrote it (a collective over every rank)."""
    stored = stored_tensors(folder)
    rules = expert_rules(model)
    targets: dict[str, torch.Tensor] = {}
    duplicates: list[tuple[torch.Tensor, list[int]]] = []  # (local stacked rows, the rows of one expert)
    missing = []
    for name, t in model.state_dict().items():
        for key, part, rows in tensor_pieces(name, t, rules):
            if MODEL + key not in stored:
                missing.append(key)
                continue
            targets[MODEL + key] = part
            if rows is not None and len(rows) > 1:
                duplicates.append((local_rows(t)[0], rows))
    if missing:
        raise DSV3Error(f"{folder} lacks {len(missing)} tensor(s) of this model ({', '.join(missing[:3])}"
                        f"{', ...' if len(missing) > 3 else ''}): it was saved from another model")
    if optimizer is not None:
        targets.update(_optimizer_targets(model, optimizer, updated, stored, rules, duplicates))
    _load(folder, targets, no_dist=not _distributed())
    with torch.no_grad():
        for local, rows in duplicates:
            for r in rows[1:]:
                local[r].copy_(local[rows[0]])


def _optimizer_targets(model: nn.Module, optimizer: torch.optim.Optimizer, updated: Iterable[nn.Parameter],
                       stored: dict[str, TensorStorageMetadata], rules: dict[str, list[Piece]],
                       duplicates: list) -> Iterator[tuple[str, torch.Tensor]]:
    """Fresh optimizer state tensors for every updated parameter the checkpoint holds state for (shaped like
    the parameter, DTensor shards included, or scalars like AdamW's ``step``), and the keys to load them from."""
    by_key: dict[str, dict[str, TensorStorageMetadata]] = {}
    for k, md in stored.items():
        if k.startswith(OPTIM):
            key, _, state_name = k[len(OPTIM):].rpartition(".")
            by_key.setdefault(key, {})[state_name] = md
    names = parameter_names(model)
    for p in updated:
        name = names[id(p)]
        canonical = first_key(name, rules)
        saved = by_key.get(canonical)
        if not saved:
            continue  # no state yet (never stepped): AdamW makes it on the first step
        state = optimizer.state[p]
        for state_name, md in saved.items():
            if len(md.size) == 0:  # a scalar, the same under every key of the parameter
                state[state_name] = torch.zeros((), dtype=md.properties.dtype, device=_scalar_device(optimizer, p))
                yield f"{OPTIM}{canonical}.{state_name}", state[state_name]
                continue
            state[state_name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key, part, rows in tensor_pieces(name, state[state_name], rules):
                yield f"{OPTIM}{key}.{state_name}", part
                if rows is not None and len(rows) > 1:
                    duplicates.append((local_rows(state[state_name])[0], rows))


def _scalar_device(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.device:
    """Where torch's AdamW keeps ``step``: with the parameter when fused or capturable, else on the CPU."""
    d = optimizer.defaults
    return p.device if d.get("fused") or d.get("capturable") else torch.device("cpu")


def _load(folder: Path, targets: dict[str, torch.Tensor], no_dist: bool) -> None:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(targets, storage_reader=FileSystemReader(str(folder)), no_dist=no_dist)
    except CheckpointException as exc:
        raise DSV3Error(f"cannot load the sharded checkpoint {folder}: {_first_failure(exc)}") from None


def _first_failure(exc: CheckpointException) -> str:
    failures = getattr(exc, "failures", {}) or {}
    for err in failures.values():
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return str(exc).splitlines()[0]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


# ---- one process: the whole model from a checkpoint (export, load_pretrained) --------------------


def read_model_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every ``model/`` tensor of the DCP checkpoint ``folder``, whole, in this process (no process group):
    names as the checkpoint keys them (routed experts one per key)."""
    stored = stored_tensors(folder)
    targets = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in stored.items()
               if k.startswith(MODEL)}
    if not targets:
        raise DSV3Error(f"{folder} holds no model tensors")
    _load(folder, targets, no_dist=True)
    return {k[len(MODEL):]: v for k, v in targets.items()}


def stacked_model_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (checkpoint keys, experts one per key) as ``model``'s own state dict (a whole model on one
    process: experts stacked in expert order). A missing expert is a DSV3Error."""
    state = dict(tensors)
    for stacked, parts in expert_rules(model).items():
        try:
            state[stacked] = torch.stack([state.pop(key) for key, _ in parts])
        except KeyError as exc:
            raise DSV3Error(f"the checkpoint lacks routed expert tensor {exc.args[0]}") from None
    return state


def whole_model(folder: Path, cfg) -> nn.Module:
    """The single-process `Transformer` of config ``cfg`` with every tensor from the DCP checkpoint ``folder``
    (the export to the HF layout and `dsv3.load_pretrained` of a training checkpoint go through it)."""
    from dsv3.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    state = stacked_model_state(model, read_model_tensors(folder))
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise DSV3Error(f"{folder} does not match its config.json: {str(exc).splitlines()[-1].strip()}") from None
    model.init_buffers("cpu")
    return model


# ---- one process, a piece at a time: the streamed HF export --------------------------------------


def stored_model_state(folder: Path, stored: dict[str, TensorStorageMetadata],
                       model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state-dict names as meta tensors of the shapes and dtypes the DCP checkpoint ``folder``
    stores (``stored``: its `stored_tensors`; stacked experts as one meta stack): what the export plans its
    shards from, reading no weight. A tensor the checkpoint lacks or stores in another shape is a DSV3Error."""
    experts = {stacked: [key for key, _ in parts] for stacked, parts in expert_rules(model).items()}
    state, missing, wrong = {}, [], []
    for name, t in model.state_dict().items():
        keys = experts.get(name, [name])
        if any(MODEL + k not in stored for k in keys):
            missing.append(name)
            continue
        md = stored[MODEL + keys[0]]
        shape = (len(keys), *md.size) if name in experts else tuple(md.size)
        if shape != tuple(t.shape):
            wrong.append(f"{name} (checkpoint {list(shape)}, config {list(t.shape)})")
        state[name] = torch.empty(shape, dtype=md.properties.dtype, device="meta")
    if missing or wrong:
        problems = [f"lacks {', '.join(missing[:3])}" if missing else "", f"mis-shaped {', '.join(wrong[:3])}"
                    if wrong else ""]
        raise DSV3Error(f"{folder} does not match its config.json: {'; '.join(p for p in problems if p)}")
    return state


def read_model_keys(folder: Path, stored: dict[str, TensorStorageMetadata],
                    wanted: Iterable[tuple[str, int | None]]) -> dict[tuple[str, int | None], torch.Tensor]:
    """The tensors ``wanted`` ((state-dict name, expert row or None), as `checkpoint_entries` names them)
    read from the DCP checkpoint ``folder`` (``stored``: its `stored_tensors`, read once) in this process,
    and nothing else."""
    keys = {w: MODEL + (w[0] if w[1] is None else expert_key(w[0], w[1])) for w in wanted}
    targets = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in set(keys.values())}
    _load(folder, targets, no_dist=True)
    return {w: targets[k] for w, k in keys.items()}
