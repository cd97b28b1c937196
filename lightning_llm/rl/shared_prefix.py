r"""Shared-prefix forward passes: each distinct prompt is encoded once, its keys/values serve every completion.

A GRPO batch holds ``G`` completions of each prompt. The plain forward encodes the prompt ``G`` times, in the
policy's forward/backward and in the generation prefill. Prefix Grouper (arXiv 2506.05433) encodes it once:

1. the distinct prompt blocks (left-padded, equal width ``P``) run through the decoder once, with gradient,
   returning their key/value cache and the final hidden state of their last column (which predicts the first
   completion token);
2. each layer's keys/values are gathered over the rows (``cache.batch_select_indices``: an index on the batch
   dimension, so gradients of every row flow back into the one prompt encoding);
3. the completions (``[R, C]``) run on that cache with the full ``[R, P + C]`` attention mask, positions
   continuing from the prompt's real tokens and cache positions ``P … P + C − 1``.

Every completion token then sees exactly the keys/values it sees in one ``[R, P + C]`` pass, so per-token
log-probs, entropy and gradients equal the unshared path up to floating-point summation order (tested at
relative 1e-5 in fp32). It applies to any Hugging Face decoder whose cache is a ``DynamicCache`` of full or
sliding-window layers (Llama, Qwen2, Gemma 2/3): a sliding-window layer keeps the last ``window − 1`` prompt
positions, which are all that a completion position may attend to there. :func:`shared_prefix_unsupported`
names the cases it cannot be exact on (then callers use the plain pass): a model that takes no
``past_key_values``, a cache of another kind (linear attention, quantised, static), or rows whose targets lie
inside the prompt block.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_llm.backbones.inspect import cache_kwarg
from lightning_llm.lm import decoder_outputs, position_ids_from_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "PrefixGroups",
    "expand_cache",
    "prefill_prefixes",
    "prefix_groups",
    "shared_prefix_hidden",
    "shared_prefix_unsupported",
]


@dataclass(frozen=True)
class PrefixGroups:
    """Rows grouped by identical prompt block: ``unique[k]`` is a row holding distinct prompt ``k``, and row
    ``i``'s prompt is ``unique[inverse[i]]``."""

    unique: Tensor
    inverse: Tensor

    @property
    def num_prefixes(self) -> int:
        return int(self.unique.numel())

    @property
    def num_rows(self) -> int:
        return int(self.inverse.numel())


def prefix_groups(prompt_ids: Tensor, prompt_mask: Tensor) -> PrefixGroups:
    """Group rows whose prompt block (ids *and* attention mask, column by column) is identical."""
    if prompt_ids.shape != prompt_mask.shape or prompt_ids.dim() != 2:
        raise ValueError(
            f"need prompt ids and mask of one shape [rows, P], got {tuple(prompt_ids.shape)} and "
            f"{tuple(prompt_mask.shape)}"
        )
    key = torch.cat([prompt_ids.long(), prompt_mask.long()], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    # the first row of each group holds it: unique rows in order of first appearance
    first = torch.full((int(inverse.max()) + 1,), key.shape[0], dtype=torch.long, device=key.device)
    first = first.scatter_reduce(0, inverse, torch.arange(key.shape[0], device=key.device), reduce="amin")
    order = first.argsort()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return PrefixGroups(unique=first[order], inverse=rank[inverse])


def shared_prefix_unsupported(model: PreTrainedModel) -> str | None:
    """Why :func:`shared_prefix_hidden` cannot be exact for ``model`` (``None`` when it can)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is not a decoder-only Hugging Face model"
    if cache_kwarg(model) not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}.forward takes no key/value cache"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    unknown = types - {"full_attention", "sliding_attention"}
    if unknown:
        return f"{type(model).__name__} has layers of type {sorted(unknown)}, whose cache is not a key/value cache"
    return None


def expand_cache(cache: Any, index: Tensor) -> Any:
    """``cache`` with its batch dimension gathered by ``index`` (in place; differentiable: an index op)."""
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        raise TypeError(f"cannot expand a {type(cache).__name__}: need a cache of key/value layers")
    cache.batch_select_indices(index)
    return cache


def _cache_class() -> Any:
    from transformers import DynamicCache

    return DynamicCache


def _prefix_pass(model: PreTrainedModel, prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Any]:
    """The decoder over prompts ``[U, P]``: (final hidden states ``[U, P, H]``, their cache)."""
    cache = _cache_class()(config=model.config)
    out = decoder_outputs(
        model,
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=position_ids_from_mask(prompt_mask),
        use_cache=True,
        **{cache_kwarg(model): cache},
    )
    return out.last_hidden_state, cache


def shared_prefix_hidden(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    groups: PrefixGroups | None = None,
) -> Tensor:
    """Final hidden states ``[R, C, H]`` that predict the completion tokens ``input_ids[:, P:]``.

    Column ``j`` predicts token ``P + j``: column 0 is the prompt's last hidden state, column ``j > 0`` the
    completion's token ``j − 1``. The same values as ``last_hidden_states(model, input_ids, attention_mask)
    [:, P − 1 : −1]`` (the unshared pass), with each distinct prompt encoded once.

    Args:
        input_ids, attention_mask: ``[R, P + C]``, left-padded prompts then right-padded completions.
        prompt_length: ``P``.
        groups: rows grouped by prompt (default: computed from the prompt block).
    """
    if not 0 < prompt_length < input_ids.shape[1]:
        raise ValueError(f"prompt_length must be in (0, {input_ids.shape[1]}), got {prompt_length}")
    prompt_ids, prompt_mask = input_ids[:, :prompt_length], attention_mask[:, :prompt_length]
    groups = groups or prefix_groups(prompt_ids, prompt_mask)
    prefix_hidden, cache = _prefix_pass(model, prompt_ids[groups.unique], prompt_mask[groups.unique])
    expand_cache(cache, groups.inverse)
    positions = position_ids_from_mask(attention_mask)[:, prompt_length:]
    out = decoder_outputs(
        model,
        input_ids=input_ids[:, prompt_length:],
        attention_mask=attention_mask,
        position_ids=positions,
        use_cache=True,
        **{cache_kwarg(model): cache},
        cache_position=torch.arange(prompt_length, input_ids.shape[1], device=input_ids.device),
    )
    first = prefix_hidden[:, -1:][groups.inverse]
    return torch.cat([first, out.last_hidden_state[:, :-1]], dim=1)


@torch.no_grad()
def prefill_prefixes(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor) -> Any:
    """A generation cache for left-padded prompts ``[R, P]`` that encodes each distinct prompt once.

    Covers every prompt column but the last (``generate`` needs one uncached token to start from); pass it as
    ``generate(..., past_key_values=cache)`` with the full prompts. ``None`` when there is nothing to share
    (every prompt distinct, or prompts of one token).
    """
    if input_ids.shape[1] < 2:
        return None
    groups = prefix_groups(input_ids[:, :-1], attention_mask[:, :-1])
    if groups.num_prefixes == groups.num_rows:
        return None
    _, cache = _prefix_pass(model, input_ids[groups.unique, :-1], attention_mask[groups.unique, :-1])
    return expand_cache(cache, groups.inverse)
