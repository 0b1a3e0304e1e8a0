"""Packing: a token stream cut into fixed-length windows, served in a seed-determined order.

Window i covers tokens [i*L, i*L + L] (L + 1 tokens: inputs are the first L, labels the last L), so
consecutive windows share one token and every token of the stream is a label exactly once. Documents are
packed back to back with their end-of-document token between them (no cross-document masking, as in V3).
With a loss mask (chat fine-tuning: the assistant's tokens only), a label outside it is
``IGNORE_INDEX``, which every loss skips; the mask travels with the tokens through the packing. Each
epoch visits every window once in a fresh permutation drawn from (seed, epoch); the whole position in
the data is one integer, the number of samples consumed, so resuming mid-epoch is exact.
"""

from __future__ import annotations

import numpy as np
import torch

from dsv3.data.chat_sft import IGNORE_INDEX
from dsv3.errors import DSV3Error


class PackedSequences:
    """Fixed-length windows over a 1-D token stream; ``mask`` (bool, one per token, or None for all)
    says which tokens are labels the loss covers."""

    def __init__(self, tokens: np.ndarray, seq_len: int, mask: np.ndarray | None = None):
        if seq_len < 1:
            raise DSV3Error(f"--seq-len must be positive, got {seq_len}")
        if mask is not None and len(mask) != len(tokens):
            raise DSV3Error(f"the loss mask has {len(mask)} entries for {len(tokens)} tokens")
        self.tokens, self.seq_len, self.mask = tokens, seq_len, mask
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DSV3Error(
                f"the token stream has {len(tokens)} tokens, too few for one sequence of "
                f"{seq_len} + 1; use a smaller --seq-len or more data"
            )

    def __len__(self) -> int:
        return self.n_windows

    def window(self, i: int) -> np.ndarray:
        """Tokens [L + 1] of window i."""
        start = i * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, L], labels [B, L]) for the given windows; labels outside the mask are IGNORE_INDEX."""
        rows = torch.from_numpy(np.stack([self.window(i) for i in indices]))
        labels = rows[:, 1:]
        if self.mask is not None:
            starts = [i * self.seq_len + 1 for i in indices]
            keep = torch.from_numpy(np.stack([np.asarray(self.mask[s : s + self.seq_len], dtype=bool) for s in starts]))
            labels = labels.masked_fill(~keep, IGNORE_INDEX)
        return rows[:, :-1], labels


class SampleOrder:
    """Sample k of the whole run (k = 0, 1, ...) -> window index: epoch k // n, a fresh permutation of
    the n windows per epoch, drawn from a generator seeded by (seed, epoch)."""

    def __init__(self, n_windows: int, seed: int):
        self.n, self.seed = n_windows, seed
        self._epoch, self._perm = -1, None

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return self._perm

    def indices(self, start: int, count: int) -> list[int]:
        """Window indices of samples start .. start + count - 1 (crossing epochs when needed)."""
        return [int(self.permutation(k // self.n)[k % self.n]) for k in range(start, start + count)]

    def epoch_of(self, sample: int) -> float:
        return sample / self.n
