"""The engine's CUDA decode step (dsv3/kernels/graph_decode.py) run on the CPU, its static steps eager (the CUDA
graphs themselves are checked on a GPU by `bash benchmarks/gpu_check.sh graph_decode`): the engine's cache bound
to each rung's static cache gives the module path's greedy tokens at batch 1, 3 (padded to 4) and 5 (padded to
8), with rows finishing at different steps (each drop binds a new cache to a smaller rung)."""

import pytest
import torch

from dsv3.config import preset
from dsv3.infer.engine import Engine, Request
from dsv3.kernels.decode import FastDecode
from dsv3.kernels.graph_decode import LADDER, GraphDecode, decode_step
from dsv3.model import Transformer

CFG = preset("nano").replace(num_hidden_layers=2)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG).eval()


def tokens(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    return [r.token_ids for r in engine.generate([Request(p, n) for p, n in zip(prompts, lengths, strict=True)])]


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_the_graph_step_gives_the_module_paths_tokens(model, batch):
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, CFG.vocab_size, (3 + 2 * b,), generator=g).tolist() for b in range(batch)]
    lengths = [6 + 3 * b for b in range(batch)]  # rows finish one after another
    want = tokens(Engine(model, fast=False, eos_token_ids=frozenset()), prompts, lengths)
    engine = Engine(model, fast=False, eos_token_ids=frozenset())
    engine.decoder = graphs = GraphDecode(model, compile=False)
    assert tokens(engine, prompts, lengths) == want
    used = sorted(graphs.rungs)
    assert used[-1] == next(r for r in LADDER if r >= batch) and set(used) <= set(LADDER)


def test_the_engine_picks_its_step_by_device(model):
    """On a CPU the engine's step is FastDecode (the CUDA graphs only where the model is on CUDA)."""
    assert type(decode_step(model)) is FastDecode and type(Engine(model).decoder) is FastDecode
