"""``generate_with_budget``: greedy / sampled decoding under a KV budget, with a small manual loop.

A manual loop (prefill, then one token per forward) rather than ``model.generate``: it passes explicit
``position_ids``, owns the cache object and never relies on ``generate``'s cache bookkeeping (cropping, cache
position arithmetic), which changes between transformers releases and assumes kept == seen.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_llm.backbones import eval_mode
from lightning_llm.backbones.inspect import cache_kwarg
from lightning_llm.eviction.base import BudgetedCache, EvictionPolicy, LayerStats, OnEvict, check_model
from lightning_llm.eviction.memory import LatentMemory

__all__ = ["GenerationResult", "generate_with_budget"]

_SUPPORTED = ("temperature", "top_k", "top_p", "eos_token_id", "pad_token_id", "generator", "output_logits")


@dataclass
class GenerationResult:
    """``sequences`` ``[B, prompt + new]``; ``cache_stats`` per layer; ``peak_cache_bytes``: the largest total size
    of the stored keys + values over the run (after each eviction; the transient concatenation of one layer's new
    tokens is not counted); ``logits`` ``[B, new, V]`` (float32) when ``output_logits=True``."""

    sequences: Tensor
    cache_stats: list[LayerStats]
    peak_cache_bytes: int
    logits: Tensor | None = None


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
    """
    unknown = set(generate_kwargs) - set(_SUPPORTED)
    if unknown:
        raise TypeError(f"generate_with_budget got unsupported generate kwargs {sorted(unknown)}")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    is_pad = None
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        real = attention_mask.bool()
        if not bool(real.all()):
            if bool((real[:, :-1] & ~real[:, 1:]).any()):
                raise ValueError("padded batches must be left-padded: a 0 in attention_mask after a 1")
            if not bool(real[:, -1].all()):
                raise ValueError("every row of attention_mask needs at least one real token")
            if memory is not None:
                raise NotImplementedError("a latent memory is not supported with padded batches")
            is_pad = ~real
    check_model(model, policy.needs_attention)
    eos = generate_kwargs.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad_id = generate_kwargs.get("pad_token_id")
    pad_id = pad_id if pad_id is not None else (eos_ids[0] if eos_ids else 0)
    output_logits = bool(generate_kwargs.get("output_logits", False))

    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    cache = BudgetedCache(policy, budget, num_layers, on_evict=_memory_hook(memory))
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
    with eval_mode(model), cache.attach(model), readout:
        for _ in range(max_new_tokens):
            seen = cache.get_seq_length()
            positions = torch.arange(seen, seen + next_input.shape[1], device=device).expand(bsz, -1)
            mask_kw = {}
            if num_pads is not None:
                positions = (positions - num_pads).clamp(min=0)
                mask_kw["attention_mask"] = cache.padded_mask(new_is_pad, model.dtype)
                new_is_pad = torch.zeros((bsz, 1), dtype=torch.bool, device=device)
            out = model(
                input_ids=next_input,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **mask_kw,
                **{cache_kw: cache},
            )
            logits = out.logits[:, -1].float()
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
    )
