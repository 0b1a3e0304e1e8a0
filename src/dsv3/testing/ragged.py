"""A ragged batch decoded as the engine decodes one, teacher-forced, for the tests that compare decode paths
(the module path, the fast path, paged caches): left padding, per-row positions, and a hole where row 0's
second token was rejected, which every later step must skip."""

from __future__ import annotations

import torch


def ragged_mask(valid: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """bool [B, n, start + n]: the slots ``valid`` [B, >= start + n] allows, and each new token itself."""
    S = start + n
    return valid[:, None, :S] | (torch.arange(S)[None, :] == torch.arange(start, S)[:, None])[None]


def decode_ragged(decoder, cache, valid: torch.Tensor, L: int, pads: torch.Tensor, steps: int,
                  T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` teacher-forced steps of T tokens a row after a prefill of L slots (row b's first ``pads[b]``
    padding), the MTP layer after each: the main and MTP logits [steps, B, T, V]. ``valid`` [B, max_len] holds
    the prefill's slots and is updated as the engine's is."""
    B = pads.shape[0]
    main, mtp = [], []
    with torch.inference_mode():
        for s in range(steps):
            start = L + s * T
            new = torch.tensor([[(11 * s + 5 * b + t + 1) % 300 for t in range(T)] for b in range(B)])
            positions = (L - pads)[:, None] + s * T + torch.arange(T)
            valid[:, start : start + T] = True
            mask = ragged_mask(valid, start, T)
            h, logits = decoder.hidden_and_logits(new, positions=positions, cache=cache, start_pos=start, mask=mask)
            main.append(logits)
            h_mtp = decoder.mtp_hidden(0, h, (new + 7) % 300, positions, cache=cache, start_pos=start, mask=mask)
            mtp.append(decoder.mtp_logits(0, h_mtp))
            if s == 0:
                valid[0, start + T - 1] = False  # a rejected draft: a hole every later step must skip
    return torch.stack(main), torch.stack(mtp)
