r"""A learned eviction indexer (docs/methods.md §11): light per-layer scorers of past tokens, trained to match attention.

For layer :math:`\ell` with attention input :math:`h` (the hidden state after the layer's input norm), the
indexer has ``heads`` low-dimensional queries :math:`q_{t,j} = W^Q_j h_t \in \mathbb{R}^{d_I}`, one shared key
:math:`k_s = W^K h_s \in \mathbb{R}^{d_I}` per token and token-dependent head weights :math:`w_t = W^w h_t`:

.. math::

    I(t, s) = \sum_{j=1}^{H_I} w_{t,j}\,\mathrm{ReLU}(q_{t,j} \cdot k_s), \qquad s \le t.

It is trained (:class:`~lightning_llm.modules.IndexMemModule`) so that :math:`\mathrm{softmax}_s I(t, s)` matches the
layer's true attention distribution averaged over its query heads,
:math:`\mathcal{L} = \mathrm{KL}(\bar A_\ell(t, \cdot) \,\|\, \mathrm{softmax}_s I(t, \cdot))`, with the backbone
frozen. The target is either the current query's attention or (default) the mass each token seen so far will
receive from the current and all later queries (:func:`~lightning_llm.modules.indexmem.attention_target`), which is
what an eviction decision needs. At inference :class:`IndexerPolicy` scores every cached token by the newest
queries' indexer distribution (default: the newest query's), or by the mass accumulated from every query so far
(``accumulate=True``, the learned counterpart of H2O's accumulated attention). The indexer keys of kept tokens are cached
(``d_I`` floats per token and layer, shared by the KV heads); they are counted in
:attr:`IndexerPolicy.key_cache_bytes`.

Exact forms in the paper (arXiv 2605.25475, no public code) are unverified (docs/methods.md §11): the shared key, the
ReLU, the token-dependent weights and the KL target are DeepSeek-V3.2's lightning-indexer reading, the
accumulation rule is ours; ``heads``, ``dim`` and ``accumulate`` are parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from lightning_llm.eviction.base import EvictionPolicy, check_model

__all__ = ["IndexerPolicy", "LightningIndexer", "attention_input", "indexer_kl"]


class LightningIndexer(nn.Module):
    """One layer's indexer: ``I(t, s) = Σ_j w_tj · ReLU(q_tj · k_s)`` from the layer's attention input.

    Args:
        hidden_size: width of the backbone's hidden states.
        heads: indexer heads ``H_I``.
        dim: indexer query/key dim ``d_I``.
    """

    def __init__(self, hidden_size: int, heads: int = 4, dim: int = 16) -> None:
        super().__init__()
        if heads < 1 or dim < 1:
            raise ValueError(f"heads and dim must be >= 1, got heads={heads}, dim={dim}")
        self.heads, self.dim = int(heads), int(dim)
        self.query = nn.Linear(hidden_size, heads * dim, bias=False)
        self.key = nn.Linear(hidden_size, dim, bias=False)
        self.weight = nn.Linear(hidden_size, heads, bias=False)
        # Scale like attention logits so softmax(I) starts near uniform rather than saturated.
        self._scale = dim**-0.5

    def keys(self, hidden: Tensor) -> Tensor:
        """Indexer keys ``[B, T, d_I]`` of hidden states ``[B, T, hidden]``."""
        return self.key(hidden)

    def scores(self, hidden: Tensor, keys: Tensor, causal_offset: int | None = 0) -> Tensor:
        """``I(t, s)`` ``[B, Tq, S]`` for queries from ``hidden`` ``[B, Tq, hidden]`` over ``keys`` ``[B, S, d_I]``.

        ``causal_offset``: query ``t`` sits at slot ``t + causal_offset`` (slots after it get ``-inf``); ``None``:
        no mask. For a forward over new tokens appended to ``S - Tq`` cached slots, pass ``S - Tq``.
        """
        b, tq, _ = hidden.shape
        q = self.query(hidden).view(b, tq, self.heads, self.dim)
        w = self.weight(hidden)  # [B, Tq, H_I]
        dots = torch.relu(torch.einsum("bthd,bsd->bths", q, keys) * self._scale)
        scores = torch.einsum("bths,bth->bts", dots, w)
        if causal_offset is not None:
            s = keys.shape[1]
            rows = torch.arange(tq, device=keys.device)[:, None] + causal_offset
            scores = scores.masked_fill(torch.arange(s, device=keys.device)[None, :] > rows, float("-inf"))
        return scores


def indexer_kl(scores: Tensor, attention: Tensor, mask: Tensor | None = None) -> Tensor:
    r"""Mean over query rows of :math:`\mathrm{KL}(A(t,\cdot) \| \mathrm{softmax}_s I(t,\cdot))`.

    ``scores`` ``[B, T, S]`` (``-inf`` where masked), ``attention`` ``[B, T, S]`` (rows sum to 1, the head-averaged
    attention), ``mask`` ``[B, T]`` selects the rows that count (default all).
    """
    logq = torch.log_softmax(scores.float(), dim=-1)
    p = attention.float()
    kl = (p * (torch.log(p.clamp_min(1e-12)) - logq.clamp_min(-1e4))).masked_fill(p <= 0, 0.0).sum(-1)
    if mask is None:
        return kl.mean()
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp_min(1.0)


def attention_input(module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """The hidden states an HF attention module was called with (forward pre-hook ``args``/``kwargs``)."""
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


class IndexerPolicy(EvictionPolicy):
    """Evict by learned indexer scores (one :class:`LightningIndexer` per layer).

    Each cached token's score is its indexer mass ``softmax_s I(t, s)`` summed over the last
    ``observation_window`` queries of the newest forward (default; at prefill, the last prompt queries, while
    decoding, the new token's) or over every query seen so far (``accumulate=True``). Scores are shared by the KV heads of a layer. The policy hooks the
    attention modules itself (through the cache's ``attach``) to read their inputs.

    Args:
        indexers: one indexer per layer, in layer order (e.g. ``IndexMemModule.indexers``).
        sinks, window: always-kept first / most recent tokens.
        accumulate: accumulate mass over all queries (H2O-style) rather than only the newest.
        observation_window: with ``accumulate=False``, how many of a forward's last queries vote.
    """

    def __init__(
        self,
        indexers: nn.ModuleList | list[LightningIndexer],
        sinks: int = 4,
        window: int = 16,
        accumulate: bool = False,
        observation_window: int = 1,
    ) -> None:
        super().__init__(sinks=sinks, window=window)
        if len(indexers) == 0:
            raise ValueError("IndexerPolicy needs one indexer per layer, got none")
        if observation_window < 1:
            raise ValueError(f"observation_window must be >= 1, got {observation_window}")
        self.indexers = list(indexers)
        self.accumulate = bool(accumulate)
        self.observation_window = int(observation_window)
        self._keys: dict[int, Tensor] = {}
        self._acc: dict[int, Tensor] = {}
        self._pending: dict[int, Tensor] = {}

    def reset(self) -> None:
        self._keys, self._acc, self._pending = {}, {}, {}

    @property
    def key_cache_bytes(self) -> int:
        """Bytes of the cached indexer keys now (all layers)."""
        return sum(k.numel() * k.element_size() for k in self._keys.values())

    @contextlib.contextmanager
    def attach(self, model: nn.Module) -> Iterator[None]:
        modules = check_model(model, needs_attention=False)
        if sorted(modules) != list(range(len(self.indexers))):
            raise ValueError(
                f"IndexerPolicy has {len(self.indexers)} indexers but the model has attention layers "
                f"{sorted(modules)}"
            )
        handles = [m.register_forward_pre_hook(self._capture, with_kwargs=True) for m in modules.values()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self._pending.clear()

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._pending[int(module.layer_idx)] = attention_input(module, args, kwargs)

    @torch.no_grad()
    def score(self, layer_idx, keys: Tensor, values, queries, attention) -> Tensor:
        hidden = self._pending.pop(layer_idx, None)
        if hidden is None:
            raise RuntimeError(
                f"{self!r} needs the attention inputs: run the model inside `with cache.attach(model):`"
            )
        b, hkv, s = keys.shape[:3]
        indexer = self.indexers[layer_idx]
        hidden = hidden.to(indexer.key.weight.dtype)
        prev = self._keys.get(layer_idx)
        new_keys = indexer.keys(hidden)
        all_keys = new_keys if prev is None else torch.cat([prev, new_keys], dim=1)
        tq = hidden.shape[1]
        if not self.accumulate:
            n = min(tq, self.observation_window)
            hidden, offset = hidden[:, tq - n :], s - n
        else:
            offset = s - tq
        mass = indexer.scores(hidden, all_keys, causal_offset=offset).float().softmax(dim=-1).sum(dim=1)
        if self.accumulate:
            acc = self._acc.get(layer_idx)
            if acc is not None:
                mass = mass + torch.cat([acc, acc.new_zeros((b, s - acc.shape[-1]))], dim=-1)
            self._acc[layer_idx] = mass
        self._keys[layer_idx] = all_keys
        return mass[:, None, :].expand(b, hkv, s)

    def prune(self, layer_idx: int, keep: Tensor) -> None:
        # Scores are shared by the KV heads, so every head keeps the same slots: prune with head 0's choice.
        idx = keep[:, 0]
        keys = self._keys[layer_idx]
        self._keys[layer_idx] = keys.gather(1, idx[..., None].expand(-1, -1, keys.shape[-1]))
        if self.accumulate:
            self._acc[layer_idx] = self._acc[layer_idx].gather(-1, idx)

    def __repr__(self) -> str:
        return (
            f"IndexerPolicy(layers={len(self.indexers)}, sinks={self.sinks}, window={self.window}, "
            f"accumulate={self.accumulate})"
        )
