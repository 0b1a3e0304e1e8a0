"""Packing: a token stream cut into fixed-length windows, served in a seed-determined order.

Window i covers tokens [i*L, i*L + L] (L + 1 tokens: inputs are the first L, labels the last L), so
consecutive windows share one token and every token of the stream is a label exactly once. Documents
are packed back to back with their end-of-document token between them (no cross-document masking, as
in V3). Each epoch visits every window once in a fresh permutation drawn from (seed, epoch); the whole
position in the data is one integer, the number of samples consumed, so resuming mid-epoch is exact.
"""

from __future__ import annotations

import numpy as np
import torch

from dsv3.errors import DSV3Error


class PackedSequences:
    """Fixed-length windows over a 1-D token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len < 1:
            raise DSV3Error(f"--seq-len must be positive, got {seq_len}")
        self.tokens, self.seq_len = tokens, seq_len
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
        """(input_ids [B, L], labels [B, L]) for the given windows."""
        rows = torch.from_numpy(np.stack([self.window(i) for i in indices]))
        return rows[:, :-1], rows[:, 1:]


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
