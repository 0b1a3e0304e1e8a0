"""Decode speed on a CPU, the decode figures of docs/inference.md in one run (earlier runs:
benchmarks/results/decode_speed.json): dsv3 (fast path and module path; fp32, bf16 and FP8 weights)
against transformers' DeepseekV3ForCausalLM and, when ``llama-cpp-python`` is installed, llama.cpp on the
same checkpoint (converted by llama.cpp's own ``convert_hf_to_gguf.py``), each with its fraction of the memory roofline.
dsv3's integer expert weights (``int8``, ``int4``) run beside llama.cpp's Q8_0 (written by the converter) and
Q4_0 (written from the f32 GGUF by ``llama-quantize``, ``--llama-quantize``).

    .venv/bin/python benchmarks/decode_speed.py --json > decode_speed.json

The model is the ``small`` preset shape with random weights (speed does not depend on their values),
saved once and loaded by every implementation; ``--preset large`` is the benchmark's own larger shape (``SHAPES``:
2.7 GB of weights in fp32, several times this host's last-level cache, so the routed experts a step reads come
from DRAM; its read bandwidth is then best probed past the cache, ``--probe-mb 2048``), and ``--skip
transformers,module`` leaves out the slow reference rows there. Each implementation prefills each context once and then
decodes greedily; the timed decode steps of all implementations alternate in rounds (``--repeats``), so
that machine load hits them alike, and each figure is the median over rounds of the mean step time.

Roofline: the bytes one decode step must read (the weights a token touches: attention, dense and shared
FFNs, the top-k routed experts, router and head, in the implementation's own storage format, or as the copy a
step reads instead: an FP8 model's ``kv_b_proj`` in the compute dtype, ``read_as_copies``; plus the latent cache
at that context) divided by the read bandwidth measured here with torch (``x.sum()`` over
256 MB at the start and 128 MB after every round; the best value seen in the run).
``roofline_fraction`` = that time / the measured time per token (1.0 = at the memory limit).

Each ``batch1`` row also has ``goals``: FP8 over bf16 tokens/s beside the most its bytes allow (bf16's bytes per
step over FP8's) and the fraction of that bound reached, and dsv3's rows over llama.cpp's at the same width.

Sections: ``batch1`` (contexts x threads x implementations), ``batch`` (output tokens/s at batch 16 vs
batch 1, context 1024), ``mtp`` (a speculative step's cost next to a plain one), ``overhead`` (tiny
shapes vs transformers at context 2048: the fixed per-token cost), ``weights`` (resident bytes),
``cache_precision``; ``kernels`` says whether the C kernels ran, ``bf16_dots`` whether a bf16
model's attention took AVX512-BF16 dot products, ``amx`` whether it and the bf16 GEMVs took AMX tiles.
llama.cpp: ``bash benchmarks/llama_cpp_setup.sh`` builds it (a few minutes) and ``--env`` prints the
environment that points the bindings, ``gguf`` and ``--llama-convert`` at it. Without them the llama.cpp
rows are left out and the run says why.

``--avx2`` measures what a CPU without AVX-512 gets (a hypervisor may hide it): dsv3's kernels on their AVX2
paths (``int_weights.avx512(False)``, no bf16 dot products, no AMX), beside llama.cpp built without AVX-512
(``bash benchmarks/llama_cpp_setup.sh --avx2``, then its ``--avx2 --env``); the run refuses a llama.cpp
whose system info reports AVX-512, and records that line (``llama_cpp_system_info``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from decode_step_ab import TURN_PAUSE_S, TURN_WARM_UP, avx2_only  # the same turns and switches in both
from dsv3.config import preset
from dsv3.errors import DSV3Error
from dsv3.infer.bench import cache_precision
from dsv3.infer.engine import Engine, Request
from dsv3.infer.fp8_weights import resident_bytes
from dsv3.infer.loading import load_model
from dsv3.kernels.decode_kernels import amx, bf16_dots, kernel_status
from dsv3.model import Transformer, huge_pages
from dsv3.model.mla import MLA
from dsv3.option_lists import parse_list
from dsv3.precision.fp8_linear import FP8BlockLinear


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the roofline ---------------------------------------------------------------------------------


def read_bandwidth(threads: int, mbytes: int = 256, repeats: int = 7) -> float:
    """Bytes/s of a streaming read with ``threads`` torch threads (best of ``repeats``), on huge pages where
    the system gives them, as the engine's weights and cache are (on the 2-core test host it reads 31-36%
    faster there)."""
    torch.set_num_threads(threads)
    x = huge_pages.clone(torch.ones(mbytes * 2**20 // 4))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best


def fma_rate(threads: int, n: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Multiply-adds per second of a matmul (n x n by n x n, best of ``repeats``) with ``threads`` torch
    threads: what this CPU reaches in practice, in fp32 FMAs (the decode kernels' GEMVs compute in fp32
    whatever the weights' format) or, ``dtype`` bf16, in its bf16 dot products where it has them (the
    attention of a bf16 model over a bf16 cache, ``decode_kernels.bf16_dots``)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return n**3 / best


def fmas_per_token(model: Transformer, context: int) -> tuple[int, int]:
    """Multiply-adds one decoded token costs: (the weights', the attention's). Each weight it touches once
    (the main layers, the top-k routed experts of each MoE layer, the router, the head); the absorbed
    attention over ``context`` cached tokens (per head and key: the latent and RoPE scores, then the latent
    weighted into the output)."""
    cfg = model.config
    share = cfg.num_experts_per_tok / cfg.n_routed_experts
    tensors = lambda m: [*m.parameters(), *m.buffers()]  # noqa: E731
    routed = {id(t) for moe in model.moe_layers() for t in tensors(moe.experts)}
    skip = {id(t) for layer in model.mtp_layers for t in tensors(layer)} | {id(model.model.embed_tokens.weight)}
    weights = sum(int(t.numel() * (share if id(t) in routed else 1)) for t in model.parameters() if id(t) not in skip
                  and t.dim() > 1)
    per_key = cfg.num_attention_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return weights, cfg.num_hidden_layers * context * per_key


def routed_share(cfg, tokens: int) -> float:
    """Expected share of a layer's routed experts that ``tokens`` tokens touch (each picks top-k of E, taken
    as independent and uniform, which the aux-loss-free balancing aims at): 1 - (1 - k/E)^tokens."""
    return 1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** tokens


def read_as_copies(model: Transformer) -> dict[int, int]:
    """Bytes per step of the tensors a decode step reads as a copy in another format, by the stored tensor's id:
    an FP8 ``kv_b_proj`` is used as per-head matrices (W_UK, W_UV), dequantized once into a copy of the compute
    dtype that the attention reads every step (``dsv3.kernels.decode.AttentionPlan``), so the step reads that
    copy's bytes, not the FP8 blocks and their scales."""
    copies = {}
    for m in model.modules():
        if isinstance(m, MLA) and type(m.kv_b_proj) is FP8BlockLinear:
            lin = m.kv_b_proj
            copies[id(lin.weight_fp8)] = lin.weight_fp8.numel() * torch.empty((), dtype=lin.dtype).element_size()
            copies[id(lin.weight_scale_inv)] = 0
    return copies


def weight_bytes_per_token(model: Transformer, tokens: int = 1, mtp: bool = False) -> int:
    """Bytes of the weights one decode step over ``tokens`` tokens reads, as stored (or as the copy the step
    reads instead, ``read_as_copies``): every tensor of the main layers, final norm and head once, the routed
    experts' at ``routed_share`` of their size, one embedding row per token. ``mtp``: the MTP layer's forward
    instead (its block, projections and the shared head)."""
    share = routed_share(model.config, tokens)
    copies = read_as_copies(model)
    tensors = lambda m: [*m.parameters(), *m.buffers()]  # noqa: E731
    routed = {id(t) for moe in model.moe_layers() for t in tensors(moe.experts)}
    in_mtp = {id(t) for layer in model.mtp_layers for t in tensors(layer)}
    skip = {id(model.model.embed_tokens.weight), id(model.inv_freq)} | {id(m.expert_load) for m in model.moe_layers()}
    if mtp:  # the MTP layer, then the main model's head (shared)
        members = [t for layer in model.mtp_layers for t in tensors(layer)] + list(tensors(model.lm_head))
    else:
        members = [t for t in tensors(model) if id(t) not in in_mtp]
    total, seen = model.model.embed_tokens.weight[0].nbytes * tokens, set()
    for t in members:
        if id(t) not in skip and id(t) not in seen:
            seen.add(id(t))
            total += int(copies.get(id(t), t.nbytes) * (share if id(t) in routed else 1))
    return total


def cache_bytes_per_token(cfg, context: int, element_bytes: int) -> int:
    return context * cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * element_bytes


# ---- implementations: each prefills once, then decodes n steps per call ---------------------------


class Dsv3:
    def __init__(self, model: Transformer, fast: bool, speculative: bool = False):
        self.engine = Engine(model, eos_token_ids=frozenset(), fast=fast, speculative=speculative)
        self.weight_bytes = weight_bytes_per_token(model)
        self.cache_element = self.engine.cache_dtype.itemsize

    def start(self, prompts: list[list[int]], steps: int) -> None:
        with torch.inference_mode():
            self.batch = self.engine.start([Request(p, steps + 2) for p in prompts])
        self.first, self.tokens = self.batch.rows[0].request, []

    def decode(self, n: int) -> float:
        """Seconds per step over n steps."""
        with torch.inference_mode():
            t0 = time.perf_counter()
            events = [self.batch.step() for _ in range(n)]
            seconds = (time.perf_counter() - t0) / n
        self.tokens += [t for step in events for ev in step if ev.request is self.first for t in ev.token_ids]
        return seconds


class HF:
    def __init__(self, folder: str):
        import transformers

        transformers.logging.set_verbosity_error()  # the MTP layer's tensors are "unexpected" to it
        self.model = transformers.DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.weight_bytes = None  # same fp32 weights as dsv3 fp32: filled in by the caller
        self.cache_element = 4

    @torch.inference_mode()
    def start(self, prompts: list[list[int]], steps: int) -> None:
        out = self.model(torch.tensor(prompts), use_cache=True)
        self.cache, self.token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        self.tokens = []

    @torch.inference_mode()
    def decode(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            out = self.model(self.token, cache=self.cache, use_cache=True)
            self.cache, self.token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            self.tokens.append(int(self.token[0, 0]))
        return (time.perf_counter() - t0) / n


class LlamaCpp:
    """llama.cpp through llama-cpp-python, greedy, its fastest attention setting (flash attention on).
    ``repack=False`` loads without the CPU's extra buffer types (llama-bench's ``--repack 0``): llama.cpp 0.3.36
    aborts on quantized deepseek2 GGUFs when it repacks their weights (``ggml_backend_sched_split_graph``)."""

    def __init__(self, gguf: Path, threads: int, context: int, weight_bytes: int, repack: bool = True,
                 logits_all: bool = False):
        import llama_cpp.llama_cpp as bindings  # the module Llama reads its default parameters from
        from llama_cpp import Llama

        defaults = bindings.llama_model_default_params
        if not repack:
            def no_repack():
                params = defaults()
                params.use_extra_bufts = False
                return params

            bindings.llama_model_default_params = no_repack
        try:
            self.llm = Llama(str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512,
                             flash_attn=True, verbose=False, logits_all=logits_all)
        finally:
            bindings.llama_model_default_params = defaults
        self.repack = repack
        self.weight_bytes = weight_bytes
        self.cache_element = 2  # llama.cpp's default f16 KV cache

    def start(self, prompts: list[list[int]], steps: int) -> None:
        self.llm.reset()
        self.llm.eval(prompts[0])
        self.token = self._greedy()
        self.tokens = []

    def _greedy(self) -> int:
        """argmax of the last evaluated token's logits, read through the public C binding
        (``llama_get_logits_ith(ctx, -1)``): llama-cpp-python keeps no copy of them without logits_all."""
        import llama_cpp

        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),))))

    def decode(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.llm.eval([self.token])
            self.token = self._greedy()
            self.tokens.append(self.token)
        return (time.perf_counter() - t0) / n


# llama.cpp's converter as a user runs it, with one change: it refuses a BPE vocabulary it does not know by the
# hash of a sample's token ids (it recognises published models' tokenizers only), so the pre-tokenizer is
# declared "gpt-2" (byte-level, like dsv3's). That label only steers llama.cpp's own text tokenization; the
# benchmark feeds token ids, and every weight is converted by the converter's own code.
CONVERT = """
import runpy, sys
from pathlib import Path
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(sys.argv[0]).parent))
try:
    from conversion.base import TextModel
except ImportError:  # an older llama.cpp keeps every class in the script itself
    TextModel = None
if TextModel is not None:
    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gguf_files(folder: str, converter: str | None, out: Path, quantizer: str | None = None) -> dict[str, Path]:
    """f32, bf16 and q8_0 GGUF files of the checkpoint by llama.cpp's own converter, and q4_0 by its
    ``llama-quantize`` from the f32 one, or {} when llama.cpp is not usable here (the reason is logged)."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        log(f"llama.cpp rows left out: {exc} (pip install llama-cpp-python gguf)")
        return {}
    if not converter or not Path(converter).is_file():
        log("llama.cpp rows left out: pass --llama-convert PATH/convert_hf_to_gguf.py")
        return {}
    files = {}
    for outtype in ("f32", "bf16", "q8_0"):
        target = out / f"model-{outtype}.gguf"
        argv = [converter, folder, "--outfile", str(target), "--outtype", outtype]
        done = subprocess.run([sys.executable, "-c", CONVERT, *argv], capture_output=True, text=True)
        if done.returncode != 0:
            log(f"llama.cpp {outtype} conversion failed: {done.stderr.strip()[-400:]}")
            continue
        files[outtype] = target
    if "f32" in files and quantizer and Path(quantizer).is_file():
        target = out / "model-q4_0.gguf"
        done = subprocess.run([quantizer, str(files["f32"]), str(target), "Q4_0"], capture_output=True, text=True)
        if done.returncode == 0:
            files["q4_0"] = target
        else:
            log(f"llama-quantize Q4_0 failed: {done.stderr.strip()[-400:]}")
    elif "f32" in files:
        log("llama.cpp q4_0 row left out: pass --llama-quantize PATH/llama-quantize")
    return files


REPACK_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=64, n_threads=1, flash_attn=True, verbose=False)
llm.eval([1, 2, 3])
llm.eval([4])
"""


def repack_runs(gguf: Path) -> bool:
    """Whether llama.cpp runs this GGUF with its weights repacked for the CPU (its default), tried in a process of
    its own: where it aborts, the rows load it with ``repack=False``."""
    done = subprocess.run([sys.executable, "-c", REPACK_PROBE, str(gguf)], capture_output=True, text=True)
    if done.returncode != 0:
        failed = [line for line in done.stderr.splitlines() if "GGML_ASSERT" in line or "error" in line.lower()]
        log(f"llama.cpp fails on {gguf.name} repacked ({(failed or [f'exit status {done.returncode}'])[-1]}); "
            "running it with repack off")
    return done.returncode == 0


# ---- the checkpoint -------------------------------------------------------------------------------

# The benchmark's own shapes beside the config presets. "large": small's design (MLA with a compressed query,
# 1 dense layer then DeepSeekMoE with 4 groups, top 4, one shared expert) at twice the width and twice the
# experts: 2.7 GB in fp32 (1.4 GB bf16, 0.45 GB int4), most of it routed experts, so that the experts a step
# reads are not the last step's and come from DRAM rather than from a cache of a few hundred MB.
SHAPES = {"large": dict(vocab_size=16384, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512,
                        num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
                        kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=64,
                        n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                        num_nextn_predict_layers=1, routed_scaling_factor=2.5)}


def shape(name: str):
    """A config preset, or one of ``SHAPES`` (the preset ``small`` with these fields)."""
    return preset("small").replace(**SHAPES[name]) if name in SHAPES else preset(name)



def build_checkpoint(folder: str, cfg, tokenizer: bool) -> None:
    torch.manual_seed(0)
    Transformer(cfg).save_pretrained(folder)
    if tokenizer:  # llama.cpp's converter reads the vocabulary from the checkpoint's tokenizer
        import sysconfig

        from dsv3.data.tokenizer import _train_bpe, save_tokenizer_files

        texts = [p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))]
        save_tokenizer_files(_train_bpe(texts, cfg.vocab_size), Path(folder), cfg.max_position_embeddings)


def prompt_of(context: int, vocab: int, batch: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(context)
    return [torch.randint(1, vocab, (context,), generator=g).tolist() for _ in range(batch)]


# ---- the measurements -----------------------------------------------------------------------------


def figure(seconds: float, weight_bytes: int, cache_bytes: int, threads: int, batch: int = 1) -> dict:
    """One measurement; its roofline fraction is added at the end (``add_roofline``), against the best
    read bandwidth seen during the whole run."""
    return {"ms_per_step": 1000 * seconds, "tokens_per_s": batch / seconds,
            "bytes_per_step": weight_bytes + cache_bytes * batch, "threads": threads}


def add_roofline(node, bandwidth: dict[int, float]) -> None:
    """roofline_fraction = (bytes per step / read bandwidth) / time per step, for every figure in ``node``."""
    if isinstance(node, dict):
        if "bytes_per_step" in node:
            seconds = node["ms_per_step"] / 1000
            node["roofline_fraction"] = node["bytes_per_step"] / bandwidth[node["threads"]] / seconds
        for value in node.values():
            add_roofline(value, bandwidth)
    elif isinstance(node, list):
        for value in node:
            add_roofline(value, bandwidth)


def decoded_tokens(steps: int, repeats: int) -> int:
    """The tokens ``race`` decodes per row: every turn's untimed and timed steps, warm-up round included."""
    return (steps + TURN_WARM_UP) * (repeats + 1)


def race(impls: dict, prompts: list[list[int]] | dict[str, list[list[int]]], steps: int, repeats: int,
         bandwidth: dict[int, float], probe_mb: int = 128) -> dict[str, float]:
    """Median seconds per step of each implementation, their decode rounds alternating (so that the host's
    drift from minute to minute, often a third on a shared machine, hits them alike); ``prompts`` the same for
    all or one list per implementation. Each turn starts after a pause and with untimed steps: llama.cpp's
    OpenMP threads and torch's are two pools, and the side that had just run keeps spinning on the cores for a
    while (libgomp's wait before its threads sleep), which can slow the first steps of the next turn
    (decode_step_ab.py found it between two torch processes). The read bandwidth is measured again after
    every round over ``probe_mb`` MB (its best value is the roofline's: load only lowers it)."""
    for name, impl in impls.items():
        mine = prompts[name] if isinstance(prompts, dict) else prompts
        log(f"  prefill {name} ({len(mine)} x {len(mine[0])} tokens)")
        impl.start(mine, decoded_tokens(steps, repeats))
    times = {name: [] for name in impls}
    for rep in range(repeats + 1):
        for name, impl in impls.items():
            time.sleep(TURN_PAUSE_S)
            impl.decode(TURN_WARM_UP)
            t = impl.decode(steps)
            if rep:  # round 0 warms up
                times[name].append(t)
        threads = torch.get_num_threads()
        bandwidth[threads] = max(bandwidth.get(threads, 0.0), read_bandwidth(threads, mbytes=probe_mb, repeats=2))
    return {name: statistics.median(ts) for name, ts in times.items()}


def agreement(tokens: list[int], reference: list[int]) -> str:
    """How many of the greedy tokens (every decoded step of the run) equal the reference's before the first
    difference: "48/48" when all do. Random weights give nearly flat logits, so a low-precision format may
    legitimately part ways after a few tokens; fp32 implementations should agree throughout."""
    n = min(len(tokens), len(reference))
    same = next((i for i in range(n) if tokens[i] != reference[i]), n)
    return f"{same}/{n}"


def batch1_section(folder, cfg, args, ggufs, bandwidth) -> list[dict]:
    models = {"fp32": load_model(folder, torch.float32), "bf16": load_model(folder, torch.bfloat16),
              "fp8": load_model(folder, torch.bfloat16, "fp8"), "int8": load_model(folder, torch.bfloat16, "int8"),
              "int4": load_model(folder, torch.bfloat16, "int4")}
    repack = {outtype: repack_runs(path) for outtype, path in ggufs.items()}
    ours = {"f32": "dsv3 fp32", "bf16": "dsv3 bf16", "q8_0": "dsv3 int8", "q4_0": "dsv3 int4"}
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for ctx in args.contexts:
            impls = {f"dsv3 {name}": Dsv3(model, fast=True) for name, model in models.items()}
            if "module" not in args.skip:
                impls["dsv3 fp32 module path"] = Dsv3(models["fp32"], fast=False)
            if "transformers" not in args.skip:
                hf = HF(folder)
                hf.weight_bytes = impls["dsv3 fp32"].weight_bytes
                impls["transformers fp32"] = hf
            for outtype, path in ggufs.items():  # the roofline of the row it stands beside
                dense = impls[ours[outtype]].weight_bytes
                context = ctx + decoded_tokens(args.new_tokens, args.repeats) + 8
                impls[f"llama.cpp {outtype}"] = LlamaCpp(path, threads, context, dense, repack[outtype])
            log(f"threads {threads}, context {ctx}")
            secs = race(impls, prompt_of(ctx, cfg.vocab_size), args.new_tokens, args.repeats, bandwidth,
                        args.probe_mb // 2)
            row = {"threads": threads, "context": ctx}
            reference = impls.get("dsv3 fp32 module path", impls["dsv3 fp32"])
            for name, s in secs.items():
                impl = impls[name]
                row[name] = figure(s, impl.weight_bytes, cache_bytes_per_token(cfg, ctx, impl.cache_element), threads)
                row[name]["greedy_agree"] = agreement(impl.tokens, reference.tokens)
                if isinstance(impl, LlamaCpp):
                    row[name]["repacked"] = impl.repack
                log(f"  {name}: {row[name]['tokens_per_s']:.1f} tokens/s")
            row["goals"] = goals(row, ours)
            log(f"  goals: {row['goals']}")
            rows.append(row)
    return rows


def goals(row: dict, ours: dict[str, str]) -> dict:
    """The issue's batch-1 ratios of one row: FP8 over bf16 tokens/s, the most the bytes allow (bf16's bytes per
    step over FP8's, cache included) and the fraction of it reached; each dsv3 row over llama.cpp's of the same
    width (f32, bf16, Q8_0 vs int8, Q4_0 vs int4)."""
    fp8, bf16 = row["dsv3 fp8"], row["dsv3 bf16"]
    speedup, bound = fp8["tokens_per_s"] / bf16["tokens_per_s"], bf16["bytes_per_step"] / fp8["bytes_per_step"]
    out = {"fp8_over_bf16": speedup, "fp8_over_bf16_byte_bound": bound, "fp8_over_bf16_of_bound": speedup / bound}
    for outtype, name in ours.items():
        if f"llama.cpp {outtype}" in row:
            peer = row[f"llama.cpp {outtype}"]
            out[f"{name} over llama.cpp {outtype}"] = row[name]["tokens_per_s"] / peer["tokens_per_s"]
    return out


def batch_section(folder, cfg, args, bandwidth) -> list[dict]:
    """Output tokens/s at batch 16 vs batch 1 (same context): the weights are read once per step."""
    out = []
    threads = max(args.threads)
    torch.set_num_threads(threads)
    for name in args.batch_weights:
        model = load_model(folder, {"fp32": torch.float32, "bf16": torch.bfloat16}[name])
        row = {"weights": name, "context": args.batch_context, "threads": threads}
        sizes = {f"batch {b}": b for b in (1, args.batch)}
        impls = {key: Dsv3(model, fast=True) for key in sizes}
        prompts = {key: prompt_of(args.batch_context, cfg.vocab_size, b) for key, b in sizes.items()}
        secs = race(impls, prompts, args.new_tokens, args.repeats, bandwidth)  # rounds alternate: one drift
        for key, b in sizes.items():
            cache = cache_bytes_per_token(cfg, args.batch_context, impls[key].cache_element)
            row[key] = figure(secs[key], impls[key].weight_bytes, cache, threads, b)
        one, many = row["batch 1"], row[f"batch {args.batch}"]
        many["bytes_per_step"] = weight_bytes_per_token(model, args.batch) + cache * args.batch  # most experts
        row["batch_over_1"] = many["tokens_per_s"] / one["tokens_per_s"]
        # the most the ratio can be when both read at the same bandwidth: batch x bytes(1) / bytes(batch)
        row["bound_over_1"] = args.batch * one["bytes_per_step"] / many["bytes_per_step"]
        # ... and when each step also takes at least its multiply-adds: the weights' at the fp32 FMAs' rate, the
        # attention's at the rate of the arithmetic it runs in
        (w_fmas, att_fmas), rate, bw = fmas_per_token(model, args.batch_context), fma_rate(threads), bandwidth[threads]
        dots = name == "bf16" and bf16_dots()
        att_rate = fma_rate(threads, dtype=torch.bfloat16) if dots else rate
        seconds = w_fmas / rate + att_fmas / att_rate  # per token
        least = {b: max(step["bytes_per_step"] / bw, b * seconds) for b, step in ((1, one), (args.batch, many))}
        row["fmas_per_token"], row["fma_rate_per_s"] = w_fmas + att_fmas, rate
        row["attention_fmas_per_token"], row["attention_rate_per_s"] = att_fmas, att_rate
        row["compute_bound_over_1"] = args.batch * least[1] / least[args.batch]
        log(f"batch {args.batch} / batch 1, {name}: {row['batch_over_1']:.2f}x (bytes allow "
            f"{row['bound_over_1']:.2f}x, bytes and multiply-adds {row['compute_bound_over_1']:.2f}x)")
        out.append(row)
    return out


def mtp_section(folder, cfg, args, bandwidth) -> dict:
    """What one speculative step (a 2-token verify plus the MTP layer's draft) costs next to a plain step, at
    batch 1 on the fast path; with acceptance a, MTP gives (1 + a) / cost tokens per plain step's time.
    Random weights: the acceptance itself needs a trained model (benchmarks/mtp_speedup.py)."""
    torch.set_num_threads(max(args.threads))
    model = load_model(folder, torch.float32)
    impls = {"plain": Dsv3(model, fast=True), "mtp": Dsv3(model, fast=True, speculative=True)}
    secs = race(impls, prompt_of(256, cfg.vocab_size), args.new_tokens, args.repeats, bandwidth)
    cost = secs["mtp"] / secs["plain"]
    log(f"MTP step / plain step: {cost:.2f}")
    return {"context": 256, "threads": max(args.threads), "plain_ms_per_step": 1000 * secs["plain"],
            "mtp_ms_per_step": 1000 * secs["mtp"], "step_cost_ratio": cost,
            "speedup_at_acceptance": {str(a): (1 + a) / cost for a in (0.7, 0.8, 0.9)},
            "byte_bound": {str(a): mtp_byte_bound(model, a) for a in (0.7, 0.8, 0.9)}}


def mtp_byte_bound(model: Transformer, acceptance: float, draft_vocab: int | None = None) -> dict:
    """What the weights a speculative step reads allow: its bytes over a plain step's, and the wall-clock
    speedup (1 + a) / that ratio if both steps ran at the same bandwidth. A speculative step is a 2-token
    verify (more routed experts touched) plus the MTP layer over the 1 or 2 committed tokens and the
    shared head a second time (vocab x hidden), or only ``draft_vocab`` K of its rows (``--draft-vocab``)."""
    plain = weight_bytes_per_token(model)
    head = model.lm_head.weight.nbytes
    saved = 0 if draft_vocab is None else head * (1 - draft_vocab / model.config.vocab_size)
    mtp = (1 - acceptance) * weight_bytes_per_token(model, 1, mtp=True) + acceptance * weight_bytes_per_token(
        model, 2, mtp=True) - saved
    ratio = (weight_bytes_per_token(model, 2) + mtp) / plain
    return {"step_bytes_ratio": ratio, "speedup": (1 + acceptance) / ratio}


def overhead_section(args, bandwidth) -> list[dict]:
    """Tiny shapes at context 2048, fp32, 1 thread: fixed per-token cost against transformers."""
    torch.set_num_threads(1)
    rows = []
    for name, overrides in (("nano", {}), ("4 layers, hidden 256", {"hidden_size": 256})):
        cfg = preset("nano").replace(max_position_embeddings=4096, **overrides)
        with tempfile.TemporaryDirectory() as folder:
            build_checkpoint(folder, cfg, tokenizer=False)
            impls = {"dsv3": Dsv3(load_model(folder, torch.float32), fast=True), "transformers": HF(folder)}
            impls["transformers"].weight_bytes = impls["dsv3"].weight_bytes
            secs = race(impls, prompt_of(2048, cfg.vocab_size), args.new_tokens, args.repeats, bandwidth)
        row = {"shape": name, "context": 2048}
        for k, s in secs.items():
            row[k] = figure(s, impls[k].weight_bytes, cache_bytes_per_token(cfg, 2048, 4), 1)
        row["speedup"] = secs["transformers"] / secs["dsv3"]
        log(f"overhead {name}: {row['speedup']:.2f}x transformers")
        rows.append(row)
    return rows


SECTIONS = ("batch1", "batch", "mtp", "overhead", "weights", "cache")


def llama_system_info() -> str | None:
    """llama.cpp's own line of the instruction sets its build uses (None without its bindings, or when they
    cannot find their library)."""
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError):
        return None
    return llama_cpp.llama_print_system_info().decode().strip()


def avx2_paths() -> None:
    """dsv3's kernels on their AVX2 paths for this process, and a llama.cpp built without AVX-512 (its bindings
    absent is fine: its rows are then left out and the run says why)."""
    if kernel_status() != "ok":
        raise DSV3Error(f"--avx2 measures the C kernels, which do not run here: {kernel_status()}")
    avx2_only()
    info = llama_system_info()
    if info is not None and "AVX512 = 1" in info:
        raise DSV3Error("--avx2: this llama.cpp was built with AVX-512; build one without it (bash "
                        "benchmarks/llama_cpp_setup.sh --avx2) and load it (eval \"$(bash "
                        "benchmarks/llama_cpp_setup.sh --avx2 --env)\")")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", help=f"a config preset or one of {', '.join(SHAPES)}")
    ap.add_argument("--probe-mb", type=int, default=256, help="MB the read-bandwidth probe streams")
    ap.add_argument("--skip", default="", help="leave out batch-1 rows: transformers, module (the module path)")
    ap.add_argument("--contexts", default="256,2048,4096")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--new-tokens", type=int, default=16, help="decode steps per round")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batch-context", type=int, default=1024)
    ap.add_argument("--batch-weights", default="fp32,bf16")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"some of {','.join(SECTIONS)}")
    ap.add_argument("--llama-convert", default=os.environ.get("DSV3_LLAMA_CONVERT"), metavar="PATH",
                    help="llama.cpp's convert_hf_to_gguf.py (default: $DSV3_LLAMA_CONVERT, which "
                    "benchmarks/llama_cpp_setup.sh --env sets)")
    ap.add_argument("--llama-quantize", default=os.environ.get("DSV3_LLAMA_QUANTIZE"), metavar="PATH",
                    help="llama.cpp's llama-quantize, for the Q4_0 row (default: $DSV3_LLAMA_QUANTIZE)")
    ap.add_argument("--avx2", action="store_true",
                    help="dsv3's kernels on their AVX2 paths, beside llama.cpp built without AVX-512 (as on a CPU "
                    "without it)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        if args.avx2:
            avx2_paths()
        args.contexts = parse_list(args.contexts, "--contexts", int)
        args.threads = parse_list(args.threads, "--threads", int)
        args.batch_weights = parse_list(args.batch_weights, "--batch-weights")
        args.skip = set(parse_list(args.skip, "--skip")) if args.skip else set()
        if not args.skip <= {"transformers", "module"}:
            raise DSV3Error(f"--skip must list some of transformers,module, got {','.join(sorted(args.skip))!r}")
        if args.preset not in SHAPES:
            preset(args.preset)
        sections = set(parse_list(args.sections, "--sections"))
        if not sections <= set(SECTIONS):
            raise DSV3Error(f"--sections must list some of {','.join(SECTIONS)}, got {args.sections!r}")
    except DSV3Error as exc:
        ap.error(str(exc))
    bandwidth = {t: read_bandwidth(t, args.probe_mb) for t in sorted({1, *args.threads})}
    log("read bandwidth: " + ", ".join(f"{t} thread(s) {b / 1e9:.1f} GB/s" for t, b in bandwidth.items()))
    longest = max([*args.contexts, args.batch_context]) + decoded_tokens(args.new_tokens, args.repeats) + 16
    cfg = shape(args.preset).replace(max_position_embeddings=longest)
    result = {"benchmark": "decode_speed", "preset": args.preset, "probe_mb": args.probe_mb, "kernels": kernel_status(),
              "bf16_dots": bf16_dots(), "amx": amx(), "simd": "avx2" if args.avx2 else "native",
              "llama_cpp_system_info": llama_system_info(),
              "new_tokens": args.new_tokens, "repeats": args.repeats,
              "read_bandwidth_gb_s": {t: b / 1e9 for t, b in bandwidth.items()}}
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as gguf_dir:
        ggufs = {}
        want_llama = args.llama_convert is not None and "batch1" in sections
        build_checkpoint(folder, cfg, tokenizer=want_llama)
        if want_llama:
            ggufs = gguf_files(folder, args.llama_convert, Path(gguf_dir), args.llama_quantize)
        result["llama_cpp"] = sorted(ggufs) or None
        if "batch1" in sections:
            result["batch1"] = batch1_section(folder, cfg, args, ggufs, bandwidth)
        if "batch" in sections:
            result["batch"] = batch_section(folder, cfg, args, bandwidth)
        if "mtp" in sections:
            result["mtp"] = mtp_section(folder, cfg, args, bandwidth)
        if "weights" in sections:
            result["weights"] = {name: resident_bytes(load_model(folder, dt, w)) for name, dt, w in (
                ("fp32", torch.float32, "native"), ("bf16", torch.bfloat16, "native"), ("fp8", torch.bfloat16, "fp8"),
                ("int8", torch.bfloat16, "int8"), ("int4", torch.bfloat16, "int4"))}
        if "cache" in sections:
            result["cache_precision"] = cache_precision(load_model(folder, torch.float32))
    if "overhead" in sections:
        result["overhead"] = overhead_section(args, bandwidth)
    add_roofline(result, bandwidth)
    result["read_bandwidth_gb_s"] = {t: b / 1e9 for t, b in bandwidth.items()}  # the best seen in the run
    print(json.dumps(result) if args.json else report(result))


def report(result: dict) -> str:
    """The tables of docs/inference.md, as text."""
    dots = "AMX tiles" if result.get("amx") else "AVX512-BF16 dots" if result.get("bf16_dots") else "fp32 FMAs"
    simd = "; AVX2 paths only (--avx2)" if result.get("simd") == "avx2" else ""
    lines = [f"kernels: {result['kernels']}; bf16 attention: {dots}{simd}; "
             f"read bandwidth (GB/s): {result['read_bandwidth_gb_s']}"]
    for row in result.get("batch1", []):
        lines.append(f"threads {row['threads']}, context {row['context']}:")
        for name, f in row.items():
            if isinstance(f, dict) and "tokens_per_s" in f:
                lines.append(f"  {name:22} {f['tokens_per_s']:7.1f} tokens/s  roofline {f['roofline_fraction']:.2f}"
                             f"  greedy {f['greedy_agree']}")
    for row in result.get("batch", []):
        lines.append(f"batch {row['weights']}: {row['batch_over_1']:.2f}x batch 1 at context {row['context']} "
                     f"(bytes allow {row['bound_over_1']:.2f}x, bytes and multiply-adds "
                     f"{row['compute_bound_over_1']:.2f}x)")
    if "mtp" in result:
        bound = result["mtp"]["byte_bound"]["0.7"]
        lines.append(f"MTP step costs {result['mtp']['step_cost_ratio']:.2f} plain steps (its bytes: "
                     f"{bound['step_bytes_ratio']:.2f}; at 70% acceptance at most {bound['speedup']:.2f}x)")
    for row in result.get("overhead", []):
        lines.append(f"overhead {row['shape']}: dsv3 {row['speedup']:.2f}x transformers at context 2048")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
