"""Paged prefix cache: pages of the MLA latent cache reused across requests.

A prompt is cut into blocks of ``block_tokens`` tokens, the engine's cache page size. Block i's key is a
hash of block i - 1's key and block i's tokens (a hash chain), so a key names a whole prefix. A block is
a page of the engine's pool (``dsv3.infer.page_pool``) holding what the latent cache holds for its
slots: c_KV and the roped k_R of every layer, the MTP layer's too. When a prompt's prefill is done, the
pages its full blocks fill become the cache's (it holds them, no byte copied); a request whose prompt
starts with cached blocks maps those same pages at the head of its page table (``lease``) and prefills
only the rest, its positions continuing from the prefix. A page stays while the cache or any request
holds it.

Correctness rules:

- A hit is checked, not trusted: a block matches only when its own tokens equal the prompt's and its
  parent is the block matched just before, so a hash collision can never serve another prompt's
  blocks (the on-disk tier stores the whole prefix and compares it).
- Only blocks that end before the prompt's last token are cached or reused: that token is always
  prefilled, since its logits give the first reply token; and no request writes into a page it shares,
  since every later write lands at or after that token's slot.
- The MTP layer's entry at slot j reads token j + 1: the last entry of a page was written reading the
  first token after its block in the prompt that filled it (the block's ``next_token``). A request that
  reuses the chain up to that page but goes on with another token needs its own entry there, so with
  speculation the last page of a hit is the request's own copy, and its prefill starts one slot early
  and writes that slot (the main layers' entry comes out the same). A block is cached as a child only of
  a parent whose ``next_token`` is the block's first token, so every page inside a hit is followed by
  the token its entry read (after a branch point, the branches other than the first are cached up to
  it; their requests still reuse everything before it).
- Eviction is LRU under a byte budget over blocks that have no cached children (a chain is freed from
  its tail, never leaving unreachable blocks behind); an evicted block's page returns to the pool once
  no request holds it. When the pool runs out of pages, the engine asks the cache to evict first.

On-disk tier (``directory``): an evicted block is written there atomically (temporary file, fsync,
rename) and read back into a page on a later miss, as DeepSeek's context cache keeps prefixes on disk. A
file is used only when its magic, model fingerprint, dtype, shapes, full prefix tokens and SHA-256 all
check out; anything else (a corrupt, truncated or foreign file) is ignored, counted and removed, so that
the block is written afresh. A chain longer than the memory budget goes to disk block by block.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv3.errors import DSV3Error
from dsv3.infer.engine import Batch, Engine, Event, Request, _Poisoned
from dsv3.infer.page_pool import PagePool, PoolFull

Hasher = Callable[[bytes, tuple[int, ...]], bytes]
MAGIC = b"DSV3PFX2"  # 2: a block is a page, its MTP entries at their own slots
DEFAULT_BLOCK_TOKENS = 16


def chain_hash(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The key of a block: BLAKE2b over its parent's key and its own token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass(eq=False)
class Block:
    """One cached block: the pool's page ``page`` (None while only on disk) holds ``tokens``, after ``parent``."""

    key: bytes
    tokens: tuple[int, ...]
    parent: Block | None
    page: int | None = None
    next_token: int = -1  # the prompt's token after this block, which the page's last MTP entry read
    refs: int = 0  # held while its chain is being inserted: not evictable
    children: int = 0  # resident blocks whose parent it is: not evictable (they would be unreachable)
    on_disk: bool = False

    def prefix(self) -> list[int]:
        """Every token from the prompt's start to this block's end (walks the parents)."""
        parts, node = [], self
        while node is not None:
            parts.append(node.tokens)
            node = node.parent
        return [t for part in reversed(parts) for t in part]


@dataclass
class CacheCounters:
    """What /metrics reports; tokens, not blocks, for queries and hits (as vLLM counts them)."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache
    inserted: int = 0  # blocks stored
    evicted: int = 0
    disk_reads: int = 0
    disk_writes: int = 0
    disk_rejected: int = 0  # files that were corrupt, truncated or from another model
    disk_errors: list[str] = field(default_factory=list)  # the last few reasons, for debugging


@dataclass(frozen=True)
class CacheSnapshot:
    """What /metrics shows of a prefix cache, or of several summed (the prefill ranks of ``serve --ep``)."""

    blocks: int
    used_bytes: int
    max_bytes: int
    block_tokens: int
    counters: CacheCounters

    @staticmethod
    def total(parts: list[CacheSnapshot]) -> CacheSnapshot:
        counted = ("queries", "hits", "inserted", "evicted", "disk_reads", "disk_writes", "disk_rejected")
        counters = CacheCounters(**{name: sum(getattr(p.counters, name) for p in parts) for name in counted})
        return CacheSnapshot(sum(p.blocks for p in parts), sum(p.used_bytes for p in parts),
                             sum(p.max_bytes for p in parts), parts[0].block_tokens, counters)


def model_fingerprint(model, dtype: torch.dtype, layers: int, block_tokens: int) -> str:
    """A digest of the config, the cache layout and a sample of every weight: blocks written by another
    model (or another layout) never match."""
    h = hashlib.sha256(repr(model.config).encode())
    h.update(f"{dtype}|{layers}|{block_tokens}".encode())
    with torch.no_grad():
        for name, t in model.state_dict().items():
            h.update(f"{name}{tuple(t.shape)}".encode())
            h.update(t.detach().flatten()[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()


class PrefixCache:
    """Blocks of the latent cache keyed by a hash chain of token ids, in pages of ``pool``; see the module
    docstring. ``speculative``: the requests draft with the MTP layer (whose entries the blocks then keep,
    and whose rule on a hit's last page applies)."""

    def __init__(self, model, pool: PagePool, max_bytes: int, speculative: bool = False,
                 directory: str | Path | None = None, hasher: Hasher = chain_hash):
        if max_bytes < 0:
            raise DSV3Error(f"the prefix cache's size must be >= 0 bytes, got {max_bytes}")
        cfg = model.config
        self.pool, self.block_tokens, self.max_bytes, self.hasher = pool, pool.page_tokens, max_bytes, hasher
        self.speculative = speculative
        self.layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if speculative else 0)  # what disk keeps
        self.dtype = pool.kv.dtype
        self.fingerprint = model_fingerprint(model, self.dtype, self.layers, self.block_tokens)
        self.root = bytes.fromhex(self.fingerprint)[:16]  # the chain starts from the model: no cross-model keys
        self.directory = Path(directory) if directory is not None else None
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DSV3Error(f"cannot use {self.directory} as the prefix cache folder: "
                                f"{exc.strerror or exc}") from None
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.counters = CacheCounters()
        pool.reclaim = self.reclaim

    @classmethod
    def for_engine(cls, engine: Engine, max_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                   directory: str | Path | None = None, hasher: Hasher = chain_hash) -> PrefixCache:
        """A cache over ``engine``'s pool, attached to it (``engine.start`` then uses it); the pool's pages are
        made ``block_tokens`` long (before any request runs)."""
        if block_tokens < 1:
            raise DSV3Error(f"the prefix cache's block size must be >= 1 token, got {block_tokens}")
        engine.repage(block_tokens)
        cache = cls(engine.model, engine.pool, max_bytes, engine.speculative, directory, hasher)
        engine.prefix_cache = cache
        return cache

    @property
    def block_bytes(self) -> int:
        return self.pool.page_bytes

    @property
    def used_bytes(self) -> int:
        return len(self.blocks) * self.block_bytes  # every resident block holds one page

    def snapshot(self) -> CacheSnapshot:
        c = self.counters
        return CacheSnapshot(len(self.blocks), self.used_bytes, self.max_bytes, self.block_tokens,
                             CacheCounters(c.queries, c.hits, c.inserted, c.evicted, c.disk_reads, c.disk_writes,
                                           c.disk_rejected))

    def join_group(self, fingerprints: list[str]) -> None:
        """Take the fingerprint of a whole serving group from every rank's own (each rank of ``serve --ep``
        holds other experts, so its own fingerprint covers only its share of the weights): the ranks then
        name blocks alike and share one ``--prefix-cache-dir``, and a group of other weights never matches."""
        self.fingerprint = hashlib.sha256("|".join(fingerprints).encode()).hexdigest()
        self.root = bytes.fromhex(self.fingerprint)[:16]

    # ---- lookup ------------------------------------------------------------------------------
    def usable_blocks(self, n_tokens: int) -> int:
        """Full blocks of a prompt of ``n_tokens`` that may be cached: all that end before its last token."""
        return (n_tokens - 1) // self.block_tokens

    def lease(self, prompt: Sequence[int]) -> list[int]:
        """The pages of the longest cached chain of full blocks that starts ``prompt``, each held once for the
        caller (who releases them to the pool); with speculation the last is the caller's own copy (see
        the module docstring). Its length times ``block_tokens`` is the prompt's cached tokens."""
        bs, pages = self.block_tokens, []
        key, parent, chain = self.root, None, []
        for i in range(self.usable_blocks(len(prompt))):
            tokens = tuple(prompt[i * bs : (i + 1) * bs])
            key = self.hasher(key, tokens)
            block = self.blocks.get(key)
            if block is None or block.tokens != tokens or block.parent is not parent:
                block, page = self._read(key, prompt[: (i + 1) * bs], parent)
                if block is None:
                    break
            else:
                page = block.page
                self.pool.hold([page])
            pages.append(page)
            chain.append(block)
            parent = block
        self._touch(chain)
        if self.speculative and pages:
            try:
                own = self.pool.take(1)
            except PoolFull:  # no page for the copy: lease one block less
                self.pool.release(pages[-1:])
                pages, chain = pages[:-1], chain[:-1]
            else:
                self.pool.copy(pages[-1:], own)
                self.pool.release(pages[-1:])
                pages[-1] = own[0]
        self.counters.queries += len(prompt)
        self.counters.hits += len(pages) * bs
        return pages

    # ---- insertion and eviction ----------------------------------------------------------------
    def insert(self, prompt: Sequence[int], pages: Sequence[int]) -> int:
        """Keep the usable blocks of ``prompt`` from the pages of its prefilled row (page i holding tokens
        [i * block_tokens, (i + 1) * block_tokens)); blocks already cached are only touched. Returns the
        number of new blocks."""
        bs, key, parent, chain, new = self.block_tokens, self.root, None, [], 0
        try:
            for i in range(self.usable_blocks(len(prompt))):
                tokens = tuple(prompt[i * bs : (i + 1) * bs])
                if self.speculative and parent is not None and parent.next_token != tokens[0]:
                    break  # the parent's page holds another continuation's MTP entry (see the module docstring)
                key = self.hasher(key, tokens)
                block = self.blocks.get(key)
                if block is None:
                    block = self._keep(Block(key, tokens, parent, next_token=prompt[(i + 1) * bs]), pages[i])
                    if block is None:
                        break
                    new += 1
                elif block.tokens != tokens or block.parent is not parent:
                    break  # a collision, or a chain we could not keep whole: never overwrite another prefix
                block.refs += 1  # held while its children are stored
                chain.append(block)
                parent = block
        finally:
            for block in chain:
                block.refs -= 1
        self._touch(chain)
        return new

    def _keep(self, block: Block, page: int) -> Block | None:
        """``block`` made resident on ``page`` when its parent is and room can be made, else written to the
        on-disk tier when there is one (a chain longer than memory goes on there); None when kept nowhere."""
        if self._resident(block.parent) and self._make_room():
            self._admit(block, page)
            self.counters.inserted += 1
            return block
        if self.directory is None:
            return None
        if self._path(block.key).is_file():
            block.on_disk = True
        else:
            self._write(block, page)
        return block if block.on_disk else None

    def _resident(self, block: Block | None) -> bool:
        return block is None or self.blocks.get(block.key) is block

    def _admit(self, block: Block, page: int) -> None:
        """Make ``block`` resident on ``page`` (the cache holds the page from now on)."""
        self.pool.hold([page])
        block.page = page
        self.blocks[block.key] = block
        if block.parent is not None:
            block.parent.children += 1

    def _evictable(self) -> Block | None:
        return next((b for b in self.blocks.values() if b.refs == 0 and b.children == 0), None)

    def _make_room(self) -> bool:
        """Evict least recently used free leaves until one more block fits the budget."""
        if self.block_bytes > self.max_bytes:
            return False
        while self.used_bytes + self.block_bytes > self.max_bytes:
            victim = self._evictable()
            if victim is None:
                return False
            self._evict(victim)
        return True

    def reclaim(self, pages: int) -> None:
        """Evict least recently used blocks until the pool has ``pages`` free, or nothing more can go (the
        pool asks before it refuses pages; blocks whose pages requests hold free nothing and stay)."""
        for block in list(self.blocks.values()):
            if self.pool.free >= pages:
                return
            if block.refs == 0 and block.children == 0 and self.pool.refs[block.page] == 1:
                self._evict(block)

    def _evict(self, block: Block) -> None:
        del self.blocks[block.key]
        if block.parent is not None:
            block.parent.children -= 1
        self.counters.evicted += 1
        if self.directory is not None and not block.on_disk:
            self._write(block, block.page)
        self.pool.release([block.page])
        block.page = None

    def _touch(self, chain: list[Block]) -> None:
        """Mark ``chain`` recently used, its root most recently: eviction then takes tails first."""
        for block in reversed(chain):
            if self.blocks.get(block.key) is block:
                self.blocks.move_to_end(block.key)

    # ---- the on-disk tier ----------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}.blk"

    def _write(self, block: Block, page: int) -> None:
        """Write ``block`` (held in ``page``) atomically; a full or read-only disk costs the block, never the
        request."""
        kv = self.pool.kv[: self.layers, page].contiguous().cpu()
        pe = self.pool.pe[: self.layers, page].contiguous().cpu()
        payload = kv.view(torch.uint8).numpy().tobytes() + pe.view(torch.uint8).numpy().tobytes()
        header = json.dumps({"fingerprint": self.fingerprint, "dtype": str(self.dtype).removeprefix("torch."),
                             "kv_shape": list(kv.shape), "pe_shape": list(pe.shape), "tokens": block.prefix(),
                             "next_token": block.next_token, "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        path = self._path(block.key)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".blk")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(MAGIC + struct.pack("<Q", len(header)) + header + payload)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            self._reject(f"cannot write {path.name}: {exc.strerror or exc}")
            return
        block.on_disk = True
        self.counters.disk_writes += 1

    def _read(self, key: bytes, prefix: Sequence[int], parent: Block | None) -> tuple[Block | None, int]:
        """The block ``key`` from disk when its file is sound and holds exactly ``prefix``, read into a page
        held once for the caller: (block, page), or (None, -1). The block becomes resident when there is
        room (else it serves this request only)."""
        if self.directory is None:
            return None, -1
        path = self._path(key)
        if not path.is_file():
            return None, -1
        try:
            kv, pe, next_token = self._parse(path.read_bytes(), prefix)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, json.JSONDecodeError, struct.error) as exc:
            self._reject(f"{path.name}: {exc}")
            path.unlink(missing_ok=True)  # named by this model's chain yet unusable: make way for a sound copy
            return None, -1
        try:
            page = self.pool.take(1)[0]
        except PoolFull:
            return None, -1
        self.pool.kv[: self.layers, page] = kv.to(self.pool.kv.device)
        self.pool.pe[: self.layers, page] = pe.to(self.pool.pe.device)
        block = Block(key, tuple(prefix[-self.block_tokens :]), parent, next_token=next_token, on_disk=True)
        self.counters.disk_reads += 1
        if key not in self.blocks and self._resident(parent) and self._make_room():
            self._admit(block, page)
        return block, page

    def _parse(self, data: bytes, prefix: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """kv, pe and the next token from a block file, or ValueError saying what does not check out."""
        if data[: len(MAGIC)] != MAGIC:
            raise ValueError("not a dsv3 prefix-cache block")
        (n,) = struct.unpack("<Q", data[len(MAGIC) : len(MAGIC) + 8])
        start = len(MAGIC) + 8
        head = json.loads(data[start : start + n])
        payload = data[start + n :]
        if head["fingerprint"] != self.fingerprint:
            raise ValueError("written by another model or cache layout")
        if head["dtype"] != str(self.dtype).removeprefix("torch.") or list(head["tokens"]) != list(prefix):
            raise ValueError("another dtype or another prefix")
        kv_shape, pe_shape = [int(x) for x in head["kv_shape"]], [int(x) for x in head["pe_shape"]]
        if kv_shape[:2] != [self.layers, self.block_tokens] or pe_shape[:2] != kv_shape[:2] or \
                kv_shape[2] != self.pool.kv.shape[3] or pe_shape[2] != self.pool.pe.shape[3]:
            raise ValueError(f"shapes {kv_shape}, {pe_shape} do not fit this cache")
        if hashlib.sha256(payload).hexdigest() != head["sha256"]:
            raise ValueError("checksum mismatch (corrupt or truncated)")
        item = torch.empty((), dtype=self.dtype).element_size()
        n_kv = item * kv_shape[0] * kv_shape[1] * kv_shape[2]
        if len(payload) != n_kv + item * pe_shape[0] * pe_shape[1] * pe_shape[2]:
            raise ValueError("payload size does not match the shapes")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return raw[:n_kv].view(self.dtype).view(kv_shape), raw[n_kv:].view(self.dtype).view(pe_shape), \
            int(head["next_token"])

    def _reject(self, reason: str) -> None:
        self.counters.disk_rejected += 1
        self.counters.disk_errors = (self.counters.disk_errors + [reason])[-8:]

    # ---- the engine's side ------------------------------------------------------------------------------
    def start(self, engine: Engine, requests: list[Request]) -> Batch:
        """``Engine.start`` with reuse: requests without a hit are prefilled together as usual; those with
        a hit from the end of their prefix, together when their prefix and prompt lengths agree (no
        padding then: a shared system prompt under a load generator's fixed lengths); then all are
        merged into one batch."""
        leases = {id(r): self.lease(r.prompt_ids) for r in requests}
        batches: list[Batch] = []
        try:
            misses = [r for r in requests if not leases[id(r)]]
            batches += self._prefill_together(engine, misses) if misses else []
            shapes: dict[tuple[int, int], list[Request]] = {}
            for r in requests:
                if leases[id(r)]:
                    shapes.setdefault((len(leases[id(r)]), len(r.prompt_ids)), []).append(r)
            for rows in shapes.values():
                given = [leases.pop(id(r)) for r in rows]  # the batch owns them from here on
                batches.append(PrefixBatch(engine, rows, given))
        except BaseException:
            for batch in batches:
                batch.release()
            raise
        finally:
            for pages in leases.values():
                self.pool.release(pages)
        return Engine._merged(batches) if batches else CachingBatch(engine, [])

    @staticmethod
    def _prefill_together(engine: Engine, requests: list[Request]) -> list[Batch]:
        """One padded batch, or one per request when padding poisoned it (as ``Engine.start`` does)."""
        try:
            return [CachingBatch(engine, requests)]
        except _Poisoned:
            return [CachingBatch(engine, [r]) for r in requests]


class CachingBatch(Batch):
    """A batch whose finished prefill gives its prompts' full blocks to the engine's prefix cache."""

    def _prefilled(self) -> None:
        cache: PrefixCache = self.engine.prefix_cache
        for b, row in enumerate(self.rows):
            if row.finish_reason == "error":  # its cache may hold NaN: keep none of it
                continue
            prompt = row.request.prompt_ids
            if self.shifts[b] == self.cur - len(prompt):  # prompts are left-padded: row b's ends at slot cur
                cache.insert(prompt, self.pages[b])


class PrefixBatch(CachingBatch):
    """Requests whose prompts start with cached blocks, all with the same prompt and prefix lengths: the
    blocks' pages head each row's page table and only the rest of each prompt is prefilled (at positions
    that continue from the prefix), with no padding."""

    def __init__(self, engine: Engine, requests: list[Request], leased: list[list[int]]):
        self.leased = {id(r): pages for r, pages in zip(requests, leased, strict=True)}
        super().__init__(engine, requests)

    @torch.inference_mode()
    def _prefill(self) -> list[Event]:
        self.cur = 0
        self._alloc([0] * len(self.rows))
        self.pages = [self.leased.pop(id(row.request)) for row in self.rows]
        for pages in self.leased.values():  # requests that could not start: their pages go back
            self.engine.pool.release(pages)
        self.leased = {}
        self._map()
        if not self.rows:  # no request could start (their error events are already out)
            return []
        cached = len(self.pages[0]) * self.engine.pool.page_tokens
        self._reserve(len(self.rows[0].request.prompt_ids) + self.T)
        for row in self.rows:
            row.request.cached_tokens = cached
        # with MTP from slot cached - 1: the last page's MTP entry is the request's own (see the module docstring)
        return self._prefill_from(cached - 1 if self.engine.speculative else cached)
