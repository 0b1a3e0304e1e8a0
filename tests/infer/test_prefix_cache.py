"""The paged prefix cache: identical outputs with and without it, eviction, collisions, the on-disk tier."""

import random

import pytest
import torch

from dsv3.errors import DSV3Error
from dsv3.infer.engine import Engine, Request
from dsv3.infer.prefix_cache import PrefixCache
from dsv3.infer.sampling import GREEDY, SamplingParams
from dsv3.infer.units import parse_size

from .conftest import tiny_model

SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
BS = 8  # small blocks: short prompts span several


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300) for _ in range(n)]


def family_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that share prefixes of several lengths (whole blocks and not), and one unrelated."""
    rng = random.Random(seed)
    base = ids(rng, 40)
    return [base + ids(rng, 5), base + ids(rng, 13), base[:17], base + ids(rng, 1), ids(rng, 30),
            base[:9] + ids(rng, 20)]


def answers(engine: Engine, prompts, params, together: bool) -> tuple[list[list[int]], list[int]]:
    """Token ids per prompt (one request at a time, or all in one batch) and the cached tokens reported."""
    requests = [Request(p, 6, params) for p in prompts]
    if together:
        out = engine.generate(requests)
    else:
        out = [engine.generate([r])[0] for r in requests]
    assert all(o.finish_reason == "length" for o in out)
    return [o.token_ids for o in out], [r.cached_tokens for r in requests]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "mtp"])
def test_outputs_are_identical_with_and_without_the_cache(model, speculative):
    prompts = family_prompts()
    plain = Engine(model, speculative=speculative, eos_token_ids=frozenset())
    cached = Engine(model, speculative=speculative, eos_token_ids=frozenset())
    cache = PrefixCache.for_engine(cached, 1 << 30, block_tokens=BS)
    for params in (GREEDY, SAMPLED):
        want, none = answers(plain, prompts, params, together=False)
        assert none == [0] * len(prompts)
        for together in (False, True):
            got, reused = answers(cached, prompts, params, together)
            assert got == want, (params, together)
            assert all(n % BS == 0 and n < len(p) for n, p in zip(reused, prompts, strict=True))
    # one at a time on a warm cache, every prompt reuses all its full blocks before its last token
    _, reused = answers(cached, prompts, GREEDY, together=False)
    full = [(len(p) - 1) // BS * BS for p in prompts]
    if speculative:  # prompt 1 leaves prompt 0 at a block's boundary: cached up to it (the MTP test below)
        full[1] = 40
    assert reused == full
    assert cache.counters.hits > 0 and cache.used_bytes <= cache.max_bytes


@pytest.mark.parametrize("again", ["first", "second"])
def test_a_pages_mtp_entry_is_the_one_its_continuation_needs(model, again):
    """The MTP layer's entry at slot j reads token j + 1. Two prompts share two blocks and differ from
    the third on: the first caches its three blocks (the second shared page's last MTP entry reading its
    own token 2 * BS); the second reuses the shared two, on its own copy of the last, and is not cached
    beyond them (the shared page holds the first's entry, which its third block would follow). Run
    again, each reuses what it may, and its whole latent cache, MTP layer included, equals a cache-free
    prefill's. (Had the second's third block been kept, its hit would have read the first's entry:
    sampled outputs drifted after 8 tokens.)"""
    rng = random.Random(3)
    shared = ids(rng, 2 * BS)
    a, b = shared + ids(rng, BS + 3), shared + ids(rng, BS + 3)
    plain = Engine(model, speculative=True, eos_token_ids=frozenset())
    cached = Engine(model, speculative=True, eos_token_ids=frozenset())
    PrefixCache.for_engine(cached, 1 << 30, block_tokens=BS)
    for prompt in (a, b):
        cached.generate([Request(prompt, 4, GREEDY)])
    prompt, reused = (a, 3 * BS) if again == "first" else (b, 2 * BS)
    want = plain.start([Request(prompt, 8, SAMPLED)])
    request = Request(prompt, 8, SAMPLED)
    got = cached.start([request])
    assert request.cached_tokens == reused
    L = len(prompt)
    for mine, theirs in zip(got.cache.read_row(0, 0, L), want.cache.read_row(0, 0, L), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    assert got.rows[0].draft == want.rows[0].draft


def test_eviction_under_memory_pressure_never_serves_another_requests_blocks(model):
    """A cache of three blocks, filled many times over by distinct prompts (some repeated, some sharing
    a prefix): every answer equals the cache-free engine's."""
    rng = random.Random(1)
    prompts = [ids(rng, rng.randrange(9, 50)) for _ in range(7)]
    prompts += [prompts[i] + ids(rng, 4) for i in (0, 3, 3, 6)] + [prompts[2], prompts[5][:30] + ids(rng, 7)]
    plain = Engine(model, eos_token_ids=frozenset())
    cached = Engine(model, eos_token_ids=frozenset())
    cache = PrefixCache.for_engine(cached, 1, block_tokens=BS)
    cache.max_bytes = 3 * cache.block_bytes
    want, _ = answers(plain, prompts, GREEDY, together=False)
    got, reused = answers(cached, prompts, GREEDY, together=False)
    assert got == want
    got, _ = answers(cached, prompts[::-1], GREEDY, together=True)
    assert got == want[::-1]
    assert cache.counters.evicted > 6 and any(reused)
    assert len(cache.blocks) <= 3 and cache.used_bytes <= cache.max_bytes


def test_hash_collisions_cannot_serve_wrong_blocks(model):
    """Every key collides (a constant hash): a hit still needs equal tokens and the same parent."""
    rng = random.Random(2)
    prompts = [ids(rng, 30) for _ in range(4)]
    prompts += [prompts[0], prompts[1][:BS] + ids(rng, 20), prompts[1]]
    plain = Engine(model, eos_token_ids=frozenset())
    cached = Engine(model, eos_token_ids=frozenset())
    cache = PrefixCache.for_engine(cached, 1 << 30, block_tokens=BS, hasher=lambda parent, tokens: b"same")
    want, _ = answers(plain, prompts, GREEDY, together=False)
    got, reused = answers(cached, prompts, GREEDY, together=False)
    assert got == want
    assert reused[:4] == [0, 0, 0, 0] and reused[4] == BS  # only block 0 of the first prompt can be kept
    assert len(cache.blocks) == 1


def test_the_disk_tier_keeps_evicted_blocks_and_ignores_bad_files(model, tmp_path):
    rng = random.Random(4)
    first, other = ids(rng, 4 * BS + 3), ids(rng, 4 * BS + 3)
    plain = Engine(model, eos_token_ids=frozenset())
    want = plain.generate([Request(first, 8, GREEDY)])[0].token_ids

    def fresh(directory, budget_blocks: int = 1, net=model) -> tuple[Engine, PrefixCache]:
        engine = Engine(net, eos_token_ids=frozenset())
        cache = PrefixCache.for_engine(engine, 1, BS, directory)
        cache.max_bytes = budget_blocks * cache.block_bytes
        return engine, cache

    engine, cache = fresh(tmp_path)
    engine.generate([Request(first, 8, GREEDY)])
    engine.generate([Request(other, 8, GREEDY)])  # evicts first's blocks to disk
    assert cache.counters.disk_writes >= 4
    assert not list(tmp_path.glob(".tmp-*"))

    engine, cache = fresh(tmp_path)  # a new process: memory empty, the folder full
    request = Request(first, 8, GREEDY)
    assert engine.generate([request])[0].token_ids == want
    assert request.cached_tokens == 4 * BS and cache.counters.disk_reads == 4

    files = sorted(tmp_path.glob("*.blk"))
    for path, damage in zip(files, ("flip", "truncate", "garbage", "flip"), strict=False):
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-5] ^= 0xFF
        path.write_bytes(bytes(data[: len(data) // 2]) if damage == "truncate" else
                         b"hello" if damage == "garbage" else bytes(data))
    engine, cache = fresh(tmp_path)
    for prompt in (first, other):
        request = Request(prompt, 8, GREEDY)
        out = engine.generate([request])[0].token_ids
        assert out == plain.generate([Request(prompt, 8, GREEDY)])[0].token_ids
    assert cache.counters.disk_rejected >= 1
    for _ in range(2):  # a bad file is replaced by a sound one once read (a chain stops at its first bad file)
        engine, cache = fresh(tmp_path)
        request = Request(first, 8, GREEDY)
        assert engine.generate([request])[0].token_ids == want
    assert request.cached_tokens == 4 * BS and cache.counters.disk_rejected == 0

    # a foreign model's files under this model's names: refused by the fingerprint, answers unchanged
    foreign_dir, own_dir = tmp_path / "foreign", tmp_path / "own"
    other_model = tiny_model(seed=1)
    engine_f, _ = fresh(foreign_dir, net=other_model)
    engine_f.generate([Request(first, 8, GREEDY)])
    engine_f.generate([Request(other, 8, GREEDY)])
    engine, cache = fresh(own_dir)
    key, names = cache.root, []
    for i in range(4):
        key = cache.hasher(key, tuple(first[i * BS : (i + 1) * BS]))
        names.append(f"{key.hex()}.blk")
    _, foreign_cache = fresh(foreign_dir, net=other_model)
    key = foreign_cache.root
    for i, name in enumerate(names):
        key = foreign_cache.hasher(key, tuple(first[i * BS : (i + 1) * BS]))
        if (foreign_dir / f"{key.hex()}.blk").exists():
            (own_dir / name).write_bytes((foreign_dir / f"{key.hex()}.blk").read_bytes())
    request = Request(first, 8, GREEDY)
    assert engine.generate([request])[0].token_ids == want
    assert request.cached_tokens == 0 and cache.counters.disk_rejected >= 1 and cache.counters.disk_reads == 0


def test_a_prefix_cache_folder_that_cannot_be_made_is_one_clear_error(model, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DSV3Error, match="cannot use"):
        PrefixCache.for_engine(Engine(model), 1 << 20, BS, directory=tmp_path / "file" / "sub")


@pytest.mark.parametrize(("text", "value"), [("0", 0), ("512", 512), ("1.5K", 1500), ("2M", 2_000_000),
                                             ("1G", 10**9), ("64Ki", 65536), ("2GiB", 2 << 30), ("3mb", 3_000_000)])
def test_sizes_parse(text, value):
    assert parse_size(text, "--x") == value


@pytest.mark.parametrize("text", ["lots", "-1", "nan", "inf", "", "1.2.3G"])
def test_bad_sizes_are_one_clear_error(text):
    with pytest.raises(DSV3Error, match="--x must"):
        parse_size(text, "--x")


def test_nothing_is_cached_or_reused_beyond_the_last_prompt_token(model):
    """A prompt of exactly one block keeps nothing: its last token is always prefilled."""
    engine = Engine(model, eos_token_ids=frozenset())
    cache = PrefixCache.for_engine(engine, 1 << 30, block_tokens=BS)
    prompt = list(range(1, BS + 1))
    for _ in range(2):
        request = Request(prompt, 2, GREEDY)
        engine.generate([request])
        assert request.cached_tokens == 0
    assert len(cache.blocks) == 0
    torch.testing.assert_close(torch.tensor(cache.counters.hits), torch.tensor(0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_low_precision_caches_round_trip_through_memory_and_disk(model, dtype, tmp_path):
    """Blocks keep the cache's own dtype, on disk too (raw bytes, so FP8 needs no special case)."""
    rng = random.Random(5)
    base = ids(rng, 5 * BS)
    prompts = [base + ids(rng, 5) for _ in range(3)]
    plain = Engine(model, speculative=True, cache_dtype=dtype, eos_token_ids=frozenset())
    cached = Engine(model, speculative=True, cache_dtype=dtype, eos_token_ids=frozenset())
    cache = PrefixCache.for_engine(cached, 1, BS, tmp_path)
    cache.max_bytes = 2 * cache.block_bytes
    want, _ = answers(plain, prompts, GREEDY, together=False)
    got, reused = answers(cached, prompts, GREEDY, together=False)
    assert got == want and reused == [0, 5 * BS, 5 * BS]
    assert cache.counters.disk_reads > 0 and cache.counters.disk_rejected == 0
    assert cache.pool.kv.dtype == dtype and all(b.page is not None for b in cache.blocks.values())


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "mtp"])
def test_hits_of_the_same_shape_are_prefilled_together(model, speculative, monkeypatch):
    """A load generator's prompts (one shared prefix, one length): one batched prefill of the rests,
    with the same outputs as a cache-free engine."""
    from dsv3.infer import prefix_cache

    rng = random.Random(6)
    base = ids(rng, 3 * BS)
    same = [base + ids(rng, 5) for _ in range(3)]
    prompts = same + [base + ids(rng, 9), ids(rng, 12)]  # another length, and a miss
    plain = Engine(model, speculative=speculative, eos_token_ids=frozenset())
    cached = Engine(model, speculative=speculative, eos_token_ids=frozenset())
    PrefixCache.for_engine(cached, 1 << 30, block_tokens=BS)
    want, _ = answers(plain, prompts, SAMPLED, together=False)
    cached.generate([Request(base + [7], 1, GREEDY)])  # caches the shared blocks
    sizes = []
    real = prefix_cache.PrefixBatch

    def spy(engine, requests, chains):
        sizes.append(len(requests))
        return real(engine, requests, chains)

    monkeypatch.setattr(prefix_cache, "PrefixBatch", spy)
    got, reused = answers(cached, prompts, SAMPLED, together=True)
    assert got == want and reused == [3 * BS] * 4 + [0]
    assert sorted(sizes) == [1, 3]
