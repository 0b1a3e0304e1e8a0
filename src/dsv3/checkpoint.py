"""DeepSeek-format checkpoints: HF-layout safetensors in DeepSeek's tensor names.

* Single file or shards with ``model.safetensors.index.json``; ``config.json`` beside them.
* Routed experts one module per expert on disk (``mlp.experts.E.gate_proj.weight``), stacked in memory.
* The MTP layer at ``model.layers.{num_hidden_layers}`` with its copies of the shared embedding and head
  (``embed_tokens``, ``shared_head.head``), loaded and saved, not dropped.
* FP8 block-scaled weights as DeepSeek ships them: float8_e4m3fn ``weight`` plus float32
  ``weight_scale_inv`` per 128x128 block (edges padded), dequantized exactly on load, on the CPU.
* Before any weight is read, the safetensors headers are checked against the config (names, shapes,
  dtypes, FP8 scale shapes): `load_pretrained` and `dsv3 convert` share that check. Weights must be
  float32, bfloat16, float16 or float64, or float8_e4m3fn with its scales; an integer or bool tensor is
  refused by name rather than cast to float. Every tensor is checked for NaN/Inf as it is read (FP8 ones
  after their scale), so a corrupt weight is named at load instead of producing garbage tokens.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dsv3.config import ModelConfig
from dsv3.errors import DSV3Error
from dsv3.io import publish_tree, require_regular_file, staging_dir
from dsv3.model.moe import stays_fp32
from dsv3.precision import fp8, int_groups
from dsv3.run_dir import SHARDED_DIR, is_sharded_checkpoint, resolve_checkpoint

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
FP8_BLOCK = fp8.TILE
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_INDEX = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")  # its weights and FP8 scales
_MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
# safetensors dtype names: the weights we accept, and readable names for the error message.
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
FP8_DTYPE = "F8_E4M3"
_DTYPE_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
                "I32": "int32", "U64": "uint64", "I64": "int64", "F8_E5M2": "float8_e5m2", FP8_DTYPE: "float8_e4m3fn",
                "F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
_FINITE_CHUNK = 1 << 24  # elements per isfinite pass: bounds the temporary bool mask to 16 MB


# ---- FP8 128x128 block format: implemented once, in dsv3.precision.fp8 ------------------------

def fp8_scale_shape(shape: tuple[int, ...], block: int = FP8_BLOCK) -> tuple[int, int] | None:
    """The ``weight_scale_inv`` shape of an FP8 weight of ``shape`` (None when it is not a matrix)."""
    if len(shape) != 2:
        return None
    return -(-shape[0] // block), -(-shape[1] // block)


dequantize_fp8_blocks = fp8.dequantize_weight_blocks  # refuses a scale of the wrong shape
quantize_fp8_blocks = fp8.quantize_weight_blocks


# ---- names: model state dict <-> checkpoint -------------------------------------------------

def checkpoint_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in DeepSeek's checkpoint naming, experts unstacked, MTP copies included."""
    state = model.state_dict()
    for name, source, expert in checkpoint_entries(state, model.config):
        yield name, state[source] if expert is None else state[source][expert]


def checkpoint_entries(state: dict[str, torch.Tensor], cfg: ModelConfig) -> Iterator[tuple[str, str, int | None]]:
    """(checkpoint name, state-dict name it comes from, expert row or None) of a model's state dict, in
    DeepSeek's naming: stacked experts one name per expert, the MTP layer's embedding and head copies
    included (its own when it holds them, else the main ones). ``state`` may hold meta tensors: only names
    and shapes are read, so the streamed export of a training checkpoint shares this mapping."""
    for name, t in state.items():
        stacked = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$", name)
        if stacked:
            for e in range(t.shape[0]):
                yield f"{stacked[1]}.{e}.{stacked[2]}.weight", name, e
        elif not _is_mtp_copy(name, cfg):
            yield name, name, None
    for k in range(cfg.num_nextn_predict_layers):
        prefix = f"model.layers.{cfg.num_hidden_layers + k}."
        for suffix, main in (("embed_tokens.weight", "model.embed_tokens.weight"),
                             ("shared_head.head.weight", "lm_head.weight")):
            yield prefix + suffix, prefix + suffix if prefix + suffix in state else main, None


def _is_mtp_copy(name: str, cfg: ModelConfig) -> bool:
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    return bool(m) and int(m[1]) >= cfg.num_hidden_layers and m[2] in _MTP_COPIES


# ---- save ---------------------------------------------------------------------------------

def save_pretrained(model, path: str | os.PathLike, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 5 * 2**30, fp8: bool = False, rope_layout: str = "old") -> None:
    """Write config.json and safetensors (sharded above ``max_shard_bytes``) into ``path``.

    The folder is built beside the target and swapped in by rename, so a crash leaves either the old
    checkpoint or the new one, never a mix. ``fp8=True`` stores 2-D projection weights in DeepSeek's FP8
    block format (the router, norms, embedding and head stay in ``dtype``)."""
    write_checkpoint(model.config, checkpoint_tensors(model), path, dtype=dtype, max_shard_bytes=max_shard_bytes,
                     fp8=fp8, rope_layout=rope_layout)


def write_checkpoint(cfg: ModelConfig, items, path: str | os.PathLike, dtype: torch.dtype | None = None,
                     max_shard_bytes: int = 5 * 2**30, fp8: bool = False, rope_layout: str = "old",
                     read=None) -> None:
    """`save_pretrained` of (checkpoint name, tensor) ``items``. With ``read``, the items' tensors may be
    meta (shapes and dtypes only) and ``read(shard_items)`` returns each shard's real tensors as it is
    written: a model that no process holds whole is exported one shard at a time."""
    path = Path(path)
    if fp8:
        cfg = cfg.replace(quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                               "quant_method": "fp8", "weight_block_size": [128, 128]})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(path.parent, f".{path.name}.tmp-")
    try:
        shards = _plan_shards(items, dtype, fp8, max_shard_bytes)
        _write_shards(shards, tmp, dtype, fp8, read or (lambda shard: shard))
        cfg.save_json(tmp / "config.json", rope_layout=rope_layout)
        publish_tree(tmp)
        _swap_in(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_sharded(folder: str | os.PathLike, cfg: ModelConfig, path: str | os.PathLike,
                   dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30, fp8: bool = False) -> None:
    """The DCP training checkpoint ``folder`` (a model of config ``cfg``) written in the HF layout into
    ``path``, as `save_pretrained` of the whole model would write it, without building that model: names,
    shapes and the shard plan come from a meta model and the checkpoint's metadata, and each shard's
    tensors are read from the checkpoint only when it is written, so the exporter holds about one shard.
    ``dtype`` and ``fp8`` as for `save_pretrained` (default: the stored dtypes)."""
    from dsv3.model import Transformer
    from dsv3.parallel.checkpoint import read_model_keys, stored_model_state, stored_tensors

    folder = Path(folder)
    with torch.device("meta"):
        model = Transformer(cfg)
    stored = stored_tensors(folder)  # the checkpoint's metadata, read once
    state = stored_model_state(folder, stored, model)  # meta tensors of the stored shapes and dtypes
    sources = {name: (source, expert) for name, source, expert in checkpoint_entries(state, cfg)}
    items = [(name, state[source] if expert is None else state[source][expert])
             for name, (source, expert) in sources.items()]

    def read(shard: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        values = read_model_keys(folder, stored, [sources[name] for name, _ in shard])
        return [(name, values[sources[name]]) for name, _ in shard]

    write_checkpoint(cfg, items, path, dtype=dtype, max_shard_bytes=max_shard_bytes, fp8=fp8, read=read)


def _prepare(items, dtype, fp8) -> dict[str, torch.Tensor]:
    """The stored tensors of ``items`` (name, tensor view): on the CPU, cast or FP8-quantized, each its
    own storage (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        t = t.detach().to("cpu")
        if fp8 and fp8_quantizable(name, t):
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(t)
            continue
        out[name] = t.to(_save_dtype(name, t, dtype)).contiguous().clone()
    return out


def _save_dtype(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` for floating tensors, except the router's weight and bias, which stay fp32."""
    return dtype if dtype is not None and t.is_floating_point() and not stays_fp32(name) else t.dtype


def _stored_bytes(name: str, t: torch.Tensor, dtype: torch.dtype | None, fp8: bool) -> int:
    """Bytes ``_prepare`` will write for one tensor, known before anything is materialized."""
    if fp8 and fp8_quantizable(name, t):
        n, k = t.shape
        return n * k + (-(-n // FP8_BLOCK)) * (-(-k // FP8_BLOCK)) * 4  # E4M3 values + fp32 block scales
    return t.numel() * _save_dtype(name, t, dtype).itemsize


def _int_dtype_bits(dtype: str) -> int | None:
    return {"I8": 8, "U8": 4}.get(dtype)


def fp8_quantizable(name: str, t: torch.Tensor) -> bool:
    """DeepSeek's FP8 checkpoints quantize the projection matrices of attention and FFNs only."""
    if t.dim() != 2 or not name.endswith("_proj.weight") and not name.endswith("proj_with_mqa.weight"):
        return False
    return "eh_proj" not in name


def _plan_shards(items, dtype, fp8, max_shard_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Split (name, tensor view) pairs into shards of at most ``max_shard_bytes`` stored bytes (a single
    larger tensor gets a shard of its own); an FP8 weight and its scales stay together."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        nbytes = _stored_bytes(name, t, dtype, fp8)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    return shards


def _write_shards(shards, folder: Path, dtype, fp8, read) -> None:
    """One shard at a time: only one shard's converted copy is ever in memory (a 671B save would
    otherwise hold a second copy of the whole model); ``read(items)`` gives a shard's tensors."""
    if len(shards) == 1:
        save_file(_prepare(read(shards[0]), dtype, fp8), str(folder / SINGLE_NAME), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, items in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        shard = _prepare(read(items), dtype, fp8)
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _swap_in(tmp: Path, path: Path) -> None:
    """Replace ``path`` by ``tmp``; files in ``path`` that are not checkpoint files are kept."""
    if not path.exists():
        os.replace(tmp, path)
        return
    stale = [f for f in path.iterdir() if f.name.endswith(".safetensors") or f.name in (INDEX_NAME, "config.json")]
    for f in stale:
        if not (tmp / f.name).exists():
            f.unlink()
    for f in tmp.iterdir():
        os.replace(f, path / f.name)
    tmp.rmdir()


# ---- load ---------------------------------------------------------------------------------

def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of the checkpoint folder ``path``, each checked to be a regular file."""
    if (path / INDEX_NAME).exists():
        names = _index_file_names(path / INDEX_NAME)
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise DSV3Error(f"checkpoint shard(s) listed in the index are missing: {', '.join(missing)}")
        return [require_regular_file(path / n) for n in names]
    if (path / SINGLE_NAME).exists():
        return [require_regular_file(path / SINGLE_NAME)]
    found = sorted(path.glob("*.safetensors"))
    if not found and is_sharded_checkpoint(path):
        raise DSV3Error(f"{path} is a sharded training checkpoint ({SHARDED_DIR}/); export it to the HF layout "
                        f"first: dsv3 convert {path} DST --to hf")
    if not found:
        raise DSV3Error(f"no safetensors checkpoint in {path}")
    return [require_regular_file(f) for f in found]


def _index_file_names(index_path: Path) -> list[str]:
    """The shard file names an index lists: plain names in the same folder."""
    require_regular_file(index_path)
    try:
        index = json.loads(index_path.read_text())
        names = sorted(set(index["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise DSV3Error(f"{index_path} is not a valid safetensors index: {exc}") from None
    bad = [n for n in names if not isinstance(n, str) or not n or Path(n).name != n or n in (".", "..")]
    if bad:
        raise DSV3Error(f"{index_path} lists shard names that are not file names in its folder: {_few(bad)}")
    return names


@contextmanager
def open_safetensors(f: Path):
    """``safe_open`` with one clear error for a truncated or corrupt file (and none for a FIFO: refused first)."""
    require_regular_file(f)
    try:
        with safe_open(str(f), framework="pt") as handle:
            yield handle
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise DSV3Error(f"cannot read {f}: corrupt or truncated safetensors file ({exc})") from None


def stored_tensors(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype name) of every tensor, from the file headers alone: checking
    a 700 GB checkpoint against its config reads no weight."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        with open_safetensors(f) as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                out[name] = (tuple(piece.get_shape()), piece.get_dtype())
    return out


def _check_dtypes(stored: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Floating weights only; every FP8 weight a matrix with a float scale of the 128x128 block shape."""
    accepted = "float32, bfloat16, float16, float64, or float8_e4m3fn with a weight_scale_inv"
    unscaled = []
    for name, (shape, dtype) in stored.items():
        if dtype == FP8_DTYPE and not name.endswith("_scale_inv"):
            scale = stored.get(name + "_scale_inv")
            if scale is None:
                unscaled.append(name)
            elif scale[1] not in FLOAT_DTYPES:
                raise DSV3Error(f"tensor {name}_scale_inv is stored as {_DTYPE_NAMES.get(scale[1], scale[1])}; "
                                "FP8 block scales must be floating point")
            elif fp8_scale_shape(shape) != scale[0]:
                raise DSV3Error(f"tensor {name}_scale_inv has shape {scale[0]}, but the 128x128 blocks of {name} "
                                f"{shape} need {fp8_scale_shape(shape)}")
        elif _int_dtype_bits(dtype) and stored.get(name + int_groups.SCALE_SUFFIX) is not None:
            _check_int_scale(name, shape, _int_dtype_bits(dtype), stored[name + int_groups.SCALE_SUFFIX])
        elif dtype not in FLOAT_DTYPES:
            raise DSV3Error(f"tensor {name} is stored as {_DTYPE_NAMES.get(dtype, dtype)}; weights must be {accepted}")
    if unscaled:
        raise DSV3Error(f"FP8 tensors without a weight_scale_inv: {', '.join(sorted(unscaled)[:5])}")


def _check_int_scale(name: str, shape: tuple[int, ...], bits: int, scale: tuple[tuple[int, ...], str]) -> None:
    """An integer weight's group scales: fp16, one per 32 values of the weight it stands for."""
    want = int_groups.scale_shape(int_groups.logical_shape(shape, bits))
    if scale[1] != "F16" or tuple(scale[0]) != want:
        raise DSV3Error(f"tensor {name}{int_groups.SCALE_SUFFIX} is {_DTYPE_NAMES.get(scale[1], scale[1])} "
                        f"{list(scale[0])}; the int{bits} groups of {name} need float16 {list(want)}")


def _logical_shapes(stored: dict[str, tuple[tuple[int, ...], str]]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Each weight's name and the shape it loads as (scales left out; packed int4 counted as its values)."""
    for name, (shape, dtype) in stored.items():
        if name.endswith(("_scale_inv", int_groups.SCALE_SUFFIX)):
            continue
        bits = _int_dtype_bits(dtype)
        yield name, int_groups.logical_shape(shape, bits) if bits else shape


def check_checkpoint(cfg: ModelConfig, files: list[Path]) -> ModelConfig:
    """Everything ``load_pretrained`` checks before reading a weight (dtypes, FP8 scales, expert counts,
    names, shapes), from the headers alone; `dsv3 convert` runs the same check, with the same messages.
    Returns the config the model is built from (without MTP layers when the checkpoint has none)."""
    from dsv3.model import Transformer

    stored = stored_tensors(files)
    _check_dtypes(stored)
    shapes = ((name, torch.empty(shape, device="meta")) for name, shape in _logical_shapes(stored))
    tensors = to_model_names(shapes, cfg)
    cfg = _without_absent_mtp(cfg, tensors)
    with torch.device("meta"):
        model = Transformer(cfg)
    _attach_distinct_mtp_copies(model, tensors)
    _check_names_and_shapes(model, tensors)
    return cfg


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``, in bounded chunks (a 1B-element embedding would otherwise need a 1 GB mask)."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(_FINITE_CHUNK))


def check_values(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` when it is a floating tensor without NaN or Inf; a DSV3Error naming the tensor otherwise."""
    if not t.is_floating_point() or t.dtype not in FLOAT_DTYPES.values():
        raise DSV3Error(f"tensor {name} is stored as {str(t.dtype).removeprefix('torch.')}; weights must be "
                        "float32, bfloat16, float16, float64, or float8_e4m3fn with a weight_scale_inv")
    if not all_finite(t):
        raise DSV3Error(f"tensor {name} holds NaN or infinite values: the checkpoint is corrupt")
    return t


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def read_tensors(files: list[Path], experts: set[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every file, one at a time; with ``experts``, of the routed experts only those (the
    others are never read from the file). Read with plain reads into memory of their own, not through a
    memory map: the pages of the file a process touched would count in its resident memory as long as the
    map lives, twice the weights at the peak of a load."""
    for f in files:
        header, data_start = read_header(f)
        with open(f, "rb") as stream:
            for name, info in header.items():
                m = _EXPERT_INDEX.match(name)
                if experts is None or m is None or int(m[1]) in experts:
                    yield name, _read_one(stream, f, name, info, data_start)


def read_header(f: Path) -> tuple[dict[str, dict], int]:
    """(name -> dtype, shape and byte offsets of every tensor, where the data starts) of the safetensors file
    ``f``, checked first by safetensors itself (one clear error for a corrupt file)."""
    with open_safetensors(f):
        pass
    with open(f, "rb") as stream:
        header_len = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(header_len))
    header.pop("__metadata__", None)
    return header, 8 + header_len


def _read_one(stream, f: Path, name: str, info: dict, data_start: int, rows: slice | None = None) -> torch.Tensor:
    """Tensor ``name`` of an open safetensors file (with ``rows``, only those rows of its first dimension: one
    contiguous byte range of a row-major tensor), read in place into a new tensor."""
    dtype = SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
        raise DSV3Error(f"{f}: tensor {name} has dtype {info['dtype']}, which dsv3 does not read")
    begin, end = info["data_offsets"]
    shape = list(info["shape"])
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise DSV3Error(f"cannot read {f}: tensor {name} holds {end - begin} bytes for "
                        f"{math.prod(shape) * dtype.itemsize}")
    if rows is not None:
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        begin, shape[0] = begin + rows.start * row_bytes, rows.stop - rows.start
        end = begin + shape[0] * row_bytes
    t = torch.empty(shape, dtype=dtype)
    raw = t.view(-1).view(torch.uint8).numpy() if t.numel() else bytearray()
    stream.seek(data_start + begin)
    if stream.readinto(raw) != end - begin:
        raise DSV3Error(f"cannot read {f}: corrupt or truncated safetensors file (tensor {name} ends early)")
    return t


def dequantized(items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pair FP8 weights with their ``weight_scale_inv`` and yield the exact float32 product; every
    tensor yielded is checked to be floating and finite (FP8 ones after their scale)."""
    for name, t in _paired(items):
        yield name, check_values(name, t)


def _paired(items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    pending: dict[str, torch.Tensor] = {}
    for name, t in items:
        if name.endswith(int_groups.SCALE_SUFFIX) or t.dtype in (torch.int8, torch.uint8):
            yield from _int_pair(name, t, pending)
        elif name.endswith("_scale_inv"):
            base = name[: -len("_scale_inv")]
            if base in pending:
                yield base, dequantize_fp8_blocks(pending.pop(base), t)
            else:
                pending[name] = t
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = pending.pop(name + "_scale_inv", None)
            if scale is None:
                pending[name] = t
            else:
                yield name, dequantize_fp8_blocks(t, scale)
        else:
            yield name, t
    leftover = [n for n in pending if not n.endswith("_scale_inv")]
    if leftover:
        raise DSV3Error(f"FP8 tensors without a weight_scale_inv: {', '.join(sorted(leftover)[:5])}")


def _int_pair(name: str, t: torch.Tensor, pending: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """An integer weight's values or scales: the float32 weight (exact) once both halves are read."""
    if name.endswith(int_groups.SCALE_SUFFIX):
        base, scale = name[: -len(int_groups.SCALE_SUFFIX)], t
        if base not in pending:
            pending[name] = t
            return
        values = pending.pop(base)
    else:
        base, values, scale = name, t, pending.pop(name + int_groups.SCALE_SUFFIX, None)
        if scale is None:
            pending[name] = t
            return
    yield base, int_groups.dequantize(values, scale)


def to_model_names(items: Iterator[tuple[str, torch.Tensor]], cfg: ModelConfig,
                   held: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint names -> model state-dict names: experts stacked (all in order, or the ``held`` ones in
    that order), stale rotary buffers dropped. Each expert is copied into its stack as it is read, so the
    experts are in memory once, not once apart and once stacked."""
    order = list(range(cfg.n_routed_experts or 0)) if held is None else list(held)
    slots: dict[int, list[int]] = {}
    for i, e in enumerate(order):
        slots.setdefault(e, []).append(i)
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, torch.Tensor] = {}
    seen: dict[str, set[int]] = {}
    for name, t in items:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        m = _EXPERT.match(name)
        if not m:
            out[name] = t
            continue
        key, expert = f"{m[1]}.{m[3]}", int(m[2])
        seen.setdefault(key, set()).add(expert)
        if expert not in slots:
            continue
        if key not in stacks:
            stacks[key] = t.new_empty(len(order), *t.shape)
        stack = stacks[key]
        if stack.shape[1:] != t.shape:
            raise DSV3Error(f"experts of {key} have different shapes: {list(stack.shape[1:])} and {list(t.shape)}")
        for i in slots[expert]:
            stack[i].copy_(t)
    for key, got in seen.items():
        n = cfg.n_routed_experts
        missing = sorted(set(order) - got)
        if missing or (held is None and len(got) != n):
            raise DSV3Error(f"checkpoint has experts {sorted(got)[:3]}... for {key} "
                            f"but the config says {n}; missing: {missing[:8]}")
        out[key] = stacks[key]
    return out


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                    experts: list[int] | None = None):
    """A :class:`Transformer` from a DeepSeek/HF-layout checkpoint folder (any dtype, FP8 included).

    ``dtype=None`` keeps the stored floating dtype (FP8 weights become bfloat16); the router weight and
    the correction bias always stay float32, as DeepSeek keeps them. ``experts``: of every MoE layer's
    routed experts read and keep only these (logical ids, in slot order; `MoE.hold_experts`), for a rank
    about to join an expert-parallel group that holds them there; the model then runs only once it has
    (a training checkpoint's sharded folder is read whole and split when the rank joins)."""
    from dsv3.model import Transformer

    path = Path(path)
    if not path.is_dir():
        raise DSV3Error(f"checkpoint folder not found: {path}")
    path = resolve_checkpoint(path)  # a training run folder means its latest checkpoint
    cfg = ModelConfig.from_json(path / "config.json")
    if is_sharded_checkpoint(path):  # a training checkpoint: its sharded state, read into one process
        return _load_sharded(path, cfg, dtype, device)
    files = checkpoint_files(path)
    cfg = check_checkpoint(cfg, files)  # from the headers, before any weight is read
    tensors = to_model_names(dequantized(read_tensors(files, None if experts is None else set(experts))), cfg,
                             experts)
    held = None if experts is None else torch.tensor(experts, dtype=torch.long)
    with torch.device("meta"):
        model = Transformer(cfg)
        for moe in model.moe_layers() if held is not None else ():
            moe.hold_experts(held)
    _attach_distinct_mtp_copies(model, tensors)
    target_dtype = dtype or _stored_dtype(tensors)
    _check_names_and_shapes(model, tensors)
    state = {}
    for name, t in tensors.items():
        state[name] = t.to(device=device, dtype=torch.float32 if stays_fp32(name) else target_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.init_buffers(device)  # non-persistent buffers are still meta
    return model.eval()


def _load_sharded(path: Path, cfg: ModelConfig, dtype: torch.dtype | None, device: str | torch.device):
    """A training checkpoint's DCP state as one model; floating tensors in ``dtype`` (default: as stored,
    fp32) but the router and its bias, which stay fp32."""
    from dsv3.parallel.checkpoint import whole_model  # the sharded format's rules live with the layouts

    model = whole_model(path / SHARDED_DIR, cfg)
    stored = set(model.state_dict())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if dtype is not None and name in stored and t.is_floating_point() and not stays_fp32(name):
            t.data = t.data.to(dtype)
    return model.to(device).eval()


def _without_absent_mtp(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> ModelConfig:
    """Checkpoints written by transformers drop the MTP layers that their config still announces;
    load such a checkpoint as the main model alone rather than fail."""
    first_mtp = f"model.layers.{cfg.num_hidden_layers}."
    if cfg.num_nextn_predict_layers and not any(n.startswith(first_mtp) for n in tensors):
        return cfg.replace(num_nextn_predict_layers=0)
    return cfg


def _stored_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    ref = tensors.get("model.embed_tokens.weight")
    if ref is None or not ref.is_floating_point():
        return torch.bfloat16
    return ref.dtype


def _attach_distinct_mtp_copies(model, tensors: dict[str, torch.Tensor]) -> None:
    """The MTP layer's embedding/head copies: shared when they equal the main ones (DeepSeek's case),
    otherwise kept as the layer's own so that nothing in the checkpoint is lost."""
    from torch import nn

    cfg = model.config
    for k, layer in enumerate(model.mtp_layers):
        prefix = f"model.layers.{cfg.num_hidden_layers + k}."
        for suffix, main in (("embed_tokens.weight", "model.embed_tokens.weight"),
                             ("shared_head.head.weight", "lm_head.weight")):
            copy = tensors.get(prefix + suffix)
            if copy is None:
                continue
            same_shape = main in tensors and copy.shape == tensors[main].shape
            if same_shape and (copy.is_meta or torch.equal(copy, tensors[main])):  # meta: a header-only check
                del tensors[prefix + suffix]
            elif suffix.startswith("embed"):
                layer.embed_tokens = nn.Embedding(*copy.shape, device="meta")
            else:
                layer.shared_head.head = nn.Linear(copy.shape[1], copy.shape[0], bias=False, device="meta")


def _check_names_and_shapes(model, tensors: dict[str, torch.Tensor]) -> None:
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(f"{n} (checkpoint {tuple(tensors[n].shape)}, model {expected[n]})"
                   for n in set(expected) & set(tensors) if tuple(tensors[n].shape) != expected[n])
    problems = []
    if missing:
        problems.append(f"missing tensors: {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_few(unexpected)}")
    if wrong:
        problems.append(f"mis-shaped tensors: {_few(wrong)}")
    if problems:
        raise DSV3Error("checkpoint does not match its config.json:\n  - " + "\n  - ".join(problems))


def _few(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# ---- per-rank reads: a checkpoint as the source of a laid-out model's values --------------------

def pretrained_config(path: str | os.PathLike) -> ModelConfig:
    """The config of the HF-layout checkpoint folder ``path``, checked against its tensors' headers (names,
    shapes, dtypes, FP8 scales) before any weight is read; without MTP layers when the checkpoint has none."""
    path = Path(path)
    if not path.is_dir():
        raise DSV3Error(f"checkpoint folder not found: {path}")
    path = resolve_checkpoint(path)
    if not (path / "config.json").is_file():
        raise DSV3Error(f"{path} holds no config.json: not a DeepSeek-format checkpoint")
    return check_checkpoint(ModelConfig.from_json(path / "config.json"), checkpoint_files(path))


class CheckpointValues:
    """An HF-layout checkpoint as the source of `dsv3.parallel.materialize.materialize`: each piece a rank
    asks for (a tensor, an expert, an FSDP shard's rows) is read alone with plain reads of its bytes (rows
    of a row-major tensor are one byte range), FP8 blocks dequantized exactly; nothing else is read. The
    MTP layer's copies of the embedding and head must equal the main ones (the model shares them)."""

    def __init__(self, path: str | os.PathLike, cfg: ModelConfig):
        path = resolve_checkpoint(Path(path))
        self.where: dict[str, tuple[Path, dict, int]] = {}  # name -> (file, header entry, data start)
        self.bytes_read, self.names_read = 0, set()  # what this process read: its share, never the whole
        for f in checkpoint_files(path):
            header, data_start = read_header(f)
            self.where.update({name: (f, info, data_start) for name, info in header.items()})
        self.total_bytes = sum(info["data_offsets"][1] - info["data_offsets"][0] for _, info, _ in self.where.values())
        self.copies = {main: [f"model.layers.{cfg.num_hidden_layers + k}.{suffix}"
                              for k in range(cfg.num_nextn_predict_layers)]
                       for main, suffix in (("model.embed_tokens.weight", "embed_tokens.weight"),
                                            ("lm_head.weight", "shared_head.head.weight"))}

    def __call__(self, key: str, shape: tuple[int, ...], rows: slice | None) -> torch.Tensor:
        name = key + ".weight" if _EXPERT.match(key + ".weight") else key
        value = self.read(name, rows)
        for copy in self.copies.get(name, ()):
            if copy in self.where and not torch.equal(self.read(copy, rows), value):
                raise DSV3Error(f"{copy} differs from {name}: dsv3 trains the MTP layer with the main model's "
                                "embedding and head, which this checkpoint does not share")
        return value

    def read(self, name: str, rows: slice | None) -> torch.Tensor:
        """Tensor ``name`` (its ``rows`` of dim 0, or all), dequantized when stored in FP8 blocks, checked."""
        if name not in self.where:
            raise DSV3Error(f"the checkpoint lacks tensor {name}")
        scale = self.where.get(name + "_scale_inv")
        if self.where[name][1]["dtype"] != FP8_DTYPE or scale is None:
            return check_values(name, self._read(name, rows))
        n = self.where[name][1]["shape"][0]
        rows = rows or slice(0, n)
        first, last = rows.start // FP8_BLOCK, -(-rows.stop // FP8_BLOCK)  # the blocks holding those rows
        q = self._read(name, slice(first * FP8_BLOCK, min(last * FP8_BLOCK, n)))
        s = self._read(name + "_scale_inv", slice(first, last))
        value = dequantize_fp8_blocks(q, s)[rows.start - first * FP8_BLOCK: rows.stop - first * FP8_BLOCK]
        return check_values(name, value)

    def _read(self, name: str, rows: slice | None) -> torch.Tensor:
        f, info, start = self.where[name]
        with open(f, "rb") as stream:
            t = _read_one(stream, f, name, info, start, rows)
        self.bytes_read += t.numel() * t.element_size()
        self.names_read.add(name)
        return t
