"""H2O, heavy-hitter oracle (Zhang et al., 2023): keep the tokens that have received the most attention."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llm.eviction.base import EvictionPolicy

__all__ = ["H2O"]


class H2O(EvictionPolicy):
    """Score = attention mass each cached token has accumulated from every query so far (prefill queries
    included), summed over the query heads of its KV group. Mass is observed over the slots that were cached when
    a query ran, i.e. after earlier evictions, as in the paper's online variant."""

    needs_attention = True

    def __init__(self, sinks: int = 4, window: int = 16) -> None:
        super().__init__(sinks=sinks, window=window)
        self._acc: dict[int, Tensor] = {}

    def reset(self) -> None:
        self._acc = {}

    def score(self, layer_idx, keys: Tensor, values, queries, attention: Tensor) -> Tensor:
        b, hkv, s = keys.shape[:3]
        mass = attention.sum(dim=2)  # [B, Hq, S]
        mass = mass.reshape(b, hkv, -1, s).sum(dim=2)
        prev = self._acc.get(layer_idx)
        if prev is None:
            prev = mass.new_zeros((b, hkv, 0))
        acc = torch.cat([prev, mass.new_zeros((b, hkv, s - prev.shape[-1]))], dim=-1) + mass
        self._acc[layer_idx] = acc
        return acc

    def prune(self, layer_idx: int, keep: Tensor) -> None:
        self._acc[layer_idx] = self._acc[layer_idx].gather(-1, keep)
