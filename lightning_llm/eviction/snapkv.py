"""SnapKV (Li et al., 2024): the last prompt queries (the observation window) vote for the prompt tokens to keep."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llm.eviction.base import EvictionPolicy

__all__ = ["SnapKV"]

#: Score offset of generated tokens: above any prefill score (which is <= observation_window x group size).
_GENERATED = 1e6


class SnapKV(EvictionPolicy):
    """At prefill, score = attention of the last ``observation_window`` prompt queries to every prompt token,
    summed over those queries and over the query heads of the KV group, then max-pooled along positions with
    ``kernel_size`` (odd; stride 1, same length), so neighbours of a voted token are kept too.

    During decoding the prompt scores stay fixed (no re-scoring) and generated tokens rank above every prompt
    token, older generated tokens below newer ones: when decoding overflows the budget, the lowest-voted prompt
    tokens go first, and only once the prompt is down to its sinks do generated tokens leave, oldest first. (The
    paper compresses the prompt once and keeps all generated tokens; this is its nearest behaviour under a hard
    budget.)

    ``pooling``: ``"max"`` (default, as above) max-pools the votes over *all* prompt positions, so the
    observation window's own votes spill into the last ``kernel_size // 2`` positions before it. ``"avg_prefix"``
    is kvpress's definition (``SnapKVPress``, 0.5): the votes of the positions before the observation window are
    average-pooled among themselves only (zero padding at the ends, as ``avg_pool1d``), and the observation
    window's own positions score above every one of them, so they are kept first. (kvpress averages where we sum,
    over the window's queries and the KV group; the ranking is the same.)
    """

    needs_attention = True

    def __init__(
        self,
        sinks: int = 4,
        window: int = 16,
        observation_window: int = 32,
        kernel_size: int = 5,
        pooling: str = "max",
    ) -> None:
        super().__init__(sinks=sinks, window=window)
        if observation_window < 1:
            raise ValueError(f"observation_window must be >= 1, got {observation_window}")
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd and >= 1, got {kernel_size}")
        if pooling not in ("max", "avg_prefix"):
            raise ValueError(f"pooling must be 'max' or 'avg_prefix', got {pooling!r}")
        self.pooling = pooling
        self.observation_window = int(observation_window)
        self.kernel_size = int(kernel_size)
        self.attention_queries = self.observation_window
        self._scores: dict[int, Tensor] = {}
        self._generated: dict[int, int] = {}

    def reset(self) -> None:
        self._scores = {}
        self._generated = {}

    def prefill_scores(self, attention: Tensor, num_kv_heads: int) -> Tensor:
        """``[B, Hkv, S]`` from the observation window's attention ``[B, Hq, w, S]``."""
        b, _, _, s = attention.shape
        votes = attention.sum(dim=2).reshape(b, num_kv_heads, -1, s).sum(dim=2)
        k = self.kernel_size
        if self.pooling == "max":
            pooled = F.max_pool1d(votes.reshape(-1, 1, s), kernel_size=k, stride=1, padding=k // 2)
            return pooled.reshape(b, num_kv_heads, s)
        w = min(self.observation_window, s)
        prefix = votes[..., : s - w].reshape(-1, 1, s - w)
        pooled = F.avg_pool1d(prefix, kernel_size=k, stride=1, padding=k // 2) if s > w else prefix
        # a vote is at most (queries x group) = the window's bound; the window's own slots rank above it
        top = float(attention.shape[1] // num_kv_heads * attention.shape[2]) + 1.0
        window_scores = votes.new_full((b * num_kv_heads, 1, w), top)
        return torch.cat([pooled, window_scores], dim=-1).reshape(b, num_kv_heads, s)

    def score(self, layer_idx, keys: Tensor, values, queries, attention: Tensor) -> Tensor:
        b, hkv, s = keys.shape[:3]
        prev = self._scores.get(layer_idx)
        if prev is None:
            scores = self.prefill_scores(attention, hkv).double()
        else:
            n_new = s - prev.shape[-1]
            start = self._generated.get(layer_idx, 0)
            new = _GENERATED + torch.arange(start, start + n_new, device=keys.device, dtype=torch.float64)
            self._generated[layer_idx] = start + n_new
            scores = torch.cat([prev, new.expand(b, hkv, n_new)], dim=-1)
        self._scores[layer_idx] = scores
        return scores

    def prune(self, layer_idx: int, keep: Tensor) -> None:
        self._scores[layer_idx] = self._scores[layer_idx].gather(-1, keep)
