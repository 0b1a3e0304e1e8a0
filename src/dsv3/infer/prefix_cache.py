"""Paged prefix cache: fixed-size blocks of the MLA latent cache reused across requests.

A prompt is cut into blocks of ``block_tokens`` tokens. Block i's key is a hash of block i - 1's key
and block i's tokens (a hash chain), so a key names a whole prefix. A block holds what the latent
cache holds for its slots: c_KV and the roped k_R of every layer, the MTP layer's too when the engine
speculates (MLA's cache is small enough to keep and move: 70 KB per token for V3). A request whose
prompt starts with cached blocks copies them into its own working cache (which stays contiguous, so
decoding is unchanged) and prefills only the rest, its positions continuing from the prefix.

Correctness rules:

- A hit is checked, not trusted: a block matches only when its own tokens equal the prompt's and its
  parent is the block matched just before, so a hash collision can never serve another prompt's
  blocks (the on-disk tier stores the whole prefix and compares it).
- Only blocks that end before the prompt's last token are cached or reused: that token is always
  prefilled, since its logits give the first reply token.
- The MTP layer's entry at slot j reads token j + 1, so it belongs to the block holding token j + 1:
  a block keeps the MTP entries of the slots one to its left (block 0's first is unused). A reused
  prefix of P tokens then brings MTP entries up to slot P - 2; with speculation the prefill starts one
  slot early and writes slot P - 1 (the main layers' entry there comes out the same).
- Eviction is LRU under a byte budget over blocks that no request holds and that have no cached
  children (a chain is freed from its tail, never leaving unreachable blocks behind).

On-disk tier (``directory``): an evicted block is written there atomically (temporary file, fsync,
rename) and read back on a later miss, as DeepSeek's context cache keeps prefixes on disk. A file is
used only when its magic, model fingerprint, dtype, shapes, full prefix tokens and SHA-256 all check
out; anything else (a corrupt, truncated or foreign file) is ignored, counted and removed, so that the
block is written afresh. A chain longer than the memory budget goes to disk block by block.
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
from dsv3.model.mla import LatentCache

Hasher = Callable[[bytes, tuple[int, ...]], bytes]
MAGIC = b"DSV3PFX1"
DEFAULT_BLOCK_TOKENS = 16


def chain_hash(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The key of a block: BLAKE2b over its parent's key and its own token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass(eq=False)
class Block:
    """One cached block: kv [layers, n, r] and pe [layers, n, rope] of ``tokens``, after ``parent``."""

    key: bytes
    tokens: tuple[int, ...]
    parent: Block | None
    kv: torch.Tensor
    pe: torch.Tensor
    refs: int = 0  # requests copying it right now: not evictable
    children: int = 0  # resident blocks whose parent it is: not evictable (they would be unreachable)
    on_disk: bool = False

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.pe.nbytes

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
    """Blocks of the latent cache keyed by a hash chain of token ids; see the module docstring."""

    def __init__(self, model, max_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS, speculative: bool = False,
                 dtype: torch.dtype | None = None, directory: str | Path | None = None,
                 hasher: Hasher = chain_hash):
        if block_tokens < 1:
            raise DSV3Error(f"the prefix cache's block size must be >= 1 token, got {block_tokens}")
        if max_bytes < 0:
            raise DSV3Error(f"the prefix cache's size must be >= 0 bytes, got {max_bytes}")
        cfg = model.config
        self.block_tokens, self.max_bytes, self.hasher = block_tokens, max_bytes, hasher
        self.main_layers = cfg.num_hidden_layers
        self.layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if speculative else 0)
        self.dtype = dtype or next(model.parameters()).dtype
        self.device = model.inv_freq.device
        self.fingerprint = model_fingerprint(model, self.dtype, self.layers, block_tokens)
        self.root = bytes.fromhex(self.fingerprint)[:16]  # the chain starts from the model: no cross-model keys
        self.directory = Path(directory) if directory is not None else None
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DSV3Error(f"cannot use {self.directory} as the prefix cache folder: "
                                f"{exc.strerror or exc}") from None
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.used_bytes = 0
        self.counters = CacheCounters()

    @classmethod
    def for_engine(cls, engine: Engine, max_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                   directory: str | Path | None = None, hasher: Hasher = chain_hash) -> PrefixCache:
        """A cache laid out as ``engine``'s latent cache, attached to it (``engine.start`` then uses it)."""
        cache = cls(engine.model, max_bytes, block_tokens, engine.speculative, engine.cache_dtype, directory, hasher)
        engine.prefix_cache = cache
        return cache

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

    def match(self, prompt: Sequence[int]) -> list[Block]:
        """The longest cached chain of full blocks that starts ``prompt``, each held (``release`` it)."""
        bs, chain = self.block_tokens, []
        key, parent = self.root, None
        for i in range(self.usable_blocks(len(prompt))):
            tokens = tuple(prompt[i * bs : (i + 1) * bs])
            key = self.hasher(key, tokens)
            block = self.blocks.get(key)
            if block is None or block.tokens != tokens or block.parent is not parent:
                block = self._read(key, prompt[: (i + 1) * bs], parent)
                if block is None:
                    break
            block.refs += 1
            chain.append(block)
            parent = block
        self._touch(chain)
        self.counters.queries += len(prompt)
        self.counters.hits += len(chain) * bs
        return chain

    def release(self, chain: list[Block]) -> None:
        for block in chain:
            block.refs -= 1

    def copy_into(self, cache: LatentCache, row: int, chain: list[Block]) -> int:
        """Write ``chain`` into row ``row`` of ``cache`` (its slot j the prompt's token j): the main layers'
        slots [0, n), the MTP layers' [0, n - 1) (see the module docstring); returns n."""
        n, m = len(chain) * self.block_tokens, self.main_layers
        kv, pe = (torch.cat(part, dim=1) for part in ([b.kv for b in chain], [b.pe for b in chain]))  # [layers, n, .]
        cache.write_row(row, 0, kv[:m], pe[:m])
        if self.layers > m:  # MTP layers hold slots -1 .. n - 2
            cache.write_row(row, 0, kv[m:, 1:], pe[m:, 1:], first_layer=m)
        return n

    def _block_slice(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Block i's share of a prefilled row t [layers, len, .]: main slots [s, e), MTP slots [s - 1, e - 1)."""
        s, e, m = i * self.block_tokens, (i + 1) * self.block_tokens, self.main_layers
        mtp = t[m : self.layers, max(s - 1, 0) : e - 1]
        if s == 0:
            mtp = torch.cat([mtp.new_zeros(mtp.shape[0], 1, mtp.shape[2]), mtp], dim=1)
        return torch.cat([t[:m, s:e], mtp], dim=0)

    # ---- insertion and eviction ----------------------------------------------------------------
    def insert(self, prompt: Sequence[int], kv: torch.Tensor, pe: torch.Tensor) -> int:
        """Store the usable blocks of ``prompt`` from its prefilled cache kv [layers, len, r] (slot j holds
        token j); blocks already cached are only touched. Returns the number of new blocks."""
        bs, key, parent, chain, new = self.block_tokens, self.root, None, [], 0
        try:
            for i in range(self.usable_blocks(len(prompt))):
                tokens = tuple(prompt[i * bs : (i + 1) * bs])
                key = self.hasher(key, tokens)
                block = self.blocks.get(key)
                if block is None:
                    block = self._keep(Block(key, tokens, parent, self._block_slice(kv, i), self._block_slice(pe, i)))
                    if block is None:
                        break
                    new += 1
                elif block.tokens != tokens or block.parent is not parent:
                    break  # a collision, or a chain we could not keep whole: never overwrite another prefix
                block.refs += 1  # held while its children are stored
                chain.append(block)
                parent = block
        finally:
            self.release(chain)
        self._touch(chain)
        return new

    def _keep(self, block: Block) -> Block | None:
        """``block`` made resident when its parent is and room can be made, else written to the on-disk
        tier when there is one (a chain longer than memory goes on there); None when kept nowhere."""
        if self._resident(block.parent) and self._make_room(block.nbytes):
            self._admit(block)
            self.counters.inserted += 1
            return block
        if self.directory is None:
            return None
        if self._path(block.key).is_file():
            block.on_disk = True
        else:
            self._write(block)
        return block if block.on_disk else None

    def _resident(self, block: Block | None) -> bool:
        return block is None or self.blocks.get(block.key) is block

    def _admit(self, block: Block) -> None:
        self.blocks[block.key] = block
        self.used_bytes += block.nbytes
        if block.parent is not None:
            block.parent.children += 1

    def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used free leaves until ``nbytes`` more fit the budget."""
        if nbytes > self.max_bytes:
            return False
        while self.used_bytes + nbytes > self.max_bytes:
            victim = next((b for b in self.blocks.values() if b.refs == 0 and b.children == 0), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, block: Block) -> None:
        del self.blocks[block.key]
        self.used_bytes -= block.nbytes
        if block.parent is not None:
            block.parent.children -= 1
        self.counters.evicted += 1
        if self.directory is not None and not block.on_disk:
            self._write(block)

    def _touch(self, chain: list[Block]) -> None:
        """Mark ``chain`` recently used, its root most recently: eviction then takes tails first."""
        for block in reversed(chain):
            if self.blocks.get(block.key) is block:
                self.blocks.move_to_end(block.key)

    # ---- the on-disk tier ----------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}.blk"

    def _write(self, block: Block) -> None:
        """Write ``block`` atomically; a full or read-only disk costs the block, never the request."""
        kv, pe = block.kv.contiguous().cpu(), block.pe.contiguous().cpu()
        payload = kv.view(torch.uint8).numpy().tobytes() + pe.view(torch.uint8).numpy().tobytes()
        header = json.dumps({"fingerprint": self.fingerprint, "dtype": str(self.dtype).removeprefix("torch."),
                             "kv_shape": list(kv.shape), "pe_shape": list(pe.shape), "tokens": block.prefix(),
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode()
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

    def _read(self, key: bytes, prefix: Sequence[int], parent: Block | None) -> Block | None:
        """The block ``key`` from disk when its file is sound and holds exactly ``prefix``; it becomes
        resident when there is room (else it serves this request only)."""
        if self.directory is None:
            return None
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            kv, pe = self._parse(path.read_bytes(), prefix)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, json.JSONDecodeError, struct.error) as exc:
            self._reject(f"{path.name}: {exc}")
            path.unlink(missing_ok=True)  # named by this model's chain yet unusable: make way for a sound copy
            return None
        block = Block(key, tuple(prefix[-self.block_tokens :]), parent, kv.to(self.device), pe.to(self.device),
                      on_disk=True)
        self.counters.disk_reads += 1
        if key not in self.blocks and self._resident(parent) and self._make_room(block.nbytes):
            self._admit(block)
        return block

    def _parse(self, data: bytes, prefix: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """kv, pe from a block file, or ValueError saying what does not check out."""
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
        if kv_shape[:2] != [self.layers, self.block_tokens] or pe_shape[:2] != kv_shape[:2]:
            raise ValueError(f"shapes {kv_shape}, {pe_shape} do not fit this cache")
        if hashlib.sha256(payload).hexdigest() != head["sha256"]:
            raise ValueError("checksum mismatch (corrupt or truncated)")
        item = torch.empty((), dtype=self.dtype).element_size()
        n_kv = item * kv_shape[0] * kv_shape[1] * kv_shape[2]
        if len(payload) != n_kv + item * pe_shape[0] * pe_shape[1] * pe_shape[2]:
            raise ValueError("payload size does not match the shapes")
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return raw[:n_kv].view(self.dtype).view(kv_shape), raw[n_kv:].view(self.dtype).view(pe_shape)

    def _reject(self, reason: str) -> None:
        self.counters.disk_rejected += 1
        self.counters.disk_errors = (self.counters.disk_errors + [reason])[-8:]

    # ---- the engine's side ------------------------------------------------------------------------------
    def start(self, engine: Engine, requests: list[Request]) -> Batch:
        """``Engine.start`` with reuse: requests without a hit are prefilled together as usual; those with
        a hit from the end of their prefix, together when their prefix and prompt lengths agree (no
        padding then: a shared system prompt under a load generator's fixed lengths); then all are
        merged into one batch."""
        plans = [(r, self.match(r.prompt_ids)) for r in requests]
        try:
            misses = [r for r, chain in plans if not chain]
            batches = self._prefill_together(engine, misses) if misses else []
            shapes: dict[tuple[int, int], list[tuple[Request, list[Block]]]] = {}
            for r, chain in plans:
                if chain:
                    shapes.setdefault((len(chain), len(r.prompt_ids)), []).append((r, chain))
            batches += [PrefixBatch(engine, [r for r, _ in group], [c for _, c in group]) for group in shapes.values()]
        finally:
            for _, chain in plans:
                self.release(chain)
        return Engine._merged(batches) if batches else CachingBatch(engine, [])

    @staticmethod
    def _prefill_together(engine: Engine, requests: list[Request]) -> list[Batch]:
        """One padded batch, or one per request when padding poisoned it (as ``Engine.start`` does)."""
        try:
            return [CachingBatch(engine, requests)]
        except _Poisoned:
            return [CachingBatch(engine, [r]) for r in requests]


class CachingBatch(Batch):
    """A batch whose finished prefill stores its prompts' blocks in the engine's prefix cache."""

    def _prefilled(self) -> None:
        cache: PrefixCache = self.engine.prefix_cache
        for b, row in enumerate(self.rows):
            if row.finish_reason == "error":  # its cache may hold NaN: keep none of it
                continue
            prompt = row.request.prompt_ids
            first = self.cur - len(prompt)  # prompts are left-padded: row b's ends at slot cur
            cache.insert(prompt, *self.cache.read_row(b, first, self.cur))


class PrefixBatch(CachingBatch):
    """Requests whose prompts start with cached blocks, all with the same prompt and prefix lengths: the
    blocks are copied into each row's cache and only the rest of each prompt is prefilled (at positions
    that continue from the prefix), with no padding."""

    def __init__(self, engine: Engine, requests: list[Request], chains: list[list[Block]]):
        self.chains = {id(r): chain for r, chain in zip(requests, chains, strict=True)}
        super().__init__(engine, requests)

    @torch.inference_mode()
    def _prefill(self) -> list[Event]:
        self.cur = 0
        self._alloc([0] * len(self.rows))
        if not self.rows:  # no request could start (their error events are already out)
            return []
        self._reserve(len(self.rows[0].request.prompt_ids) + self.T)
        for b, row in enumerate(self.rows):
            chain = self.chains[id(row.request)]
            row.request.cached_tokens = self.engine.prefix_cache.copy_into(self.cache, b, chain)
        cached = self.rows[0].request.cached_tokens
        # with MTP from slot cached - 1: the blocks lack its MTP entry (see the module docstring)
        return self._prefill_from(cached - 1 if self.engine.speculative else cached)


def parse_size(text: str, flag: str) -> int:
    """Bytes from '0', '512M', '1.5G' (powers of 1000, as the reports print them) or '64Ki', '2GiB'
    (powers of 1024): one clear error otherwise."""
    s = text.strip().upper().removesuffix("B")
    binary = s.endswith("I")
    s = s.removesuffix("I")
    unit = s[-1:] if s[-1:] in ("K", "M", "G", "T") else ""
    scale = (1024 if binary else 1000) ** ("KMGT".index(unit) + 1) if unit else 1
    try:
        value = float(s[: len(s) - len(unit)])
    except ValueError:
        raise DSV3Error(f"{flag} must be a size such as 0, 512M or 2G, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise DSV3Error(f"{flag} must be >= 0, got {text!r}")
    return int(value * scale)
