"""Test-wide settings: one torch thread (tiny models run faster without intra-op threading, and the
suite shares two cores)."""

import torch

torch.set_num_threads(1)
