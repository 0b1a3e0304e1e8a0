"""The CPU decode kernels over a paged latent cache (``LatentCache.paged``: rows found through a page table and a
shift, pages shared by a pool), read and written in place: the attention op (``torch.ops.dsv3.mla_decode``), the
block and step kernels and the per-op path (``FastDecode``, MTP layer included) give over scattered pages the bits
they give over the plain cache holding the same values, write the same latents, never let a slot a row does not
hold (NaN there) reach the output, and refuse a write to a slot outside a row's pages (the static, CUDA-graph
step over pages: tests/kernels/test_graph_decode.py). Every SIMD path (AMX tiles, AVX-512 and its bf16 dot products,
AVX2 FMAs) at 1 and 2 threads."""

import math
import sys
from pathlib import Path

import pytest
import torch

from dsv3.kernels import decode
from dsv3.kernels import decode_kernels as dk
from dsv3.kernels import int_weights as iw
from dsv3.kernels.decode import FastDecode
from dsv3.model.mla import LatentCache
from dsv3.testing.ragged import decode_ragged, ragged_mask

sys.path.insert(0, str(Path(__file__).parents[1] / "infer"))
from conftest import tiny_model  # noqa: E402

needs_kernels = pytest.mark.skipif(not dk.kernels_available(), reason=f"C kernels: {dk.kernel_status()}")
NEG = float("-inf")


@pytest.fixture(params=["amx", "avx512", "avx2"])
def simd(request):
    """The bf16 attention in AMX tiles, the kernels' AVX-512 paths (GEMV micro-tiles, the bf16 attention's
    VDPBF16PS) or their AVX2 ones (FMAs); restored after."""
    dots, tiles = dk.bf16_dots(), dk.amx()
    path = request.param
    if path == "amx" and not tiles:
        pytest.skip("needs AMX-BF16 (CPU and kernel)")
    if path != "avx2" and not (iw.avx512(True) and dots):
        pytest.skip("needs AVX-512F and AVX512-BF16")
    iw.avx512(path != "avx2")
    dk.bf16_dots(path != "avx2")
    dk.amx(path == "amx")
    yield path
    iw.avx512(True)
    dk.bf16_dots(dots)
    dk.amx(tiles)


def page_out(kv: torch.Tensor, pe: torch.Tensor, shift: list[int], ends: list[int], page_tokens: int,
             seed: int = 0, fill: float | None = None, holes: dict[int, int] | None = None) -> LatentCache:
    """The plain cache kv [L, B, S, r] / pe [L, B, S, rope] moved into scattered pages of a pool: row b's slots
    [shift[b], ends[b]) (``holes``: row -> a table column left unmapped), each page a random one of a pool with
    spare pages (filled with ``fill``, else random values) and its table padded with -1."""
    L, B, S, _ = kv.shape
    g = torch.Generator().manual_seed(seed)
    cols = [math.ceil((e - s) / page_tokens) for s, e in zip(shift, ends, strict=True)]
    P = sum(cols) + 5
    pool = [torch.randn(L, P, page_tokens, t.shape[-1], generator=g).to(t.dtype) for t in (kv, pe)]
    if fill is not None:
        for t in pool:
            t.fill_(fill)
    order = torch.randperm(P, generator=g).tolist()
    table = torch.full((B, max(cols) + 1), -1, dtype=torch.int32)
    for b in range(B):
        for c in range(cols[b]):
            if holes and holes.get(b) == c:
                continue
            page = table[b, c] = order.pop()
            lo = shift[b] + c * page_tokens
            hi = min(lo + page_tokens, ends[b])
            for src, dst in zip((kv, pe), pool, strict=True):
                dst[:, page, : hi - lo] = src[:, b, lo:hi]
    return LatentCache.paged(*pool, table, torch.tensor(shift))


def held(cache: LatentCache, rows: int, end: int) -> torch.Tensor:
    """bool [rows, end]: the slots each row of a paged cache holds."""
    return cache.slots(rows, 0, end) >= 0


def attention_case(rows: int, T: int, dtype: torch.dtype, page_tokens: int, seed: int = 0):
    """One layer's attention inputs: queries, weights, a plain cache [1, rows, S, .] and a bias hiding the slots
    the paged copy of it does not hold (left padding of every length, a row ending early, a hole)."""
    H, nope, rope, r, v, S = 4, 16, 8, 32, 16, 101
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, T, H, nope + rope, generator=g).to(dtype)
    angles = torch.rand(rows, T, rope // 2, generator=g) * 6
    w_uk, w_uv = (torch.randn(H, n, r, generator=g).div(r ** 0.5).to(dtype) for n in (nope, v))
    kv, pe = torch.randn(1, rows, S, r, generator=g).to(dtype), torch.randn(1, rows, S, rope, generator=g).to(dtype)
    shift = [(7 * b + 3) % 45 for b in range(rows)]  # rarely a multiple of the page or the 32-key tile
    ends = [S - 20 if b % 5 == 2 else S for b in range(rows)]  # some rows end early (their last keys: -inf)
    holes = {b: 1 for b in range(rows) if b % 4 == 1}  # and some lack their second page
    cache = page_out(kv, pe, shift, ends, page_tokens, seed, holes=holes)
    written = torch.arange(S)[None, :] < torch.tensor(ends)[:, None]
    keep = (held(cache, rows, S) & written)[:, None, :].expand(rows, T, S).clone()
    keep &= torch.rand(rows, T, S, generator=g) > 0.2
    keep[:, :, -1] = keep[:, :, -1] | torch.tensor([e == S for e in ends])[:, None]
    bias = torch.zeros(rows, T, S).masked_fill_(~keep, NEG)
    return (q, angles.cos(), angles.sin(), w_uk, w_uv), (kv, pe), cache, bias, S


def attend(args, cache: LatentCache, bias, S, **kwargs) -> torch.Tensor:
    """The op over one layer of a paged cache."""
    return torch.ops.dsv3.mla_decode(*args, cache.kv[0], cache.pe[0], bias, 0.3, cache.table, cache.shift, S, **kwargs)


@needs_kernels
@pytest.mark.parametrize("page_tokens", [16, 12])  # 12 does not divide the 32-key tile
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_over_pages_gives_the_plain_caches_bits(threads, simd, page_tokens, rows, T, dtype):
    """Scattered pages, shifts off the page and tile boundaries, rows ending early and a missing page: the same
    bits as the plain cache with the same values (the tiles and their summation order are the plain ones), and
    the reference's numbers (which gathers the rows through the same formula)."""
    args, (kv, pe), cache, bias, S = attention_case(rows, T, dtype, page_tokens, seed=rows + T)
    got = attend(args, cache, bias, S)
    plain = torch.ops.dsv3.mla_decode(*args, kv[0], pe[0], bias, 0.3)
    assert torch.isfinite(got).all()
    assert torch.equal(got, plain)
    want = dk.mla_decode_reference(*args, kv[0], pe[0], bias, 0.3, bf16_queries=dtype == torch.bfloat16
                                   and dk.bf16_dots())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
    reference = dk.mla_decode(*args, cache.kv[0], cache.pe[0], bias, 0.3, use_kernel=False, table=cache.table,
                              shift=cache.shift, slots=S)
    torch.testing.assert_close(reference, dk.mla_decode_reference(*args, kv[0], pe[0], bias, 0.3), rtol=0, atol=0)


def spare_pages(cache: LatentCache) -> LatentCache:
    """The same rows with the pool's pages no row maps filled with NaN, page 0 among them (the first slot of the
    pool, where a kernel that read unheld keys from "the pool's first slot" would find NaN)."""
    kv, pe, table = cache.kv.clone(), cache.pe.clone(), cache.table.clone()
    mapped = set(table[table >= 0].tolist())
    spare = next(p for p in range(kv.shape[1]) if p not in mapped)
    if 0 in mapped:  # swap pages 0 and ``spare``: contents and table entries
        for t in (kv, pe):
            t[:, [0, spare]] = t[:, [spare, 0]]
        table = torch.where(table == 0, spare, torch.where(table == spare, 0, table)).to(torch.int32)
    for t in (kv, pe):
        t[:, [p for p in range(kv.shape[1]) if p not in set(table[table >= 0].tolist())]] = float("nan")
    return LatentCache.paged(kv, pe, table, cache.shift)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_a_row_does_not_hold_never_reach_the_output(threads, simd, dtype):
    """Every page of the pool that no row maps is NaN (page 0 among them), and a table entry points past the
    pool: where a row holds no slot (before its shift, its missing page, past its pages) the kernel reads its
    own first slot instead, so the output is the one over finite pages to the bit; the op's PyTorch reference
    stays finite too."""
    args, _, cache, bias, S = attention_case(5, 2, dtype, 12, seed=3)
    want = attend(args, cache, bias, S)
    nan = spare_pages(cache)
    assert torch.isnan(nan.kv[0, 0]).all()
    bad = nan.table.clone()
    assert bad[1, 1] == -1
    bad[1, 1] = nan.kv.shape[1] + 1000  # row 1's missing page, as a page number past the pool
    got = attend(args, LatentCache.paged(nan.kv, nan.pe, bad, nan.shift), bias, S)
    assert torch.equal(got, want)
    reference = dk.mla_decode(*args, nan.kv[0], nan.pe[0], bias, 0.3, use_kernel=False, table=nan.table,
                              shift=nan.shift, slots=S)
    assert torch.isfinite(reference).all()


# ---- whole decode steps -------------------------------------------------------------------------------------

PROMPTS = [[5, 17, 42, 99, 7, 250, 3], [11, 12], [200, 100, 50, 25, 12, 6, 3, 1, 2, 9, 8]]
MODES = {"step kernel": {}, "block kernel": {"step_kernel": False}, "per-op kernels": {"block_kernel": False},
         "per-op torch": {"use_kernels": False}}


def prefilled(model, page_tokens: int, steps: int, T: int):
    """A ragged batch prefilled by the modules into a plain cache, and the same values in scattered pages whose
    shifts drop each row's left padding. Returns (plain, paged, valid, L, pads)."""
    B, L = len(PROMPTS), max(len(p) for p in PROMPTS)
    plain = model.new_cache(B, L + steps * T + 2, dtype=model.model.embed_tokens.weight.dtype)
    pads = torch.tensor([L - len(p) for p in PROMPTS])
    valid = torch.zeros(B, plain.max_len, dtype=torch.bool)
    valid[:, :L] = torch.arange(L)[None] >= pads[:, None]
    ids = torch.tensor([[0] * (L - len(p)) + p for p in PROMPTS])
    with torch.inference_mode():
        model.hidden_states(ids, positions=(torch.arange(L)[None] - pads[:, None]).clamp(min=0), cache=plain,
                            mask=ragged_mask(valid, 0, L))
    paged = page_out(plain.kv, plain.pe, pads.tolist(), [plain.max_len] * B, page_tokens)
    return plain, paged, valid, L, pads


def paged_calls(monkeypatch) -> dict[str, int]:
    """Counts of the kernel calls FastDecode makes from now on over a paged cache: whole steps, block kernels
    (the MTP layer's among them), the per-op path's attention through the page table."""
    calls: dict[str, int] = {}

    def counted(name, fn, paged):
        def call(*args, **kwargs):
            if paged(*args, **kwargs):
                calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(dk, "decode_step", counted("step", dk.decode_step, lambda *a: True))
    monkeypatch.setattr(dk, "decode_block", counted("block", dk.decode_block, lambda *a: True))
    monkeypatch.setattr(decode, "mla_decode", counted("attention", decode.mla_decode,
                                                      lambda *a, **k: k.get("table") is not None and a[9]))
    return calls


def paged_contents(cache: LatentCache, rows: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a paged cache holds in slots [0, end) of every layer, 0 where a row holds nothing."""
    keep = held(cache, rows, end)[None, :, :, None]
    kv = torch.stack([cache.read(layer, rows, end)[0] for layer in range(cache.kv.shape[0])])
    pe = torch.stack([cache.read(layer, rows, end)[1] for layer in range(cache.kv.shape[0])])
    return kv * keep, pe * keep


@needs_kernels
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("page_tokens", [16, 12])
def test_decode_steps_over_pages_equal_the_plain_cache(threads, simd, mode, dtype, T, page_tokens, monkeypatch):
    """FastDecode's step kernel, block kernels, per-op kernels and per-op PyTorch (and the MTP layer after each)
    over a paged ragged batch: the plain cache's logits (bit for bit on the kernel paths; within fp32 rounding of
    the module-path reference for PyTorch's, whose gathered rows hold 0 where the plain one holds padding) and
    the same latents written."""
    model = tiny_model().to(dtype)
    steps = 3
    plain, paged, valid, L, pads = prefilled(model, page_tokens, steps, T)
    before = valid.clone()
    decoder = FastDecode(model, **MODES[mode])
    want = decode_ragged(decoder, plain, valid, L, pads, steps, T)
    calls = paged_calls(monkeypatch)
    got = decode_ragged(decoder, paged, before, L, pads, steps, T)
    assert calls == {"step kernel": {"step": steps, "block": steps}, "block kernel": {"block": 3 * steps},
                     "per-op kernels": {"attention": 3 * steps}, "per-op torch": {}}[mode]  # 2 layers + MTP
    end = L + steps * T
    kv, pe = paged_contents(paged, len(PROMPTS), end)
    keep = held(paged, len(PROMPTS), end)[None, :, :, None]
    if mode == "per-op torch":
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=2e-6 * w.abs().max().item())
        return
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(kv, plain.kv[:, :, :end] * keep) and torch.equal(pe, plain.pe[:, :, :end] * keep)
    if mode == "step kernel":
        assert decoder._step_kernel is not None


@needs_kernels
@pytest.mark.parametrize("mode", list(MODES))
def test_a_write_outside_a_rows_pages_is_refused_and_writes_nothing(mode):
    """A row whose page for this step's slot is unmapped (-1 in the middle of its table): the step kernel, the
    block kernel (the C check, before anything runs) and the per-op path (``LatentCache.write``) raise ValueError,
    and the pool is untouched."""
    model = tiny_model()
    steps, T = 1, 1
    _, paged, valid, L, pads = prefilled(model, 4, steps, T)
    table = paged.table.clone()
    table[2, (L - pads[2].item()) // 4] = -1  # row 2's page of slot L, one of its middle ones
    paged = LatentCache.paged(paged.kv, paged.pe, table, paged.shift)
    assert paged.max_len > L  # the cache has room: only the page table says no
    before = paged.kv.clone(), paged.pe.clone()
    decoder = FastDecode(model, **MODES[mode])
    said = "at a slot" if "kernel" in mode and "per-op" not in mode else r"at slots \[11, 12\)"  # C or Python
    with pytest.raises(ValueError, match=f"{said} outside a row's pages"):
        decode_ragged(decoder, paged, valid, L, pads, steps, T)
    assert torch.equal(paged.kv, before[0]) and torch.equal(paged.pe, before[1])
