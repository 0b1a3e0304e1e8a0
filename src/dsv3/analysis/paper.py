"""`dsv3 paper`: every number of the ISCA paper's co-design arithmetic, next to ours, with notes.

Our values come from the same functions `dsv3 analyze` uses, applied to the shipped configs; nothing
here is typed in except the paper's own numbers (and their section) and the notes on where the paper
disagrees with itself.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from dsv3.analysis import bounds, flops, memory
from dsv3.analysis.arch import Architecture, from_hf_dict, load_architecture
from dsv3.analysis.hardware import HARDWARE_PRESETS
from dsv3.analysis.params import ParamCounts, count_params

TABLE1_MODELS = {"DeepSeek-V3 (MLA)": "deepseek-v3", "Qwen-2.5 72B (GQA)": "qwen2.5-72b",
                 "LLaMA-3.1 405B (GQA)": "llama-3.1-405b"}
AI_SOC = ("m4-pro", "m4-max", "ryzen-ai-max-395", "dgx-spark")

# Qwen-72B (v1, Nov 2023): MHA, SwiGLU width 24576 (its config.json says intermediate_size 49152 = 2 x 24576).
# As recalled from Qwen/Qwen-72B's config.json; not re-checked in this session. Used only to test whether
# Table 2's "Qwen-72B" row means this model rather than Qwen2.5-72B.
QWEN1_72B = {"model_type": "qwen2", "hidden_size": 8192, "intermediate_size": 24576, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 152064}


@dataclass(frozen=True)
class PaperRow:
    group: str
    quantity: str
    paper: float
    ours: float
    unit: str
    note: str = ""

    @property
    def diff_pct(self) -> float:
        return 100.0 * (self.ours - self.paper) / self.paper

    def as_dict(self) -> dict:
        return {**asdict(self), "diff_pct": self.diff_pct}


@dataclass(frozen=True)
class FlopConvention:
    """One way of counting training FLOPs per token, for the search that explains Table 2's rows."""

    head: bool  # count the output head's matmul
    embedding: bool  # count the input embedding as a matmul
    attention: float  # multiplier of layers x heads x (d_qk + d_v) x S: 0, 1.5, 3 (causal) or 6 (full)

    def flops(self, arch: Architecture, counts: ParamCounts, seq_len: int = 4096) -> float:
        n = counts.matmul_active - (0 if self.head else arch.vocab_size * arch.hidden_size)
        n += arch.vocab_size * arch.hidden_size if self.embedding else 0
        return 6 * n + self.attention * flops.attention_macs_per_key(arch) * seq_len

    def describe(self) -> str:
        attn = {0: "no attention term", 1.5: "half the causal attention term", 3: "causal attention",
                6: "non-causal attention"}[self.attention]
        return (f"6N {'with' if self.head else 'without'} the output head"
                f"{', with the embedding' if self.embedding else ''}, {attn}")


CONVENTIONS = [FlopConvention(h, e, a) for h, e, a in itertools.product((True, False), (False, True),
                                                                        (3, 6, 1.5, 0))]


def matching_conventions(arch: Architecture, target_gflops: float, tolerance: float = 0.005) -> list[str]:
    """The counting conventions that land within `tolerance` of a paper figure."""
    counts = count_params(arch)
    return [c.describe() for c in CONVENTIONS if abs(c.flops(arch, counts) / 1e9 / target_gflops - 1) <= tolerance]


def nearest_convention(arch: Architecture, target_gflops: float) -> tuple[str, float]:
    counts = count_params(arch)
    best = min(CONVENTIONS, key=lambda c: abs(c.flops(arch, counts) / 1e9 - target_gflops))
    return best.describe(), best.flops(arch, counts) / 1e9


def _table1() -> list[PaperRow]:
    kb = {label: memory.kv_bytes_per_token(load_architecture(name)) / 1000 for label, name in TABLE1_MODELS.items()}
    v3 = kb["DeepSeek-V3 (MLA)"]
    rows = [PaperRow("Table 1: KV cache per token (BF16)", label, paper, kb[label], "KB",
                     "KB = 1000 B; exact" if abs(kb[label] - paper) < 1e-9 else "")
            for label, paper in zip(TABLE1_MODELS, (70.272, 327.680, 516.096), strict=True)]
    rows.append(PaperRow("Table 1: multiplier vs MLA", "Qwen-2.5 72B", 4.66, kb["Qwen-2.5 72B (GQA)"] / v3, "x",
                         "327.680 / 70.272, rounded by the paper"))
    rows.append(PaperRow(
        "Table 1: multiplier vs MLA", "LLaMA-3.1 405B", 7.28, kb["LLaMA-3.1 405B (GQA)"] / v3, "x",
        "paper inconsistent with itself: its own 516.096 / 70.272 = 7.34x; 7.28 matches 512 / 70.272 = 7.286 "
        "(perhaps 516 KB was taken as 512)"))
    return rows


def _table2() -> list[PaperRow]:
    rows: list[PaperRow] = []
    entries = [("DeepSeek-V2 MoE", "deepseek-v2", 236, 155), ("DeepSeek-V3 MoE", "deepseek-v3", 671, 250),
               ("Qwen-72B Dense", "qwen2.5-72b", 72, 394), ("LLaMa-405B Dense", "llama-3.1-405b", 405, 2448)]
    for label, name, size, gflops in entries:
        arch = load_architecture(name)
        counts = count_params(arch)
        ours = flops.train_flops_per_token(arch, counts, 4096) / 1e9
        rows.append(PaperRow("Table 2: size", label, size, counts.total_params / 1e9, "B params",
                             "main model, MTP excluded" if "V3" in label else ""))
        rows.append(PaperRow("Table 2: training cost (S = 4096)", label, gflops, ours, "GFLOP/token",
                             _table2_note(label, arch, gflops, ours)))
    return rows


def _table2_note(label: str, arch: Architecture, paper: float, ours: float) -> str:
    if abs(ours / paper - 1) < 0.005:
        return "6N (with head, no embedding, no MTP) + causal attention term"
    matches = matching_conventions(arch, paper)
    if label.startswith("LLaMa"):
        v3 = load_architecture("deepseek-v3")
        half = FlopConvention(head=True, embedding=False, attention=1.5).flops(v3, count_params(v3)) / 1e9
        return (f"not our convention; matched within 0.5% only by: {'; '.join(matches) or 'none'}; "
                f"the first gives {half:.0f} for V3 (paper 250), so no single convention fits all four rows")
    qwen1 = from_hf_dict(QWEN1_72B, name="qwen-72b-v1")
    best, value = nearest_convention(arch, paper)
    best1, value1 = nearest_convention(qwen1, paper)
    return (f"not reproduced by any of {len(CONVENTIONS)} conventions (head/embedding in or out; attention term "
            f"0, half, causal, full) for Qwen2.5-72B (nearest {value:.0f}: {best}) or Qwen-72B v1 (nearest "
            f"{value1:.0f}: {best1}); even 6N alone exceeds 394; none explains it")


def _activated() -> list[PaperRow]:
    v2, v3 = count_params(load_architecture("deepseek-v2")), count_params(load_architecture("deepseek-v3"))
    return [
        PaperRow("§2.2 text: activated parameters", "DeepSeek-V2", 21, v2.active_params / 1e9, "B",
                 "incl. embedding and head; paper rounds"),
        PaperRow("§2.2 text: activated parameters", "DeepSeek-V3", 37, v3.active_params / 1e9, "B",
                 "incl. embedding and head; paper rounds"),
        PaperRow("V3 README_WEIGHTS", "DeepSeek-V3 activated (incl. 0.9B emb + 0.9B head)", 36.7,
                 v3.active_params / 1e9, "B",
                 f"unexplained gap; our activated matmul weights (head in, embedding out) are "
                 f"{v3.matmul_active / 1e9:.2f}B, close to 36.7"),
        PaperRow("V3 README_WEIGHTS", "MTP module unique parameters", 11.5, v3.mtp_total / 1e9, "B",
                 "enorm, hnorm, eh_proj, one MoE block, shared_head.norm"),
        PaperRow("V3 README_WEIGHTS", "HF checkpoint total", 685,
                 (v3.total_params + v3.mtp_total + 2 * 129280 * 7168) / 1e9, "B",
                 "671B + MTP + the embedding and head stored again under model.layers.61 (our reading)"),
    ]


def _ep_bound() -> list[PaperRow]:
    ib = bounds.ep_decode_bound(50)
    nvl = bounds.ep_decode_bound(900)
    true_hidden = bounds.ep_decode_bound(50, hidden=7168)
    g = "§2.3.2: EP decode bound"
    return [
        PaperRow(g, "comm time per micro-batch, 50 GB/s", 120.96, ib.comm_time_s * 1e6, "us",
                 "(1 + 2) B x 32 tokens x 9 experts x 7000 / 50e9; exact only with 7K = 7000, GB = 1e9"),
        PaperRow(g, "time per layer (2 micro-batches)", 241.92, ib.layer_time_s * 1e6, "us"),
        PaperRow(g, "TPOT, 61 layers, 50 GB/s", 14.76, ib.tpot_s * 1e3, "ms",
                 f"with the true hidden 7168: {true_hidden.tpot_s * 1e3:.2f} ms, {true_hidden.tps:.1f} TPS"),
        PaperRow(g, "tokens/s, 50 GB/s", 67, ib.tps, "TPS", "paper truncates 67.76 to 67"),
        PaperRow(g, "comm time per micro-batch, GB200 NVL72 900 GB/s", 6.72, nvl.comm_time_s * 1e6, "us"),
        PaperRow(g, "TPOT, 900 GB/s", 0.82, nvl.tpot_s * 1e3, "ms"),
        PaperRow(g, "tokens/s, 900 GB/s", 1200, nvl.tps, "TPS",
                 "paper: 'approximately 1200'; a pure 50/900 bandwidth rescaling (72 GPUs cannot hold "
                 "256 experts one each)"),
    ]


def _mtp() -> list[PaperRow]:
    return [
        PaperRow("§2.3.3: MTP", "TPS speed-up at 80% acceptance", 1.8, bounds.mtp_speedup(0.8), "x",
                 "1 + p tokens per step, no overhead; 90% gives 1.9x"),
        PaperRow("§2.3.3: MTP", "TPS speed-up at 85% acceptance (V3 report's lower bound)", 1.8,
                 bounds.mtp_speedup(0.85), "x",
                 "1.8x at 85% implies ~3% step overhead; ISCA says 80-90%, the V3 report 85-90%"),
    ]


def _local() -> list[PaperRow]:
    v2, v3 = load_architecture("deepseek-v2"), load_architecture("deepseek-v3")
    dense = load_architecture("qwen2.5-72b")
    rows = []
    for hw in AI_SOC:
        d = bounds.local_decode(v2, count_params(v2), HARDWARE_PRESETS[hw], "4bit", "bf16", context=0)
        rows.append(PaperRow("§2.2.2: personal use (bandwidth bound, 4-bit)", f"DeepSeek-V2 on {hw}", 20, d.tps,
                             "TPS", "paper: 'nearly 20 TPS, or even twice'; weights fit: "
                             f"{'yes' if d.fits else 'no'} ({d.model_bytes / 1e9:.0f} GB)"))
    d = bounds.local_decode(dense, count_params(dense), HARDWARE_PRESETS["m4-pro"], "4bit", "bf16", context=0)
    rows.append(PaperRow("§2.2.2: personal use (bandwidth bound, 4-bit)", "dense ~70B (Qwen2.5-72B) on m4-pro",
                         10, d.tps, "TPS", "paper: 'single-digit TPS', so the paper value is an upper limit of 10"))
    server = HARDWARE_PRESETS["rtx4090-ddr5-server"]
    d = bounds.local_decode(v3, count_params(v3), server, "4bit", "bf16", context=0)
    rows.append(PaperRow("§2.2.2: personal use (bandwidth bound, 4-bit)", "DeepSeek-V3 on RTX 4090 + DDR5 server",
                         20, d.tps, "TPS", "paper: 'nearly 20 TPS' on a ~$10k server; a bound from theoretical "
                         "DDR5 bandwidth; KTransformers measured 8.7-16.8 tok/s"))
    return rows


def _training() -> list[PaperRow]:
    h800 = HARDWARE_PRESETS["h800"]
    v3 = load_architecture("deepseek-v3")
    ours_flops = flops.train_flops_per_token(v3, count_params(v3), 4096)
    tokens, paper_hours = 14.8e12, 2.664e6
    at_250 = bounds.training_cost(tokens, 250e9, h800.bf16_tflops, 0.3894, 2.0)
    ours = bounds.training_cost(tokens, ours_flops, h800.bf16_tflops, 0.3894, 2.0)
    mfu = bounds.implied_mfu(paper_hours, tokens, 250e9, h800.bf16_tflops)
    table4_flops = 385e12 * 2048 / (272.80e9 / 86400)
    g = "V3 Table 1 / ISCA Table 4: training cost"
    return [
        PaperRow(g, "pre-training H800 GPU-hours (14.8T tokens, 250 GFLOP/token, MFU 38.94%)", 2664,
                 at_250.gpu_hours / 1e3, "K GPU-h",
                 f"peak 989 TFLOPS BF16; the MFU that gives exactly 2,664K is {100 * mfu:.2f}%"),
        PaperRow(g, "same with our 250.4 GFLOP/token", 2664, ours.gpu_hours / 1e3, "K GPU-h"),
        PaperRow(g, "pre-training cost at $2/GPU-hour", 5.328, at_250.usd / 1e6, "M$"),
        PaperRow(g, "GPU-hours per trillion tokens", 180, at_250.gpu_hours / 14.8 / 1e3, "K GPU-h"),
        PaperRow(g, "days on 2048 H800", 54.2, at_250.days_on[2048], "days",
                 "'less than two months'; 2,664K / 2048 / 24"),
        PaperRow(g, "GFLOP/token implied by Table 4 (385 TFLOPS causal, 2048 GPUs, 272.80B tokens/day)", 250,
                 table4_flops / 1e9, "GFLOP/token", "independent check of Table 2's V3 row"),
    ]


def paper_rows() -> list[PaperRow]:
    """All comparisons, in the paper's order."""
    return [*_table1(), *_table2(), *_activated(), *_ep_bound(), *_mtp(), *_local(), *_training()]
