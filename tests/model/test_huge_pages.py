"""Tensors on transparent huge pages (dsv3.model.huge_pages): same values, own storages, shared weights kept
shared, and the kernel really backing them with 2 MB pages where the system allows it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsv3.config import preset
from dsv3.model import Transformer, huge_pages
from dsv3.model.mla import LatentCache

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this system")


def anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(300, 500)
        self.b = nn.Linear(500, 300, bias=False)
        self.b2 = self.b  # the same module twice: its weight is shared
        self.register_buffer("codes", torch.randint(-100, 100, (256, 128), dtype=torch.int8).view(torch.float8_e4m3fn))
        self.register_buffer("empty", torch.zeros(0))
        self.a.weight.requires_grad_(False)


@needs_thp
def test_arena_tensors_are_zero_aligned_and_own_their_storage():
    arena = huge_pages.Arena(3 << 20)
    x = arena.take((1000, 3), torch.float32)
    y = arena.take((5,), torch.bfloat16)
    assert x.data_ptr() % huge_pages.HUGE_PAGE == 0 and y.data_ptr() % huge_pages.ALIGN == 0
    assert not x.any() and not y.any()
    assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    assert x.untyped_storage().nbytes() == x.nbytes
    with pytest.raises(ValueError, match="cannot hold"):
        arena.take((4 << 20,), torch.uint8)


@needs_thp
def test_the_kernel_backs_an_arena_with_huge_pages():
    t = huge_pages.Arena(8 << 20).take((8 << 20,), torch.uint8)
    t.fill_(1)  # touch every page
    if "[always]" not in huge_pages.THP_MODE.read_text() and "[madvise]" not in huge_pages.THP_MODE.read_text():
        pytest.skip("THP mode neither always nor madvise")
    assert anon_huge_kb(t.data_ptr()) >= 2048


@needs_thp
def test_move_module_keeps_values_parameters_and_sharing():
    torch.manual_seed(0)
    m = Tiny()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    params = dict(m.named_parameters())
    old_ptr = m.a.weight.data_ptr()
    moved = huge_pages.move_module(m)
    assert moved >= sum(v.nbytes for v in before.values()) - m.b.weight.nbytes  # b once, though held twice
    assert m.a.weight.data_ptr() != old_ptr
    assert dict(m.named_parameters()) == params  # the same Parameter objects
    assert m.b2.weight is m.b.weight and not m.a.weight.requires_grad and m.b.weight.requires_grad
    for k, v in m.state_dict().items():
        assert v.dtype == before[k].dtype and v.shape == before[k].shape
        assert torch.equal(v.view(torch.uint8), before[k].view(torch.uint8))
    assert huge_pages.move_module(m) == 0  # already there
    m.a.bias = nn.Parameter(torch.ones(500))  # replaced: only it moves
    assert huge_pages.move_module(m) == 2048 and torch.equal(m.a.bias, torch.ones(500))


@needs_thp
def test_a_moved_model_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    model = Transformer(preset("nano")).eval()
    huge_pages.move_module(model)
    model.save_pretrained(tmp_path)
    from dsv3.checkpoint import load_pretrained

    loaded = load_pretrained(tmp_path)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("DSV3_HUGE_PAGES", "0")
    m = Tiny()
    ptr = m.a.weight.data_ptr()
    assert not huge_pages.available() and huge_pages.move_module(m) == 0 and m.a.weight.data_ptr() == ptr
    a, b = huge_pages.zeros_many([(1 << 20,), (3,)], torch.float32)
    assert not a.any() and b.shape == (3,)


def test_latent_cache_is_zeros_of_its_shape():
    """The cache stays on ordinary pages (a server allocates one whenever its batch changes; see LatentCache)."""
    cfg = preset("small")
    big = LatentCache(cfg, 2, 2048)
    assert not big.kv.any() and not big.pe.any()
    assert big.kv.shape == (cfg.num_hidden_layers + cfg.num_nextn_predict_layers, 2, 2048, cfg.kv_lora_rank)
