"""Fixtures shared by the speculative-decoding tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Tiny tensors on one torch thread: the pool only adds (spinning) waits on a loaded
    machine, which mutmut's CPU-time limit reads as a looping mutant."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
