"""Shared pytest setup: one CPU thread per test process (the dev machine is shared), fixed seeds.

The helpers every mixer test uses live in `tests/mixers/helpers.py`."""
from __future__ import annotations

import pytest
import torch

# Tiny shapes gain nothing from intra-op threads, and several test processes share 2 cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
    # a device-side assert surfaces at the next sync: make it fail the test that caused it, not a later one
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
