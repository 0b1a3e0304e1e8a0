"""FP8 <-> BF16 conversion of DeepSeek-format checkpoints, shard by shard, on the CPU; and the export of a
training checkpoint (sharded, torch.distributed.checkpoint) to the HF layout (``--to hf``, or directly in
BF16 or FP8 blocks), read whole into one process.

DeepSeek's own ``fp8_cast_bf16.py`` needs a GPU (Triton). Here each output shard is made from one
input shard, so memory stays bounded by the largest shard; a weight whose ``weight_scale_inv`` lives in
another shard is paired through the index. The result is built in a temporary folder beside the target
and renamed into place at the end, so a failure leaves nothing half-written.

The source is checked against its config.json exactly as ``load_pretrained`` checks it (names, shapes,
dtypes, FP8 scales; NaN/Inf as each tensor is read), so convert never turns a checkpoint that cannot load
into one that looks valid. Only the model travels: a training run's optimizer state
(``trainer_state*``) stays behind, and the output gets the user's umask permissions.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from rich.progress import Progress
from safetensors.torch import save_file

from dsv3.checkpoint import (
    INDEX_NAME,
    check_checkpoint,
    check_values,
    checkpoint_files,
    dequantize_fp8_blocks,
    fp8_quantizable,
    open_safetensors,
    quantize_fp8_blocks,
    read_tensors,
    stored_tensors,
)
from dsv3.config import ModelConfig
from dsv3.errors import DSV3Error
from dsv3.io import publish_tree, staging_dir
from dsv3.precision.int_groups import BITS, SCALE_SUFFIX, check_groupable, dequantize, int_bits, quantize
from dsv3.run_dir import SHARDED_DIR, is_sharded_checkpoint, resolve_checkpoint

TARGETS = ("bf16", "fp8", "hf", "int8", "int4")  # what --to takes
# transformers' DeepseekV3ForCausalLM has no MTP layer and skips the keys of layer 61 on load without a word
# (V3's own MTP layer, a pattern fixed in its class); any other model's MTP layer it lists as UNEXPECTED.
TRANSFORMERS_QUIET_MTP_LAYER = 61
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def mtp_load_note(cfg: ModelConfig) -> str | None:
    """Why transformers will list the MTP layer's keys as UNEXPECTED when it loads this checkpoint, and that
    they are kept on purpose; None when it will not list them (no MTP layer, or V3's own depth)."""
    first, count = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    if count == 0 or first == TRANSFORMERS_QUIET_MTP_LAYER:
        return None
    layers = f"model.layers.{first}.*" if count == 1 else f"model.layers.{first}-{first + count - 1}.*"
    return (f"note: {layers} is the MTP layer, kept on purpose as DeepSeek's checkpoints keep theirs; "
            "transformers loads the main model and lists those keys as UNEXPECTED (see docs/model.md)")


def convert_checkpoint(src: str | Path, dst: str | Path, to: str, overwrite: bool = False) -> dict:
    """Convert ``src`` into ``dst`` with weights in ``to`` ("bf16", "fp8", "int8"/"int4": the projections
    ``int_groups.int_bits`` names as integer groups, the rest bf16, or "hf": the whole model in the HF layout
    as it loads, e.g. a training checkpoint exported); returns a summary."""
    src, dst = Path(src), Path(dst)
    if to not in TARGETS:
        raise DSV3Error(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    if not src.is_dir():
        raise DSV3Error(f"source checkpoint folder not found: {src}")
    src = resolve_checkpoint(src)  # a training run folder means its latest checkpoint
    if dst.exists() and not overwrite:
        raise DSV3Error(f"{dst} already exists (pass --overwrite to replace it)")
    if to in BITS and is_sharded_checkpoint(src):
        raise DSV3Error(f"--to {to} reads a checkpoint folder in the HF layout; export the training checkpoint "
                        f"first (dsv3 convert {src} OUT --to hf), then convert OUT")
    if to == "hf" or is_sharded_checkpoint(src):  # a training checkpoint: streamed, a shard at a time
        return export_whole(src, dst, to)
    cfg = ModelConfig.from_json(src / "config.json")
    files = checkpoint_files(src)
    check_checkpoint(cfg, files)  # the checks load_pretrained makes, before anything is written
    scale_home = _scale_locations(src, files)
    summary = {"tensors": 0, "quantized": 0, "dequantized": 0, "shards": len(files), "bytes": 0}

    def write(tmp: Path) -> None:
        weight_map = {}
        with Progress(transient=True) as progress:
            task = progress.add_task("converting shards", total=len(files))
            for f in files:
                out = _convert_shard(f, scale_home, to, summary)
                save_file(out, str(tmp / f.name), metadata={"format": "pt"})
                weight_map.update({name: f.name for name in out})
                summary["bytes"] += sum(t.numel() * t.element_size() for t in out.values())
                progress.advance(task)
        if len(files) > 1 or (src / INDEX_NAME).exists():
            index = {"metadata": {"total_size": summary["bytes"]}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        cfg.replace(quantization_config=FP8_CONFIG if to == "fp8" else None,
                    torch_dtype="bfloat16").save_json(tmp / "config.json")

    _publish(src, dst, write)
    return summary


def _publish(src: Path, dst: Path, write: Callable[[Path], None]) -> None:
    """``write`` fills a staging folder beside ``dst``; the tokenizer and other files of ``src`` that belong
    with the weights are copied beside them, and the folder is renamed into place (replacing ``dst``), so
    ``dst`` is never half written; a failure removes the staging folder."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(dst.parent, f".{dst.name}.tmp-")
    try:
        write(tmp)
        for extra in src.iterdir():  # tokenizer, generation config, ...
            if _carried_over(extra):
                shutil.copy2(extra, tmp / extra.name)
        publish_tree(tmp)
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_whole(src: Path, dst: Path, to: str) -> dict:
    """The model of checkpoint folder ``src`` (a sharded training checkpoint, or any folder `load_pretrained`
    reads) written to ``dst`` in the HF layout, MTP layer included, with the tokenizer files beside it: as it
    loads (``to="hf"``: a training checkpoint's fp32), in BF16, or in FP8 blocks. Built in a staging folder
    and renamed into place."""
    from dsv3.checkpoint import export_sharded, load_pretrained

    dtype, fp8 = None if to == "hf" else torch.bfloat16, to == "fp8"
    if is_sharded_checkpoint(src):  # a shard at a time: the whole model is never held
        cfg = ModelConfig.from_json(src / "config.json")
        _publish(src, dst, lambda tmp: export_sharded(src / SHARDED_DIR, cfg, tmp, dtype=dtype, fp8=fp8))
    else:
        model = load_pretrained(src)
        _publish(src, dst, lambda tmp: model.save_pretrained(tmp, dtype=dtype, fp8=fp8))
    files = checkpoint_files(dst)
    stored = stored_tensors(files)
    quantized = sum(name.endswith("_scale_inv") for name in stored)
    return {"tensors": len(stored) - quantized, "quantized": quantized, "dequantized": 0, "shards": len(files),
            "bytes": sum(f.stat().st_size for f in files)}


def _carried_over(f: Path) -> bool:
    """Files copied beside the converted weights: regular files that are not weights, index, config, a
    training run's optimizer state or summary (``trainer_state*``), or hidden."""
    skip = f.name.endswith(".safetensors") or f.name in (INDEX_NAME, "config.json")
    return f.is_file() and not skip and not f.name.startswith(("trainer_state", "."))


def _scale_locations(src: Path, files: list[Path]) -> dict[str, Path]:
    """Which file holds each scale tensor (FP8 ``*_scale_inv``, integer groups' ``*_group_scale``; from the
    index when there is one)."""
    suffixes = ("_scale_inv", SCALE_SUFFIX)
    index = src / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {n: src / f for n, f in weight_map.items() if n.endswith(suffixes)}
    homes = {}
    for f in files:
        with open_safetensors(f) as handle:
            homes.update({n: f for n in handle.keys() if n.endswith(suffixes)})
    return homes


def _convert_shard(f: Path, scale_home: dict[str, Path], to: str, summary: dict) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in read_tensors([f]):
        if name.endswith(("_scale_inv", SCALE_SUFFIX)):
            if to == "fp8" and name.endswith("_scale_inv"):
                out[name] = t
            continue
        if t.dtype in (torch.int8, torch.uint8):  # integer groups: the float32 weight they stand for (exact)
            t = dequantize(t, _load_scale(name + SCALE_SUFFIX, scale_home))
            summary["dequantized"] += to not in BITS
        bits = int_bits(name, BITS[to]) if to in BITS else None
        if bits:
            full = dequantize_fp8_blocks(t, _load_scale(name + "_scale_inv", scale_home)) if (
                t.dtype == torch.float8_e4m3fn) else t
            check_groupable(name, tuple(full.shape))
            out[name], out[name + SCALE_SUFFIX] = quantize(check_values(name, full), bits)
            summary["quantized"] += 1
        elif t.dtype == torch.float8_e4m3fn:
            full = check_values(name, dequantize_fp8_blocks(t, _load_scale(name + "_scale_inv", scale_home)))
            if to == "fp8":
                out[name] = t
                continue
            out[name] = full.to(torch.bfloat16)
            summary["dequantized"] += 1
        elif to == "fp8" and fp8_quantizable(name, check_values(name, t)):
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(t)
            summary["quantized"] += 1
        else:
            if to != "fp8":
                check_values(name, t)  # (the fp8 branch's condition checked it already)
            keep_fp32 = name.endswith("mlp.gate.weight") or name.endswith("e_score_correction_bias")
            out[name] = t if keep_fp32 else t.to(torch.bfloat16)
        summary["tensors"] += 1
    return out


def _load_scale(name: str, scale_home: dict[str, Path]) -> torch.Tensor:
    home = scale_home.get(name)
    if home is None:
        base = name.removesuffix("_scale_inv").removesuffix(SCALE_SUFFIX)
        kind = "FP8" if name.endswith("_scale_inv") else "integer"
        raise DSV3Error(f"{kind} tensor {base} has no {name} in the checkpoint")
    with open_safetensors(home) as handle:
        return handle.get_tensor(name)
