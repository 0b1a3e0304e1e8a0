"""Hardware presets (per device) with their sources, and user hardware from a YAML or JSON file.

All bandwidths are per device and per direction, in GB/s (1e9 B/s); FLOPs are dense (no 2:4
sparsity), in TFLOPS. `scale_up_gbs` is the NVLink-class bandwidth inside a domain of
`scale_up_domain` devices; `scale_out_gbs` is the NIC bandwidth to other domains.
Each preset's `source` says where the figures come from and which ones are not verified.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv3.errors import DSV3Error

_DATASHEET = "vendor datasheet figure as recalled, not re-checked against the sheet in this session"


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gb: float  # capacity the model weights and KV cache can live in
    memory_bandwidth_gbs: float  # bandwidth of that memory
    bf16_tflops: float  # dense BF16 peak
    fp8_tflops: float | None = None  # dense FP8 peak; None = no native FP8 (BF16 is used)
    scale_up_gbs: float = 0.0
    scale_up_domain: int = 1
    scale_out_gbs: float = 0.0
    usd_per_hour: float | None = None  # rental price, for training-cost estimates
    source: str = ""

    def peak_tflops(self, dtype: str = "bf16") -> float:
        if dtype == "fp8" and self.fp8_tflops:
            return self.fp8_tflops
        return self.bf16_tflops


HARDWARE_PRESETS: dict[str, Hardware] = {h.name: h for h in [
    Hardware(
        "h800", memory_gb=80, memory_bandwidth_gbs=3350, bf16_tflops=989, fp8_tflops=1979,
        scale_up_gbs=200, scale_up_domain=8, scale_out_gbs=50, usd_per_hour=2.0,
        source="ISCA §4.1/§4.3: NVLink cut from 900 to 400 GB/s (200 GB/s per direction, ~160 achievable), "
               "one 400 Gb/s CX7 IB NIC per GPU = 50 GB/s; $2/GPU-hour from V3 Table 1. HBM 80 GB at "
               f"3.35 TB/s and 989/1979 TFLOPS as H100 SXM ({_DATASHEET}); Table 4's MFU implies a 988 TFLOPS "
               "BF16 peak, consistent.",
    ),
    Hardware(
        "h100", memory_gb=80, memory_bandwidth_gbs=3350, bf16_tflops=989, fp8_tflops=1979,
        scale_up_gbs=450, scale_up_domain=8, scale_out_gbs=50,
        source=f"H100 SXM: 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s total (450 per direction); {_DATASHEET}. "
               "Scale-out assumes one 400 Gb/s NIC per GPU.",
    ),
    Hardware(
        "h200", memory_gb=141, memory_bandwidth_gbs=4800, bf16_tflops=989, fp8_tflops=1979,
        scale_up_gbs=450, scale_up_domain=8, scale_out_gbs=50,
        source=f"H200 SXM: 141 GB HBM3e, 4.8 TB/s, H100's compute and NVLink; {_DATASHEET}. "
               "Scale-out assumes one 400 Gb/s NIC per GPU.",
    ),
    Hardware(
        "b200", memory_gb=180, memory_bandwidth_gbs=7700, bf16_tflops=2250, fp8_tflops=4500,
        scale_up_gbs=900, scale_up_domain=8, scale_out_gbs=50,
        source="HGX B200: 180 GB HBM3e, 7.7 TB/s, 2.25 PFLOPS BF16 / 4.5 PFLOPS FP8 dense, NVLink 5 1.8 TB/s "
               f"total (900 per direction); {_DATASHEET} (third-party tables agree; some list 192 GB / 8 TB/s). "
               "Scale-out assumes one 400 Gb/s NIC per GPU.",
    ),
    Hardware(
        "gb200-nvl72", memory_gb=186, memory_bandwidth_gbs=8000, bf16_tflops=2500, fp8_tflops=5000,
        scale_up_gbs=900, scale_up_domain=72, scale_out_gbs=50,
        source="ISCA §2.3.2 uses 900 GB/s unidirectional NVLink across 72 GPUs. Per GPU: ~186 GB HBM3e "
               "(13.4 TB / 72), 8 TB/s (576 TB/s / 72), 2.5 PFLOPS BF16 / 5 PFLOPS FP8 dense, from NVIDIA's rack "
               f"figures divided by 72; {_DATASHEET}. Scale-out of 50 GB/s (400 Gb/s) is not verified.",
    ),
    Hardware(
        "rtx4090-ddr5-server", memory_gb=1024 + 24, memory_bandwidth_gbs=614.4, bf16_tflops=165,
        fp8_tflops=330,
        source="KTransformers' V3 setup [ISCA §2.2.2]: 2x Xeon Gold 6454S, 8 channels of DDR5-4800 per socket "
               "(2 x 8 x 38.4 = 614.4 GB/s theoretical, NUMA: one socket sees half), 1 TB DRAM + one RTX 4090 "
               "24 GB (1008 GB/s GDDR6X, 165 TFLOPS BF16 / 330 FP8 dense with FP32 accumulate, "
               f"{_DATASHEET}). Experts stream from DRAM, so DRAM bandwidth bounds decode. Cost ~$10,000 "
               "per the paper; KTransformers measured 8.7-16.8 tok/s on V3 Q4_K_M.",
    ),
    Hardware(
        "m4-pro", memory_gb=64, memory_bandwidth_gbs=273, bf16_tflops=8.0,
        source="Apple M4 Pro: up to 64 GB unified memory at 273 GB/s (Apple's pages; docs/references.md). "
               "GPU compute ~8 TFLOPS (20 cores x 128 lanes x 2 x ~1.58 GHz) is an estimate: not verified. No FP8.",
    ),
    Hardware(
        "m4-max", memory_gb=128, memory_bandwidth_gbs=546, bf16_tflops=16.0,
        source="Apple M4 Max (40-core GPU): up to 128 GB unified memory at 546 GB/s (Apple's pages, as cited in "
               "docs/references.md#local-deployment). GPU compute ~16 TFLOPS is an estimate: not verified. No FP8.",
    ),
    Hardware(
        "ryzen-ai-max-395", memory_gb=128, memory_bandwidth_gbs=256, bf16_tflops=59.0,
        source="AMD Ryzen AI Max+ 395: up to 128 GB LPDDR5X-8000 on a 256-bit bus = 256 GB/s (press coverage; "
               "not verified). Radeon 8060S (40 CU, 2.9 GHz) FP16 ~59 TFLOPS is an estimate: "
               "not verified. No FP8 on the GPU.",
    ),
    Hardware(
        "dgx-spark", memory_gb=128, memory_bandwidth_gbs=273, bf16_tflops=125, fp8_tflops=250, scale_out_gbs=25,
        source="NVIDIA DGX Spark (GB10): 128 GB LPDDR5x at 273 GB/s (press coverage; not verified), "
               "ConnectX-7 200 GbE = 25 GB/s. NVIDIA quotes only 1 PFLOP FP4 with sparsity; the dense FP8 250 "
               "and BF16 125 TFLOPS here are derived by halving per step: not verified.",
    ),
]}

_FIELDS = {f.name for f in dataclasses.fields(Hardware)}
_REQUIRED = ("name", "memory_gb", "memory_bandwidth_gbs", "bf16_tflops")


def hardware_from_dict(data: dict[str, Any], where: str = "hardware") -> Hardware:
    """One device from a mapping; unknown keys are rejected so that typos do not pass silently."""
    if not isinstance(data, dict):
        raise DSV3Error(f"{where}: each hardware entry must be a mapping")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise DSV3Error(f"{where}: unknown hardware keys {unknown}; known: {sorted(_FIELDS)}")
    missing = [k for k in _REQUIRED if data.get(k) is None]
    if missing:
        raise DSV3Error(f"{where}: hardware entry lacks {missing}")
    for key in _FIELDS - {"name", "source"}:
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
            raise DSV3Error(f"{where}: {key} must be a non-negative number, got {value!r}")
    if data["memory_bandwidth_gbs"] <= 0 or data["bf16_tflops"] <= 0:
        raise DSV3Error(f"{where}: memory_bandwidth_gbs and bf16_tflops must be positive")
    return Hardware(**{**data, "name": str(data["name"]), "source": str(data.get("source", "user file"))})


def load_hardware_file(path: str | Path) -> list[Hardware]:
    """A YAML or JSON file holding one device, a list of them, or {"hardware": [...]}."""
    path = Path(path)
    if not path.is_file():
        raise DSV3Error(f"hardware file not found: {path}")
    text = path.read_text()
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError
        raise DSV3Error(f"{path} cannot be parsed: {exc}") from None
    if isinstance(data, dict) and "hardware" in data:
        data = data["hardware"]
    entries = data if isinstance(data, list) else [data]
    if not entries:
        raise DSV3Error(f"{path} holds no hardware entries")
    return [hardware_from_dict(e, where=f"{path}[{i}]") for i, e in enumerate(entries)]


def resolve_hardware(names_or_paths: list[str] | None) -> list[Hardware]:
    """Preset names and hardware files, in order; all presets when none are given."""
    if not names_or_paths:
        return list(HARDWARE_PRESETS.values())
    out: list[Hardware] = []
    for item in names_or_paths:
        if item in HARDWARE_PRESETS:
            out.append(HARDWARE_PRESETS[item])
        elif Path(item).suffix.lower() in (".json", ".yaml", ".yml") or Path(item).exists():
            out.extend(load_hardware_file(item))
        else:
            raise DSV3Error(f"unknown hardware {item!r}; choose a preset ({', '.join(HARDWARE_PRESETS)}) "
                            "or give a .yaml/.json file")
    return out
