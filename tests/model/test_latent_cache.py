"""The paged latent cache: rows found through a page table with a shift give the module path the same
numbers as the plain cache, pages shared between rows are read by both, and writes outside a row's pages
are refused."""

import pytest
import torch
from tests.model.test_absorbed_decode import CFG

from dsv3.model import LatentCache, Transformer


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG).eval()


def _pool(model: Transformer, pages: int, page_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    plain = model.new_cache(pages, page_tokens)
    return plain.kv, plain.pe


def test_paged_rows_with_shifts_decode_as_the_plain_cache():
    """Two rows right-aligned in the shared slot space (row 1 shifted by 5, not a page multiple), pages
    scattered through the pool: prefill, then 12 absorbed steps, equal to the plain cache (within float
    rounding: a gathered copy runs other matmul kernels than a strided view) on every slot a row holds."""
    model = _model()
    ids = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    n, shift = 4, 5
    valid = torch.ones(2, 32, dtype=torch.bool)
    valid[1, :shift] = False
    positions = torch.arange(32)[None].repeat(2, 1)
    positions[1] = (positions[1] - shift).clamp(min=0)
    kv, pe = _pool(model, 20, n)
    table = torch.tensor([[3, 9, 1, 12, 7, 0, 15, 2], [11, 4, 19, 6, 8, 13, 10, -1]], dtype=torch.int32)
    paged = LatentCache.paged(kv, pe, table, torch.tensor([0, shift]))
    plain = model.new_cache(2, 32)
    assert paged.max_len == 32 and paged.rows == 2
    with torch.no_grad():
        outs = []
        for cache in (plain, paged):
            mask = valid[:, None, :8].expand(2, 8, 8) & torch.ones(8, 8, dtype=torch.bool).tril()
            mask = mask | torch.eye(8, dtype=torch.bool)
            steps = [model(ids[:, :8], positions=positions[:, :8], cache=cache, mask=mask)]
            for t in range(8, 20):
                steps.append(model(ids[:, t : t + 1], positions=positions[:, t : t + 1], cache=cache, start_pos=t,
                                   mask=valid[:, None, : t + 1]))
            outs.append(torch.cat(steps, dim=1))
    held = valid[:, :20]  # the padding's own outputs differ: in a paged cache its latents are not stored
    assert (outs[0] - outs[1]).abs().amax(-1)[held].max() < 1e-6
    for layer in range(kv.shape[0]):
        got_kv, got_pe = paged.read(layer, 2, 20)
        assert torch.allclose(got_kv[0], plain.kv[layer, 0, :20], atol=1e-6)
        assert torch.allclose(got_pe[1, shift:], plain.pe[layer, 1, shift:20], atol=1e-6)


def test_a_shared_page_is_read_by_both_rows():
    model = _model()
    kv, pe = _pool(model, 4, 4)
    kv[0, 2] = torch.arange(4.0)[:, None]
    table = torch.tensor([[2, 0], [2, 1]], dtype=torch.int32)
    cache = LatentCache.paged(kv, pe, table, torch.zeros(2, dtype=torch.long))
    got, _ = cache.read(0, 2, 4)
    assert torch.equal(got[0], got[1]) and torch.equal(got[0][:, 0], torch.arange(4.0))
    assert cache.slots(2, 3, 6).tolist() == [[11, 0, 1], [11, 4, 5]]


def test_padding_before_a_shift_is_not_stored_and_other_writes_outside_pages_are_refused():
    model = _model()
    kv, pe = _pool(model, 4, 4)
    cache = LatentCache.paged(kv, pe, torch.tensor([[0, -1], [1, 2]], dtype=torch.int32), torch.tensor([0, 2]))
    assert cache.max_len == 4  # row 0: one page mapped
    ones = torch.ones(2, 2, CFG.kv_lora_rank), torch.ones(2, 2, CFG.qk_rope_head_dim)
    cache.write(0, 1, *ones)  # row 1's slot 1 is before its shift: dropped; its slot 2 is page 1's first
    assert kv[0, 0, 1:3].eq(1).all() and kv[0, 1, 0].eq(1).all() and kv[0, 1, 1:].eq(0).all()
    assert kv[0, 2:].eq(0).all() and kv[0, 0, 0].eq(0).all()
    with pytest.raises(ValueError, match="overflow"):
        cache.write(0, 4, *(t[:, :1] for t in ones))
    holed = LatentCache.paged(kv, pe, torch.tensor([[0, 3], [-1, 2]], dtype=torch.int32), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="outside"):
        holed.write(0, 1, *(t[:, :1] for t in ones))  # row 1's first page is not mapped
    with pytest.raises(ValueError, match="do not fit"):
        LatentCache.paged(kv, pe, torch.zeros(2, 2, dtype=torch.int32), torch.zeros(3, dtype=torch.long))
