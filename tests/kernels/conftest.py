"""Fixtures the kernel tests share."""

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    """The test at 1 and at 2 torch threads (the kernels split work across their OpenMP team); restores the
    process's setting after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
