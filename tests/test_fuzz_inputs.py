"""Fuzzing the inputs every command reads: mutated config.json files and corrupted checkpoints.

Seeded, so a failure reproduces. Each case runs through the entry points the CLI uses (config parsing,
``load_pretrained``, ``dsv3.cli.main``; one real ``dsv3`` process) and may only end in success or a
DSV3Error (exit status 2 with one ``error:`` line): never another exception, a traceback or a hang. A
per-case alarm turns a hang in Python code into a failure; the subprocess cases have a timeout.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv3 import load_pretrained
from dsv3.cli import main
from dsv3.config import ModelConfig
from dsv3.errors import DSV3Error
from dsv3.model import Transformer

SEED = 16
CASE_SECONDS = 5
CFG = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  rope_scaling=dict(factor=4.0, original_max_position_embeddings=16), torch_dtype="float32").validate()
ODD_VALUES = [None, -1, 0, 1, 2, 3, 2.0, 0.5, -0.5, 2**31, 2**63, 10**12, float("inf"), float("nan"), True, False,
              "4", "", "yarn", [], [1, 2], [None], {}, {"type": "yarn"}, {"factor": "x"}, {"rope_type": "llama3"}]


@contextlib.contextmanager
def time_bound(seconds: float = CASE_SECONDS):
    """Raise instead of hanging (in Python code) and fail a case that took too long."""
    def expire(*_):
        raise TimeoutError(f"case ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - start < seconds


def mutated_config(rng: random.Random, base: dict) -> dict:
    """1-3 fields dropped, nulled or replaced by a value of the wrong type, sign or size."""
    data = copy.deepcopy(base)
    keys = sorted(set(base) | {"rope_parameters", "num_mtp_layers", "rope_interleave", "mlp_bias",
                               "quantization_config"})
    for key in rng.sample(keys, rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.2:
            data.pop(key, None)
        elif kind < 0.3 and isinstance(data.get(key), dict) and data[key]:
            inner = rng.choice(sorted(data[key]))
            data[key][inner] = rng.choice(ODD_VALUES)
        else:
            data[key] = rng.choice(ODD_VALUES)
    if rng.random() < 0.3:
        data["model_type"] = rng.choice(["deepseek_v2", "deepseek_v3", None, "llama", 3])
    return data


def assert_clean(call) -> str:
    """Run ``call``: success -> "ok", a DSV3Error -> "error"; anything else fails the test."""
    with time_bound():
        try:
            call()
        except DSV3Error as exc:
            assert str(exc).strip(), "an empty error message"
            return "error"
    return "ok"


def test_mutated_configs_parse_or_fail_cleanly():
    rng = random.Random(SEED)
    base = CFG.to_dict()
    outcomes = [assert_clean(lambda: ModelConfig.from_dict(mutated_config(rng, base)).validate()) for _ in range(300)]
    assert outcomes.count("error") > 150 and outcomes.count("ok") > 10  # the mutations do bite, not all


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    folder = tmp_path_factory.mktemp("fuzz") / "ckpt"
    model.save_pretrained(folder)
    return folder


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_checkpoints_with_mutated_configs_load_or_fail_cleanly(checkpoint, tmp_path):
    rng = random.Random(SEED + 1)
    base = json.loads((checkpoint / "config.json").read_text())
    outcomes = []
    for i in range(40):
        folder = _copy_checkpoint(checkpoint, tmp_path / f"c{i}")
        (folder / "config.json").write_text(json.dumps(mutated_config(rng, base)))
        outcomes.append(assert_clean(lambda folder=folder: load_pretrained(folder)))
    assert "error" in outcomes


def _mutate_tensor(rng: random.Random, t: torch.Tensor) -> torch.Tensor | None:
    kind = rng.choice(["dtype", "transpose", "shape", "nan", "inf", "drop", "scalar", "fp8"])
    if kind == "dtype":
        return t.to(rng.choice([torch.int64, torch.int8, torch.bool, torch.float16, torch.uint8]))
    if kind == "transpose":
        return t.t().contiguous() if t.dim() == 2 else t.flip(0)
    if kind == "shape":
        return torch.zeros(*[s + rng.choice([-1, 1]) for s in t.shape]) if t.numel() > 1 else torch.zeros(3)
    if kind in ("nan", "inf"):
        t = t.clone().float()
        t.view(-1)[rng.randrange(t.numel())] = float(kind)
        return t
    if kind == "scalar":
        return torch.tensor(1.0)
    if kind == "fp8":
        return t.to(rng.choice([torch.float8_e4m3fn, torch.float8_e5m2])) if t.dim() == 2 else t
    return None  # drop


def _corrupt_bytes(rng: random.Random, f: Path) -> None:
    data = bytearray(f.read_bytes())
    kind = rng.choice(["truncate", "flip", "header"])
    if kind == "truncate":
        del data[rng.randrange(len(data)):]
    elif kind == "flip":
        for _ in range(8):
            data[rng.randrange(len(data))] ^= 0xFF
    else:
        data[rng.randrange(8, min(200, len(data)))] = ord(rng.choice("{}[]\",:0x"))
    f.write_bytes(bytes(data))


def test_corrupted_checkpoints_load_or_fail_cleanly(checkpoint, tmp_path):
    rng = random.Random(SEED + 2)
    tensors = load_file(checkpoint / "model.safetensors")
    names = sorted(tensors)
    outcomes = []
    for i in range(36):
        folder = _copy_checkpoint(checkpoint, tmp_path / f"t{i}")
        if i % 6 == 5:
            _corrupt_bytes(rng, folder / "model.safetensors")
        else:
            changed = dict(tensors)
            for name in rng.sample(names, rng.randint(1, 2)):
                new = _mutate_tensor(rng, changed[name])
                if new is None:
                    del changed[name]
                else:
                    changed[name] = new
            save_file(changed, str(folder / "model.safetensors"))
        outcomes.append(assert_clean(lambda folder=folder: load_pretrained(folder)))
    assert outcomes.count("error") >= 30


def test_cli_commands_on_mutated_inputs_exit_0_or_2(checkpoint, tmp_path, capsys):
    """In-process through dsv3.cli.main: load, generate, convert and analyze on mutated configs."""
    rng = random.Random(SEED + 3)
    base = json.loads((checkpoint / "config.json").read_text())
    for i in range(8):
        folder = _copy_checkpoint(checkpoint, tmp_path / f"m{i}")
        (folder / "config.json").write_text(json.dumps(mutated_config(rng, base)))
        for args in (["generate", "--model", str(folder), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--json"],
                     ["convert", str(folder), str(tmp_path / f"out{i}"), "--to", "bf16"],
                     ["analyze", "--config", str(folder / "config.json"), "--json"]):
            with time_bound():
                code = main(args)
            out, err = capsys.readouterr()
            assert code in (0, 2), (args, err)
            if code == 2:
                assert err.startswith("error: ") and err.count("\n") == 1 and out == "", err


def test_a_real_process_exits_2_without_traceback(checkpoint, tmp_path):
    """A real `dsv3 generate` process on a bad config: exit 2, one error line, bounded time (convert and
    analyze take the same path in-process above; a process costs seconds of imports)."""
    folder = _copy_checkpoint(checkpoint, tmp_path / "bad")
    data = json.loads((folder / "config.json").read_text())
    data.update(n_group="4", num_hidden_layers=10**12)
    (folder / "config.json").write_text(json.dumps(data))
    args = ["generate", "--model", str(folder), "--prompt-ids", "1", "--max-new-tokens", "2"]
    proc = subprocess.run([sys.executable, "-m", "dsv3.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "n_group must be an integer" in proc.stderr and "num_hidden_layers" in proc.stderr
