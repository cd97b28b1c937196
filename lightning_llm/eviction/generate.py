"""``generate_with_budget``: greedy / sampled decoding under a KV budget, with a small manual loop.

A manual loop (prefill, then one token per forward) rather than ``model.generate``: it passes explicit
``position_ids``, owns the cache object and never relies on ``generate``'s cache bookkeeping (cropping, cache
position arithmetic), which changes between transformers releases and assumes kept == seen.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_llm.backbones import eval_mode
from lightning_llm.backbones.inspect import cache_kwarg
from lightning_llm.eviction.base import (
    BudgetedCache,
    EvictionPolicy,
    FullCache,
    LayerStats,
    OnEvict,
    check_model,
    rotated_queries,
    sliding_layers,
)
from lightning_llm.eviction.memory import LatentMemory

__all__ = ["GenerationResult", "Prefill", "generate_with_budget", "record_prefill"]

_SUPPORTED = ("temperature", "top_k", "top_p", "eos_token_id", "pad_token_id", "generator", "output_logits")


@dataclass
class GenerationResult:
    """``sequences`` ``[B, prompt + new]``; ``cache_stats`` per layer; ``peak_cache_bytes``: the largest total size
    of the stored keys + values over the run (after each eviction; the transient concatenation of one layer's new
    tokens is not counted); ``logits`` ``[B, new, V]`` (float32) when ``output_logits=True``;
    ``step_seconds``/``step_cpu_seconds``: wall-clock and process CPU seconds of each forward (the first is the
    prefill, or the compression of a recorded :class:`Prefill`)."""

    sequences: Tensor
    cache_stats: list[LayerStats]
    peak_cache_bytes: int
    logits: Tensor | None = None
    step_seconds: list[float] = field(default_factory=list)
    step_cpu_seconds: list[float] = field(default_factory=list)


@dataclass
class Prefill:
    """One prompt forward, recorded by :func:`record_prefill` so that :func:`generate_with_budget` can compress it
    under several policies and budgets without re-running it: the eviction at the end of a prefill depends only
    on the prompt's keys, values and (rotated) queries, none of which depend on the policy."""

    input_ids: Tensor
    attention_mask: Tensor | None
    logits: Tensor  # [B, V] float32, at the last prompt position
    keys: list[Tensor]
    values: list[Tensor]
    queries: list[tuple[Tensor, float]]


@torch.no_grad()
def record_prefill(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None
) -> Prefill:
    """Run the prompt once (left padding as in :func:`generate_with_budget`) and keep, per layer, its keys, values
    and RoPE-rotated queries (``[B, Hq, L, D]``, with the module's scaling): about ``(2 Hkv + Hq) · D · L · B``
    floats per layer. Pass the result as ``generate_with_budget(..., prefill=...)``. On a hybrid model every layer
    records all the prompt's keys (the model's masks still limit its sliding-window layers to their window), so
    the replay gives those layers what their own prefill would have seen."""
    is_pad = _check_inputs(input_ids, attention_mask)
    modules = check_model(model, needs_attention=True)
    if is_pad is not None and sliding_layers(model):
        raise NotImplementedError(
            f"left-padded batches are not supported on models with sliding-window layers ({model.config.model_type})"
        )
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    cache = BudgetedCache(FullCache(), None, num_layers)
    queries: dict[int, tuple[Tensor, float]] = {}

    def capture(module, args, kwargs):
        queries[int(module.layer_idx)] = (
            rotated_queries(module, args, kwargs).detach(),
            float(module.scaling),
        )

    handles = [m.register_forward_pre_hook(capture, with_kwargs=True) for m in modules.values()]
    bsz, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).expand(bsz, -1)
    mask_kw = {}
    if is_pad is not None:
        positions = (positions - is_pad.sum(dim=-1, keepdim=True)).clamp(min=0)
        mask_kw["attention_mask"] = cache.padded_mask(is_pad, model.dtype)
    try:
        with eval_mode(model):
            out = model(
                input_ids=input_ids,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **mask_kw,
                **{cache_kwarg(model): cache},
            )
    finally:
        for h in handles:
            h.remove()
    return Prefill(
        input_ids=input_ids,
        attention_mask=attention_mask,
        logits=out.logits[:, -1].float(),
        keys=[layer.keys for layer in cache.layers],
        values=[layer.values for layer in cache.layers],
        queries=[queries[i] for i in range(num_layers)],
    )


def _check_inputs(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    """Validate the prompt batch; return its pad flags ``[B, L]`` (``None`` when unpadded)."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    real = attention_mask.bool()
    if bool(real.all()):
        return None
    if bool((real[:, :-1] & ~real[:, 1:]).any()):
        raise ValueError("padded batches must be left-padded: a 0 in attention_mask after a 1")
    if not bool(real[:, -1].all()):
        raise ValueError("every row of attention_mask needs at least one real token")
    return ~real


def _memory_hook(memory) -> OnEvict | None:
    if memory is None:
        return None
    if hasattr(memory, "on_evict"):
        return memory.on_evict
    if callable(memory):
        return memory
    raise TypeError("memory must have an on_evict(layer_idx, keys, values) method or be such a callable")


def _sample(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None, generator) -> Tensor:
    logits = logits / max(temperature, 1e-5)
    if top_k is not None and top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum - sorted_logits.softmax(dim=-1) > top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -torch.inf)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_with_budget(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    policy: EvictionPolicy,
    budget: int | None,
    max_new_tokens: int,
    do_sample: bool = False,
    memory=None,
    prefill: Prefill | None = None,
    **generate_kwargs,
) -> GenerationResult:
    """Generate ``max_new_tokens`` tokens keeping at most ``budget`` KV entries per layer, chosen by ``policy``.

    ``memory``: the hook for a latent memory (docs/methods.md §11): an object with ``on_evict(layer_idx, keys, values)``
    (or such a callable), called with exactly the evicted keys/values ``[B, Hkv, n, D]`` (RoPE applied, original
    order) each time a layer evicts; ``None`` drops them. A memory with ``reset()`` is reset first, and one with
    ``attach(model)`` (a context manager, e.g. :class:`~lightning_llm.eviction.LatentMemory`) is entered around
    the forwards so that it can add its readout. ``generate_kwargs``: ``temperature``, ``top_k``,
    ``top_p``, ``generator`` (sampling), ``eos_token_id`` (int or list; finished rows are filled with
    ``pad_token_id``, default the first eos id), ``output_logits``; anything else is a ``TypeError``.

    Batches: rows of equal length, or left-padded rows (``attention_mask`` ``[B, L]`` with zeros only before each
    row's first real token, as a tokenizer with ``padding_side="left"`` gives). Each row then runs at its own
    positions (0 at its first real token), pad slots are masked out and evicted before any real token, and
    every row keeps ``budget`` slots (pads included), i.e. at most ``budget`` real tokens: the answers are those
    of one row at a time with the same budget (up to floating-point ties). ``peak_cache_bytes`` counts the
    stored slots, pads included. A latent ``memory`` is not supported with padding.

    ``prefill``: a :func:`record_prefill` of this very ``input_ids``/``attention_mask``; its recorded keys,
    values and queries go through the cache's update as the prefill forward's would (same scores, same
    eviction) and its logits give the first token, so the result equals a run without it (tested). Not with
    a ``memory``.
    """
    unknown = set(generate_kwargs) - set(_SUPPORTED)
    if unknown:
        raise TypeError(f"generate_with_budget got unsupported generate kwargs {sorted(unknown)}")
    is_pad = _check_inputs(input_ids, attention_mask)
    if is_pad is not None and memory is not None:
        raise NotImplementedError("a latent memory is not supported with padded batches")
    if prefill is not None:
        if memory is not None:
            raise NotImplementedError("a latent memory is not supported with a recorded prefill")
        same_mask = (prefill.attention_mask is None and is_pad is None) or (
            prefill.attention_mask is not None
            and attention_mask is not None
            and torch.equal(prefill.attention_mask.bool(), attention_mask.bool())
        )
        if not (torch.equal(prefill.input_ids, input_ids) and same_mask):
            raise ValueError("prefill was recorded for other input_ids or another attention_mask")
    check_model(model, policy.needs_attention)
    windows = sliding_layers(model)
    if windows and is_pad is not None:
        raise NotImplementedError(
            f"left-padded batches are not supported on models with sliding-window layers ({model.config.model_type}):"
            " generate one row (or rows of equal length) at a time"
        )
    if windows and memory is not None:
        raise NotImplementedError(
            f"a latent memory is not supported on models with sliding-window layers ({model.config.model_type})"
        )
    eos = generate_kwargs.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad_id = generate_kwargs.get("pad_token_id")
    pad_id = pad_id if pad_id is not None else (eos_ids[0] if eos_ids else 0)
    output_logits = bool(generate_kwargs.get("output_logits", False))

    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    cache = BudgetedCache(policy, budget, num_layers, on_evict=_memory_hook(memory), sliding_windows=windows)
    cache_kw = cache_kwarg(model)
    bsz, device = input_ids.shape[0], input_ids.device
    sequences, step_logits = input_ids, []
    finished = torch.zeros(bsz, dtype=torch.bool, device=device)
    next_input = input_ids
    if hasattr(memory, "reset"):
        memory.reset()
    if isinstance(memory, LatentMemory):
        readout = memory.attach(model, cache=cache)
    elif hasattr(memory, "attach"):
        readout = memory.attach(model)
    else:
        readout = contextlib.nullcontext()
    num_pads = None if is_pad is None else is_pad.sum(dim=-1, keepdim=True)
    new_is_pad = is_pad
    step_seconds, step_cpu_seconds = [], []
    with eval_mode(model), cache.attach(model), readout:
        for step in range(max_new_tokens):
            wall, cpu = time.perf_counter(), time.process_time()
            if step == 0 and prefill is not None:
                logits = _replay(cache, prefill, new_is_pad, model.dtype)
            else:
                logits = _forward(model, cache, cache_kw, next_input, num_pads, new_is_pad)
            if is_pad is not None:  # decoded tokens are never padding
                new_is_pad = torch.zeros((bsz, 1), dtype=torch.bool, device=device)
            step_seconds.append(time.perf_counter() - wall)
            step_cpu_seconds.append(time.process_time() - cpu)
            if output_logits:
                step_logits.append(logits)
            if do_sample:
                token = _sample(
                    logits,
                    float(generate_kwargs.get("temperature", 1.0)),
                    generate_kwargs.get("top_k"),
                    generate_kwargs.get("top_p"),
                    generate_kwargs.get("generator"),
                )
            else:
                token = logits.argmax(dim=-1)
            token = torch.where(finished, torch.full_like(token, pad_id), token)
            sequences = torch.cat([sequences, token[:, None]], dim=-1)
            if eos_ids:
                finished |= torch.isin(token, torch.tensor(eos_ids, device=device))
                if bool(finished.all()):
                    break
            next_input = token[:, None]
    return GenerationResult(
        sequences=sequences,
        cache_stats=cache.stats(),
        peak_cache_bytes=cache.peak_bytes,
        logits=torch.stack(step_logits, dim=1) if output_logits else None,
        step_seconds=step_seconds,
        step_cpu_seconds=step_cpu_seconds,
    )


def _forward(model, cache: BudgetedCache, cache_kw: str, next_input: Tensor, num_pads, new_is_pad) -> Tensor:
    """One forward of ``next_input`` through ``cache``; the float32 logits ``[B, V]`` of its last position."""
    bsz = next_input.shape[0]
    seen = cache.get_seq_length()
    positions = torch.arange(seen, seen + next_input.shape[1], device=next_input.device).expand(bsz, -1)
    mask_kw = {}
    if num_pads is not None:
        positions = (positions - num_pads).clamp(min=0)
        mask_kw["attention_mask"] = cache.padded_mask(new_is_pad, model.dtype)
    out = model(
        input_ids=next_input,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **mask_kw,
        **{cache_kw: cache},
    )
    return out.logits[:, -1].float()


def _replay(cache: BudgetedCache, prefill: Prefill, is_pad: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Feed a recorded prefill through ``cache.update`` layer by layer, as its forward would; its logits."""
    if is_pad is not None:
        cache.padded_mask(is_pad, dtype)
    for layer_idx, (keys, values) in enumerate(zip(prefill.keys, prefill.values, strict=True)):
        if cache.policy.needs_attention:
            cache.set_queries(layer_idx, *prefill.queries[layer_idx])
        cache.update(keys, values, layer_idx)
    return prefill.logits
