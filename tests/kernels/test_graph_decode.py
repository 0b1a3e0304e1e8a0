"""The engine's CUDA decode step (dsv3/kernels/graph_decode.py) run on the CPU, its static steps eager or compiled
without CUDA graphs (the graphs themselves are checked on a GPU by `bash benchmarks/gpu_check.sh graph_decode`).
Each rung reads and writes the engine's pool of pages in place, through the batch's page table: the module
path's greedy tokens at batch 1, 3 (padded to 4) and 5 (padded to 8), with rows finishing at different steps
(each drop remaps the pages), rows joining a running batch (a merge), pages scattered over the pool; over the
CPU ops (the default there) and over the model's modules (the CUDA code: a gather through flat slot indices).
No step copies the cache: the only ops that touch the pool are views, the latents' writes and the attention's
read."""

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dsv3.config import preset
from dsv3.infer.engine import Engine, Request, merged
from dsv3.kernels.decode import FastDecode
from dsv3.kernels.graph_decode import LADDER, GraphDecode, decode_step
from dsv3.kernels.static_decode import StaticDecode
from dsv3.model import Transformer

CFG = preset("nano").replace(num_hidden_layers=2)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG).eval()


@pytest.fixture(params=["ops", "modules"])
def path(request, monkeypatch):
    """The static step over the CPU ops, or over the model's modules (what it runs on CUDA)."""
    if request.param == "modules":
        monkeypatch.setattr(StaticDecode, "_kernel_plans", lambda self: None)
    return request.param


def engines(model, page_tokens: int = 16, graphs: GraphDecode | None = None) -> tuple[Engine, Engine, GraphDecode]:
    """The module path's engine, and one decoding through ``graphs`` (eager GraphDecode by default)."""
    reference = Engine(model, fast=False, eos_token_ids=frozenset(), page_tokens=page_tokens)
    engine = Engine(model, fast=False, eos_token_ids=frozenset(), page_tokens=page_tokens)
    engine.decoder = graphs = graphs or GraphDecode(model, compile=False)
    return reference, engine, graphs


def tokens(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    return [r.token_ids for r in engine.generate([Request(p, n) for p, n in zip(prompts, lengths, strict=True)])]


def random_prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (3 + 2 * b,), generator=g).tolist() for b in range(n)]


def scatter(engine: Engine, pages: int = 40, seed: int = 0) -> None:
    """Take ``pages`` pages and give half of them back in a random order: the batch's pages then come from all
    over the pool, not in order (the other half stays held)."""
    taken = engine.pool.take(pages)
    back = taken[::2]
    random.Random(seed).shuffle(back)
    engine.pool.release(back)


def joined(engine: Engine, first: list[Request], later: list[Request], after: int) -> list[list[int]]:
    """Greedy tokens of ``first`` decoded together, ``later`` prefilled and merged into them after ``after`` steps
    (continuous batching), all to the end."""
    got: dict[int, list[int]] = {}

    def note(events):
        for ev in events:
            got.setdefault(id(ev.request), []).extend(ev.token_ids)

    batch = engine.start(first)
    note(batch.first_events)
    for _ in range(after):
        note(batch.step())
    fresh = engine.start(later)
    note(fresh.first_events)
    batch = merged(batch, fresh)
    while batch.rows:
        note(batch.step())
    batch.release()
    return [got[id(r)] for r in first + later]


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_the_graph_step_gives_the_module_paths_tokens(model, path, batch):
    prompts = random_prompts(batch, batch)
    lengths = [6 + 3 * b for b in range(batch)]  # rows finish one after another
    reference, engine, graphs = engines(model)
    want = tokens(reference, prompts, lengths)
    assert tokens(engine, prompts, lengths) == want
    used = sorted(graphs.rungs)
    assert used[-1] == next(r for r in LADDER if r >= batch) and set(used) <= set(LADDER)
    assert all(static.kv is engine.pool.kv and static.pe is engine.pool.pe for static, _ in graphs.rungs.values())


def test_rows_joining_a_running_batch_over_scattered_pages(model, path):
    """Two rows decode, three join after 4 steps (their histories shifted to end at the same slot), rows finish
    one after another; pages of 4 slots from all over the pool."""
    prompts = random_prompts(7, 5)
    lengths = [12, 9, 5, 14, 7]
    reference, engine, graphs = engines(model, page_tokens=4)
    scatter(engine)

    def requests():
        return [Request(p, n) for p, n in zip(prompts, lengths, strict=True)]

    first, later = requests()[:2], requests()[2:]
    want = joined(reference, first, later, 4)
    first, later = requests()[:2], requests()[2:]
    assert joined(engine, first, later, 4) == want
    assert {2, 8} <= set(graphs.rungs)  # two rows, then five (in the 8-row graph)


class PoolOps(TorchDispatchMode):
    """Counts the ops any of whose tensors lie in the pool's storage, but views of it (an op, not in place, whose
    outputs all lie there too)."""

    def __init__(self, *pool: torch.Tensor):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in pool}
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        view = not name.endswith("_") and outputs and all(self._pool(t) for t in outputs)
        if not view and any(self._pool(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            self.ops[name] += 1
        return out

    def _pool(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.storages


def test_a_step_does_not_copy_the_cache(model, path):
    """Every op of a decode step (three rows) that touches the pool is a view of it, one of the two writes of a
    layer's latents (kv and pe: index_put_ of one slot a row) or the attention's read (the op reading pages in
    place; on the modules path, the gather of each row's slots); a copy of the cache (copy_, clone, index_put,
    cat...) would be counted and fail."""
    reference, engine, graphs = engines(model)
    steps = []
    step = graphs.hidden_and_logits

    def watched(*args, **kwargs):
        with PoolOps(engine.pool.kv, engine.pool.pe) as seen:
            out = step(*args, **kwargs)
        steps.append(seen.ops)
        return out

    graphs.hidden_and_logits = watched
    prompts = random_prompts(3, 3)
    assert tokens(engine, prompts, [5, 5, 5]) == tokens(reference, prompts, [5, 5, 5])
    layers = CFG.num_hidden_layers
    reads = {"mla_decode": layers} if path == "ops" else {"index": 2 * layers}
    assert len(steps) == 4
    for ops in steps:
        assert ops == {"index_put_": 2 * layers, **reads}


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the memory mapping holding ``t`` that are in RAM (/proc/self/smaps' Rss): a pool allocated
    with torch.empty and only partly written has only those pages resident."""
    ptr, rss, inside = t.data_ptr(), None, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "Rss:":
                rss = int(line.split()[1]) * 1024
    return rss


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_a_compiled_rung_replays_for_later_batches_in_place(model):
    """GraphDecode compiled (torch.compile, no CUDA graphs on the CPU): the module path's tokens, a second batch
    (other pages, other shifts) runs the same compiled steps without compiling again, and the compiled steps
    leave the pool's untouched pages untouched (a step that mutated a view of the pool would be compiled into
    a copy of the whole pool and back, every page of it then resident)."""
    import torch._dynamo

    torch._dynamo.reset()
    reference = Engine(model, fast=False, eos_token_ids=frozenset())
    engine = Engine(model, fast=False, eos_token_ids=frozenset(), kv_cache_bytes=1 << 30)
    engine.decoder = graphs = GraphDecode(model, mode=None)
    prompts = random_prompts(11, 2)
    assert tokens(engine, prompts, [6, 6]) == tokens(reference, prompts, [6, 6])
    assert sorted(graphs.rungs) == [2]
    scatter(engine, 10)
    prompts = random_prompts(12, 2)
    with torch._dynamo.config.patch(error_on_recompile=True):  # (monkeypatch cannot restore a config module's)
        assert tokens(engine, prompts, [8, 8]) == tokens(reference, prompts, [8, 8])
    assert resident_bytes(engine.pool.kv) < 64 << 20 and resident_bytes(engine.pool.pe) < 64 << 20


def test_a_step_past_the_rows_pages_is_refused_as_on_the_module_path(model):
    """Slot 8 of rows holding 8 slots (two pages of 4): the module path's overflow error, nothing written."""
    pool = Engine(model, fast=False, kv_cache_bytes=1 << 22, page_tokens=4).pool
    cache = pool.cache([pool.take(2), pool.take(2)], [0, 0])
    before = pool.kv.clone()
    for decoder in (model, GraphDecode(model, compile=False)):
        with pytest.raises(ValueError, match="cache overflow"):
            decoder.hidden_and_logits(torch.tensor([[1], [2]]), cache=cache, start_pos=8)
    # bit for bit: pages never handed out hold whatever memory held (NaN too, which equals nothing)
    assert torch.equal(pool.kv.view(torch.uint8), before.view(torch.uint8))


def test_the_engine_picks_its_step_by_device(model):
    """On a CPU the engine's step is FastDecode (the CUDA graphs only where the model is on CUDA)."""
    assert type(decode_step(model)) is FastDecode and type(Engine(model).decoder) is FastDecode
