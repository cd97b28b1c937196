"""Fixtures shared by the eviction tests: the tiny backbone and one random 30-token prompt."""

from __future__ import annotations

import pytest
import torch

#: Length of the shared prompt.
PROMPT = 30


@pytest.fixture(scope="module")
def model(tiny_backbone):
    torch.set_num_threads(1)
    return tiny_backbone[0]


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 500, (1, PROMPT), generator=g)  # no pad/eos ids: `generate` would mask them
