"""Prefix-aware routing for ``serve --ep``: a prompt goes to a prefill rank that already prefilled its prefix.

Every prefill rank keeps its own prefix cache (the blocks are its own latent cache; moving them between
ranks would cost what prefilling them saves on one machine's loopback). The front end therefore remembers
which ranks it gave which prompt blocks, keyed by the same kind of hash chain the caches use
(``prefix_cache.chain_hash``), and sends a new prompt to the least loaded of the ranks holding its longest
known prefix, while that rank has room; a prompt with no known prefix goes to the least loaded rank. What
the front end remembers is a hint, never trusted: a rank whose cache has evicted the blocks simply
prefills them again (its cache checks every hit against the tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dsv3.infer.prefix_cache import chain_hash

MAX_KEYS = 1 << 18  # blocks remembered (least recently given forgotten first): 16 bytes + a set each


class PrefixAffinity:
    def __init__(self, block_tokens: int, max_keys: int = MAX_KEYS):
        self.block_tokens, self.max_keys = block_tokens, max_keys
        self.holders: OrderedDict[bytes, set[int]] = OrderedDict()  # block key -> ranks given it

    def keys(self, prompt: Sequence[int]) -> list[bytes]:
        """The keys of the prompt's blocks a prefix cache may hold (those ending before its last token)."""
        bs, key, out = self.block_tokens, b"", []
        for i in range((len(prompt) - 1) // bs):
            key = chain_hash(key, tuple(prompt[i * bs : (i + 1) * bs]))
            out.append(key)
        return out

    def choose(self, prompt: Sequence[int], ranks: list[int], load: Sequence[int]) -> int:
        """One of ``ranks`` (those with room) for ``prompt``: among the ranks given its longest prefix, or all
        when none was, the least loaded; the choice is remembered."""
        keys = self.keys(prompt)
        candidates = list(ranks)
        for key in keys:
            holding = [r for r in candidates if r in self.holders.get(key, ())]
            if not holding:
                break
            candidates = holding
        rank = min(candidates, key=lambda r: load[r])
        self._remember(keys, rank)
        return rank

    def _remember(self, keys: list[bytes], rank: int) -> None:
        for key in keys:
            self.holders.setdefault(key, set()).add(rank)
            self.holders.move_to_end(key)
        while len(self.holders) > self.max_keys:
            self.holders.popitem(last=False)
