"""StreamingLLM (Xiao et al., 2023): attention sinks + a recent window, nothing else."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llm.eviction.base import EvictionPolicy

__all__ = ["StreamingLLM"]


class StreamingLLM(EvictionPolicy):
    """Keep the first ``sinks`` tokens and the most recent ones: the score is the slot index, which increases with
    the token's position, so the top-scored middle tokens are the most recent ones."""

    def score(self, layer_idx, keys: Tensor, values, queries, attention) -> Tensor:
        b, h, s = keys.shape[:3]
        return torch.arange(s, device=keys.device, dtype=torch.float32).expand(b, h, s)
