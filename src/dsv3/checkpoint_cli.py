"""`dsv3 convert SRC DST --to bf16|fp8|int8|int4|hf`."""

import json
import sys
from pathlib import Path

import typer

app = typer.Typer(add_completion=False)


@app.command()
def convert(
    src: Path = typer.Argument(..., help="Checkpoint folder to read (config.json + safetensors)."),
    dst: Path = typer.Argument(..., help="Folder to write; must not exist unless --overwrite."),
    to: str = typer.Option(..., "--to", help="bf16: dequantize FP8 blocks; fp8: quantize to 128x128 blocks; "
                           "int8, int4: experts, MLPs and attention projections as integer groups of 32, "
                           "the head at 8 bits (the rest bf16); hf: export a training checkpoint "
                           "(RUN/latest, sharded) to the HF layout."),
    overwrite: bool = typer.Option(False, help="Replace DST if it exists."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary object."),
) -> None:
    """Convert a DeepSeek-format checkpoint between FP8 (block-scaled) and BF16, on a CPU, shard by shard, or
    export a training checkpoint (sharded) to the HF layout that transformers loads."""
    from dsv3.config import ModelConfig
    from dsv3.convert import convert_checkpoint, mtp_load_note

    summary = convert_checkpoint(src, dst, to, overwrite=overwrite)
    if as_json:
        print(json.dumps(summary))
    else:
        print(f"wrote {dst}: {summary['tensors']} tensors in {summary['shards']} shard(s), "
              f"{summary['quantized']} quantized, {summary['dequantized']} dequantized, "
              f"{summary['bytes'] / 1e6:.1f} MB")
    note = mtp_load_note(ModelConfig.from_json(dst / "config.json"))
    if note:
        print(note, file=sys.stderr)
