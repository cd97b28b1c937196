"""The eviction-policy interface and the budgeted KV cache (docs/methods.md §11).

A policy only *scores* cached tokens; the cache owns everything else: which tokens are protected (the first
``sinks`` and the most recent ``window``), how many are kept (``budget`` per layer, batch row and KV head), the
accounting, and the ``on_evict`` hook through which a latent memory can fold evicted tokens into a state.

How eviction fits Hugging Face's attention (checked against transformers 5.25; written to use only what 5.2 also
has: ``Cache``/``DynamicCache``/``DynamicLayer``, ``get_seq_length`` and ``get_mask_sizes`` -- the latter took a
``cache_position`` tensor in 5.2 and takes the query length in 5.25, and both are accepted here; not tested on 5.2):

* RoPE is applied before ``cache.update``, so a kept key keeps the rotation of its original position; evicting it
  never requires re-rotation.
* ``get_seq_length`` counts every token seen, so positions (``position_ids``/``cache_position``) of new tokens stay
  those of the uncompressed sequence.
* ``get_mask_sizes`` reports ``kv_length = kept + query_length`` and ``kv_offset = seen - kept``: the mask builder
  then treats the kept slots as if they were the ``kept`` positions just before the new tokens. The new tokens
  occupy the last ``query_length`` slots at their true positions, so causality among them is exact, and every kept
  slot is older than every new token, so it is visible (the same trick transformers' sliding-window layer uses).
* Eviction happens inside ``update`` *after* the new tokens are appended: the attention of the current forward
  sees all kept + new tokens, and the stored cache is then cut back to ``budget``. So the prompt is attended to in
  full at prefill and compressed at its end; each decode step re-compresses to ``budget``.

Attention-based policies (H2O, SnapKV) need the attention probabilities of the new queries. The default sdpa
attention does not expose them, so :meth:`BudgetedCache.attach` registers a forward pre-hook on every attention
module that recomputes the (RoPE-rotated) query states from the module's own ``q_proj`` (+ ``q_norm`` where the
model has one, as Qwen3 does) and the ``position_embeddings`` it is called with; the cache then computes
``softmax(q k^T * scaling)`` of those queries against the cached + new keys (GQA-aware, causal). This is
O(new x cached) memory per layer (O(prompt^2) at prefill unless a policy asks only for its last queries via
``attention_queries``), which is fine for research-scale models. Supported: Llama-style decoders whose attention
modules have ``q_proj``, ``head_dim``, ``scaling``, ``layer_idx`` and full rotary embeddings, with full-attention
layers (Llama, Mistral without sliding window, Qwen2/2.5, Qwen3) and, in hybrid models, sliding-window layers
(Gemma 2/3: ``layer_types`` naming ``sliding_attention`` layers and a ``sliding_window``).

Hybrid models: a sliding-window layer already keeps a bounded cache, the last ``sliding_window - 1`` tokens, as
transformers' own ``DynamicSlidingWindowLayer`` does (it is one); the policy scores and evicts only in the
full-attention layers, which keep ``budget`` tokens each. ``stats()``, ``kept_positions`` and ``peak_bytes`` count
both kinds: a sliding layer's ``evicted`` are the tokens that left its window. ``on_evict`` is called for the
policy's evictions only (tokens leaving a window are outside that layer's attention by design, not evicted).

Batches: every row and KV head keeps exactly ``budget`` slots (its own choice of which), so tensors stay
rectangular. Left-padded batches: :meth:`BudgetedCache.padded_mask` is told which new tokens are padding before
each forward and returns the 4D mask for it; pad slots are never attended to (a pad query sees only itself, so its
hidden state stays finite), count toward no policy score (their attention is masked, pad queries add no mass) and
are evicted before any real token. A row protects its first ``sinks`` *real* tokens. A row with fewer real tokens
than ``budget`` keeps all of them plus ``budget - real`` pad slots, which are the first slots of that row in
every layer and head (pads precede every real token), so one mask serves all layers. The kept real tokens of a
row are then those the row would keep alone with the same budget (tested: batched answers equal one-at-a-time
answers).
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

__all__ = [
    "BudgetedCache",
    "EvictionPolicy",
    "FullCache",
    "LayerStats",
    "OnEvict",
    "check_model",
    "rotated_queries",
    "sliding_layers",
]

#: ``on_evict(layer_idx, keys, values)``: keys/values ``[B, Hkv, n_evicted, D]`` in original order.
OnEvict = Callable[[int, Tensor, Tensor], None]


class EvictionPolicy(ABC):
    """Scores cached tokens; higher = keep. The cache keeps, per (layer, batch row, KV head), the first ``sinks``
    tokens, the most recent ``window`` tokens and the top-scored of the rest, ``budget`` tokens in total, in their
    original order.

    A policy may keep per-layer state (H2O's accumulated attention, SnapKV's prefill scores): the cache calls
    :meth:`reset` when it is created or reset, :meth:`score` on every update of a layer (whether or not it then
    evicts) and :meth:`prune` with the kept slot indices after every eviction. One policy instance serves one
    cache at a time.
    """

    #: Whether :meth:`score` needs the new queries / their attention probabilities (the cache hooks the model).
    needs_attention: bool = False
    #: Attention is computed only for this many of the newest queries of a forward (``None``: all of them).
    attention_queries: int | None = None
    #: ``False`` only for :class:`FullCache`.
    evicts: bool = True

    def __init__(self, sinks: int = 4, window: int = 16) -> None:
        if sinks < 0 or window < 0:
            raise ValueError(f"sinks and window must be >= 0, got sinks={sinks}, window={window}")
        self.sinks = int(sinks)
        self.window = int(window)

    @abstractmethod
    def score(
        self, layer_idx: int, keys: Tensor, values: Tensor, queries: Tensor | None, attention: Tensor | None
    ) -> Tensor:
        """Scores ``[B, Hkv, S]`` of the ``S`` slots of ``keys``/``values`` ``[B, Hkv, S, D]`` (kept + new tokens,
        in order). ``queries``: the new RoPE-rotated queries ``[B, Hq, q, D]``; ``attention``: their causal
        attention probabilities over the ``S`` slots, ``[B, Hq, q', S]`` for the last ``q'`` queries (see
        ``attention_queries``); both ``None`` unless ``needs_attention``."""

    def reset(self) -> None:
        """Forget per-generation state (no-op for stateless policies)."""
        return None

    def attach(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Context in which the policy may hook ``model`` (entered by :meth:`BudgetedCache.attach`); default none."""
        return contextlib.nullcontext()

    def prune(self, layer_idx: int, keep: Tensor) -> None:
        """The cache kept slots ``keep`` ``[B, Hkv, budget]`` (sorted indices into the scored slots)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sinks={self.sinks}, window={self.window})"


class FullCache(EvictionPolicy):
    """No eviction (the baseline); the budget is ignored."""

    evicts = False

    def __init__(self) -> None:
        super().__init__(sinks=0, window=0)

    def score(self, layer_idx, keys, values, queries, attention):  # pragma: no cover - never called
        return torch.zeros(keys.shape[:3], device=keys.device)


@dataclass
class LayerStats:
    """Per-layer accounting: tokens seen, kept now, evicted so far (``seen == kept + evicted``), peak kept."""

    seen: int = 0
    kept: int = 0
    evicted: int = 0
    peak_kept: int = 0


class _BudgetedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose length (``get_seq_length``) counts all tokens seen while only ``kept`` are stored."""

    is_croppable = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen = 0
        self.evicted = 0
        self.peak_kept = 0
        self.positions: Tensor | None = None
        #: ``[B, kept]`` pad flags of the kept slots (left-padded batches only) and ``[B]`` pads evicted so far.
        self.pad: Tensor | None = None
        self.evicted_pads: Tensor | int = 0

    @property
    def kept(self) -> int:
        return 0 if self.keys is None or not self.is_initialized else int(self.keys.shape[-2])

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.seen

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        # transformers 5.2 passes `cache_position` (a tensor of the new positions), 5.25 the query length
        q = int(query_length.shape[0]) if isinstance(query_length, Tensor) else int(query_length)
        return self.kept + q, self.seen - self.kept

    def update(self, key_states, value_states, *args, **kwargs):  # pragma: no cover - the cache bypasses it
        raise RuntimeError("BudgetedCache layers are updated through BudgetedCache.update")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a budgeted cache cannot be cropped (evicted tokens are gone)")

    def reset(self) -> None:
        super().reset()
        self.seen = self.evicted = self.peak_kept = 0
        self.positions = None
        self.pad = None
        self.evicted_pads = 0


class _SlidingLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window layer with the accounting of :class:`_BudgetedLayer` (``seen``, ``kept``,
    ``evicted``: tokens that left the window, ``peak_kept``, ``positions``)."""

    is_croppable = False

    def __init__(self, sliding_window: int) -> None:
        super().__init__(sliding_window=sliding_window)
        self.peak_kept = 0

    @property
    def seen(self) -> int:
        return self.cumulative_length

    @property
    def kept(self) -> int:
        return 0 if self.keys is None or not self.is_initialized else int(self.keys.shape[-2])

    @property
    def evicted(self) -> int:
        return self.seen - self.kept

    @property
    def positions(self) -> Tensor | None:
        if not self.is_initialized:
            return None
        b, h = self.keys.shape[:2]
        return torch.arange(self.seen - self.kept, self.seen, device=self.keys.device).expand(b, h, -1)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a budgeted cache cannot be cropped (evicted tokens are gone)")

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0
        self.peak_kept = 0


def sliding_layers(model: torch.nn.Module) -> dict[int, int]:
    """``{layer index: sliding window}`` of ``model``'s sliding-window layers (empty for all-full attention)."""
    config = model.config
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None) or []
    window = getattr(text_config, "sliding_window", None)
    return {i: int(window) for i, t in enumerate(layer_types) if t == "sliding_attention"}


def check_model(model: torch.nn.Module, needs_attention: bool) -> dict[int, torch.nn.Module]:
    """Validate that ``model`` is a decoder the cache supports; return its attention modules by layer index."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise ValueError("unsupported model: generate_with_budget needs a decoder-only transformers model")
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None) or []
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        raise ValueError(
            f"unsupported model ({config.model_type}): only full-attention and sliding-window layers are "
            f"supported, got layer types {other}"
        )
    if "sliding_attention" in layer_types and not getattr(text_config, "sliding_window", None):
        raise ValueError(
            f"unsupported model ({config.model_type}): sliding_attention layers without a sliding_window"
        )
    if layer_types and "full_attention" not in layer_types:
        raise ValueError(
            f"unsupported model ({config.model_type}): every layer is sliding-window, so no layer has a cache to "
            "budget"
        )
    n_layers = text_config.num_hidden_layers
    attn = {
        int(m.layer_idx): m
        for m in model.modules()
        if all(hasattr(m, a) for a in ("q_proj", "k_proj", "layer_idx", "head_dim", "scaling"))
    }
    if needs_attention:
        if sorted(attn) != list(range(n_layers)):
            raise ValueError(
                f"unsupported model ({config.model_type}): attention-based eviction needs Llama-style attention "
                "modules (q_proj, head_dim, scaling, layer_idx) on every layer"
            )
        if getattr(text_config, "partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"unsupported model ({config.model_type}): partial rotary embeddings")
        if getattr(text_config, "attn_logit_softcapping", None):
            raise ValueError(
                f"unsupported model ({config.model_type}): attention-based eviction recomputes softmax(q k^T) "
                "without the model's attention logit soft-capping; use a policy that needs no attention"
            )
    return attn


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotated_queries(module: torch.nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """The RoPE-rotated query states ``[B, Hq, q, D]`` an HF attention module computes from the inputs it is called
    with (a forward pre-hook's ``args``/``kwargs``): its own ``q_proj``, ``q_norm`` where present, and the
    ``position_embeddings`` it receives."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    pos_emb = kwargs.get("position_embeddings")
    if pos_emb is None:
        pos_emb = args[1]
    cos, sin = pos_emb
    q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim)
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin


class BudgetedCache(DynamicCache):
    """A ``DynamicCache`` that keeps at most ``budget`` tokens per layer, chosen by ``policy``.

    Use it through :func:`~lightning_llm.eviction.generate_with_budget`, or directly: build it for a model, wrap the
    forwards in ``with cache.attach(model):`` (needed by attention-based policies) and pass it as the model's cache.
    """

    def __init__(
        self,
        policy: EvictionPolicy,
        budget: int | None,
        num_layers: int,
        on_evict: OnEvict | None = None,
        sliding_windows: dict[int, int] | None = None,
    ) -> None:
        if not isinstance(policy, EvictionPolicy):
            raise TypeError(f"policy must be an EvictionPolicy, got {type(policy).__name__}")
        if policy.evicts:
            if budget is None:
                raise ValueError(f"{policy!r} needs a budget")
            if budget < policy.sinks + policy.window or budget < 1:
                raise ValueError(
                    f"budget ({budget}) must be >= sinks + window ({policy.sinks} + {policy.window}) and >= 1"
                )
        windows = dict(sliding_windows or {})
        if any(not 0 <= i < num_layers for i in windows) or any(w < 1 for w in windows.values()):
            raise ValueError(
                f"sliding_windows {windows} must map layer indices < {num_layers} to windows >= 1"
            )
        if windows and len(windows) == num_layers:
            raise ValueError("every layer is sliding-window: no layer has a cache to budget")
        layers = [_SlidingLayer(windows[i]) if i in windows else _BudgetedLayer() for i in range(num_layers)]
        # Cache.__init__ (not DynamicCache's) with pre-built layers: present in transformers 5.2 and 5.25
        super(DynamicCache, self).__init__(layers=layers)
        self.policy = policy
        self.budget = budget if policy.evicts else None
        self.on_evict = on_evict
        self.peak_bytes = 0
        self._bytes = [0] * num_layers
        self._pending: dict[int, tuple[Tensor, float]] = {}
        self.attended: dict[int, tuple[Tensor, int]] = {}
        #: ``[B, q]`` pad flags of the tokens of the current forward (set by :meth:`padded_mask`).
        self._new_pad: Tensor | None = None
        policy.reset()

    # -- accounting -------------------------------------------------------------------------------------------
    def stats(self) -> list[LayerStats]:
        return [LayerStats(lay.seen, lay.kept, lay.evicted, lay.peak_kept) for lay in self.layers]

    def kept_positions(self, layer_idx: int) -> Tensor:
        """Original positions ``[B, Hkv, kept]`` of the tokens layer ``layer_idx`` keeps."""
        return self.layers[layer_idx].positions

    def reset(self) -> None:
        super().reset()
        self.peak_bytes = 0
        self._bytes = [0] * len(self.layers)
        self._pending.clear()
        self.attended.clear()
        self._new_pad = None
        self.policy.reset()

    # -- padding ----------------------------------------------------------------------------------------------
    @property
    def padded(self) -> bool:
        """Whether this cache holds (or was told of) left padding."""
        return self._new_pad is not None

    def padded_mask(self, new_is_pad: Tensor, dtype: torch.dtype) -> Tensor:
        """The additive 4D attention mask ``[B, 1, q, kept + q]`` of the next forward, whose ``q`` new tokens have
        pad flags ``new_is_pad`` ``[B, q]`` (left padding: pads only before a row's first real token).

        A real query sees every kept real slot and the real new tokens up to itself; a pad query sees only itself.
        Pass the result as the model's ``attention_mask`` (a 4D mask is used as is). Records the flags for the
        following :meth:`update` of every layer.
        """
        if new_is_pad.ndim != 2:
            raise ValueError(f"new_is_pad must be [batch, new tokens], got shape {tuple(new_is_pad.shape)}")
        if any(isinstance(layer, _SlidingLayer) for layer in self.layers):
            raise ValueError("left-padded batches are not supported with sliding-window layers")
        new_is_pad = new_is_pad.bool()
        b, q = new_is_pad.shape
        layer = self.layers[0]
        kept = layer.kept if layer.is_initialized else 0
        # every layer holds the same pad flags between forwards (pads are the first slots of a row)
        old_pad = layer.pad if layer.pad is not None else new_is_pad.new_zeros((b, kept))
        if old_pad.shape != (b, kept):
            raise ValueError(f"cache holds {tuple(old_pad.shape)} slots, the new tokens are for batch {b}")
        dev = new_is_pad.device
        causal = torch.ones(q, q, dtype=torch.bool, device=dev).tril()
        new_ok = causal[None] & ~new_is_pad[:, None, :]
        new_ok = new_ok | torch.eye(q, dtype=torch.bool, device=dev)[None]
        old_ok = (~old_pad)[:, None, :].expand(b, q, kept) & ~new_is_pad[:, :, None]
        allowed = torch.cat([old_ok, new_ok], dim=-1)[:, None]
        self._new_pad = new_is_pad
        mask = torch.zeros(allowed.shape, dtype=dtype, device=dev)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)

    # -- query capture ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attach(self, model: torch.nn.Module) -> Iterator[BudgetedCache]:
        """Register (and on exit remove) the query-capturing hooks an attention-based policy needs."""
        modules = check_model(model, self.policy.needs_attention)
        handles = []
        if self.policy.needs_attention:
            for module in modules.values():
                handles.append(module.register_forward_pre_hook(self._capture_queries, with_kwargs=True))
        try:
            with self.policy.attach(model):
                yield self
        finally:
            for h in handles:
                h.remove()
            self._pending.clear()

    def set_queries(self, layer_idx: int, queries: Tensor, scaling: float) -> None:
        """Give the next update of layer ``layer_idx`` its new rotated queries ``[B, Hq, q, D]`` (what the hooks
        of :meth:`attach` capture during a forward), e.g. to replay a recorded prefill."""
        self._pending[int(layer_idx)] = (queries, float(scaling))

    def _capture_queries(self, module, args, kwargs) -> None:
        self._pending[int(module.layer_idx)] = (
            rotated_queries(module, args, kwargs).detach(),
            float(module.scaling),
        )

    @staticmethod
    def attention_logits(queries: Tensor, keys: Tensor, scaling: float, last: int | None = None) -> Tensor:
        """Causal scaled logits ``[B, Hq, q', S]`` (``-inf`` where masked) of the last ``q'`` (``last``, default
        all) of the new ``queries`` ``[B, Hq, q, D]`` over ``keys`` ``[B, Hkv, S, D]``, whose last ``q`` slots are
        the new tokens (grouped-query heads read KV head ``h // (Hq / Hkv)``)."""
        b, hq, q, d = queries.shape
        hkv, s = keys.shape[1], keys.shape[2]
        n = q if last is None else min(last, q)
        qg = queries[:, :, q - n :].float().reshape(b, hkv, hq // hkv, n, d)
        logits = torch.einsum("bhgqd,bhsd->bhgqs", qg, keys.float()) * scaling
        rows = torch.arange(q - n, q, device=keys.device) + (s - q)
        masked = torch.arange(s, device=keys.device)[None, :] > rows[:, None]
        return logits.masked_fill(masked, -math.inf).reshape(b, hq, n, s)

    @staticmethod
    def attention_probs(
        queries: Tensor, keys: Tensor, scaling: float, last: int | None = None, pad: Tensor | None = None
    ) -> Tensor:
        """Causal softmax attention ``[B, Hq, q', S]``: the softmax of :meth:`attention_logits`. With ``pad``
        ``[B, S]`` (pad flags of the slots, the new tokens last), pad slots get no attention and pad queries
        attend to nothing (their rows are zero)."""
        logits = BudgetedCache.attention_logits(queries, keys, scaling, last)
        if pad is None:
            return logits.softmax(dim=-1)
        n = logits.shape[2]
        query_pad = pad[:, pad.shape[1] - n :][:, None, :, None]  # the last n slots are the last n queries
        logits = logits.masked_fill(pad[:, None, None, :], -math.inf).masked_fill(query_pad, 0.0)
        return logits.softmax(dim=-1).masked_fill(query_pad, 0.0)

    # -- the update -------------------------------------------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        layer: _BudgetedLayer = self.layers[layer_idx]
        b, h, q, _ = key_states.shape
        if isinstance(layer, _SlidingLayer):
            if self.padded:
                raise RuntimeError("left-padded batches are not supported with sliding-window layers")
            self._pending.pop(layer_idx, None)
            keys, values = layer.update(key_states, value_states)
            self._account(layer_idx, layer, keys, q)
            return keys, values
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
            layer.keys = key_states.new_zeros((b, h, 0, key_states.shape[-1]))
            layer.values = value_states.new_zeros((b, h, 0, value_states.shape[-1]))
            layer.positions = torch.zeros((b, h, 0), dtype=torch.long, device=key_states.device)
        new_pos = torch.arange(layer.seen, layer.seen + q, device=key_states.device).expand(b, h, q)
        keys = torch.cat([layer.keys, key_states], dim=-2)
        values = torch.cat([layer.values, value_states], dim=-2)
        positions = torch.cat([layer.positions, new_pos], dim=-1)
        layer.seen += q
        pending = self._pending.pop(layer_idx, None)
        pad = None
        if self.padded:
            new_pad = self._new_pad
            if new_pad is None or new_pad.shape != (b, q):
                raise RuntimeError(f"padded cache: call padded_mask for the {q} new tokens of this forward")
            old_pad = layer.pad if layer.pad is not None else new_pad.new_zeros((b, 0))
            pad = torch.cat([old_pad, new_pad], dim=-1)
            # true positions: a row's slot index minus its pads (pads precede every real token); pads are -1
            num_pads = pad.sum(dim=-1) + layer.evicted_pads
            new_pos = (new_pos - num_pads[:, None, None]).masked_fill(new_pad[:, None, :], -1)
            positions = torch.cat([layer.positions, new_pos], dim=-1)
        policy = self.policy
        kept_k, kept_v, kept_p = keys, values, positions
        if policy.evicts:
            queries = attention = None
            if policy.needs_attention:
                if pending is None:
                    raise RuntimeError(
                        f"{policy!r} needs the attention queries: run the model inside `with cache.attach(model):`"
                    )
                queries, scaling = pending
                attention = self.attention_probs(queries, keys, scaling, policy.attention_queries, pad)
            scores = policy.score(layer_idx, keys, values, queries, attention)
            s = keys.shape[-2]
            if s > self.budget:
                keep = self._select(scores, s) if pad is None else self._select_padded(scores, s, pad)
                keep_mask = torch.zeros((b, h, s), dtype=torch.bool, device=keys.device)
                keep_mask.scatter_(-1, keep, True)
                drop = (~keep_mask).nonzero()[:, 2].view(b, h, s - self.budget)
                if self.on_evict is not None:
                    self.on_evict(layer_idx, _gather(keys, drop), _gather(values, drop))
                kept_k, kept_v, kept_p = (
                    _gather(keys, keep),
                    _gather(values, keep),
                    positions.gather(-1, keep),
                )
                layer.evicted += s - self.budget
                policy.prune(layer_idx, keep)
                if pad is not None:
                    kept_pad = pad.gather(-1, keep[:, 0])
                    layer.evicted_pads = layer.evicted_pads + pad.sum(dim=-1) - kept_pad.sum(dim=-1)
                    pad = kept_pad
        if pad is not None:
            layer.pad = pad
        layer.keys, layer.values, layer.positions = kept_k, kept_v, kept_p
        self._account(layer_idx, layer, keys, q)
        return keys, values

    def _account(self, layer_idx: int, layer, attended: Tensor, q: int) -> None:
        """Record what this forward attends to (the pre-eviction set) and its new-token count, for a memory that
        weighs its readout against the attended mass (``LatentMemory(mode="softmax")``; dropped by the next
        update), the layer's peak and the stored bytes."""
        self.attended[layer_idx] = (attended, q)
        layer.peak_kept = max(layer.peak_kept, layer.kept)
        self._bytes[layer_idx] = layer.keys.numel() * layer.keys.element_size() + (
            layer.values.numel() * layer.values.element_size()
        )
        self.peak_bytes = max(self.peak_bytes, sum(self._bytes))

    def _select(self, scores: Tensor, s: int) -> Tensor:
        """Sorted slot indices ``[B, Hkv, budget]``: sinks, the top-scored middle, the recent window."""
        sinks, window, budget = self.policy.sinks, self.policy.window, self.budget
        if scores.shape[-1] != s:
            raise ValueError(f"{self.policy!r}.score returned {scores.shape[-1]} scores for {s} slots")
        dev = scores.device
        b, h = scores.shape[:2]
        top = scores[..., sinks : s - window].topk(budget - sinks - window, dim=-1).indices + sinks
        fixed = torch.cat([torch.arange(sinks, device=dev), torch.arange(s - window, s, device=dev)])
        keep = torch.cat([fixed.expand(b, h, -1), top], dim=-1)
        return keep.sort(dim=-1).values

    def _select_padded(self, scores: Tensor, s: int, pad: Tensor) -> Tensor:
        """:meth:`_select` row by row on each row's real slots (its last ``s - pads`` slots); a row with at most
        ``budget`` real slots keeps them all and its last ``budget - real`` pad slots."""
        rows = []
        for row in range(scores.shape[0]):
            pads = int(pad[row].sum())
            real = s - pads
            if real > self.budget:
                rows.append(self._select(scores[row : row + 1, :, pads:], real) + pads)
            else:
                rows.append(
                    torch.arange(s - self.budget, s, device=scores.device).expand(1, scores.shape[1], -1)
                )
        return torch.cat(rows, dim=0)


def _gather(x: Tensor, idx: Tensor) -> Tensor:
    return x.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))
