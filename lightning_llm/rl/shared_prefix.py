r"""Shared-prefix passes: each distinct prompt is encoded once, for every completion sampled from it.

A GRPO batch holds ``G`` completions of each prompt. The plain pass encodes the prompt ``G`` times, in the
policy's forward/backward and in the generation prefill. Prefix Grouper (arXiv 2506.05433) encodes it once:

- **Training** (:func:`shared_prefix_hidden`): one sequence per distinct prompt block,
  ``[prompt | completion 1 | … | completion G]``, under an additive 4-D attention mask in which every
  completion sees the prompt's real tokens and, causally, itself only, each token at the position id and
  (for sliding-window layers) the window it has in its own row. Every completion token then attends to
  exactly the keys/values of the whole-row pass, so per-token log-probs, entropy and gradients equal it up to
  floating-point summation order (tested at relative 1e-5 in fp32); the prompt's activations are kept once,
  not ``G`` times, and no key/value is copied per row.
- **Generation** (:func:`prefill_prefixes`): each distinct prompt is prefilled once and its cache gathered
  over the rows (``cache.batch_select_indices``) before ``generate`` samples.

:func:`shared_prefix_unsupported` names the models it cannot be exact for (callers then run the plain pass):
an attention implementation that ignores 4-D masks (FlashAttention's varlen kernels), layers other than full
or sliding-window attention (linear attention, state-space), a sliding window the config does not assign to
layers, or a forward that takes no key/value cache.
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
    """Why the shared-prefix passes cannot be exact for ``model`` (``None`` when they can)."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or getattr(config, "is_encoder_decoder", False):
        return f"{name} is not a decoder-only Hugging Face model"
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in ("sdpa", "eager"):
        return f"{name} uses attn_implementation={attention!r}, which does not take a 4-D attention mask"
    types = getattr(config, "layer_types", None)
    unknown = set(types or ()) - {"full_attention", "sliding_attention"}
    if unknown:
        return f"{name} has layers of type {sorted(unknown)}, which are not softmax attention over a key/value cache"
    if not types and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"{name} has a sliding window that its config does not assign to layers (no layer_types)"
    if cache_kwarg(model) not in inspect.signature(model.forward).parameters:
        return f"{name}.forward takes no key/value cache"
    return None


def expand_cache(cache: Any, index: Tensor) -> Any:
    """``cache`` with its batch dimension gathered by ``index`` (in place; differentiable: an index op)."""
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        raise TypeError(f"cannot expand a {type(cache).__name__}: need a cache of key/value layers")
    cache.batch_select_indices(index)
    return cache


@dataclass(frozen=True)
class _Folded:
    """One sequence per distinct prompt: ``[prompt | completion of slot 0 | … | completion of slot S − 1]``."""

    input_ids: Tensor  # [U, P + S·C]
    position_ids: Tensor  # [U, P + S·C]
    masks: dict[str, Tensor]  # per layer type, additive [U, 1, P + S·C, P + S·C]
    gather: Tensor  # [R, C] column of the folded sequence whose hidden state predicts completion token j


def _fold(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    groups: PrefixGroups,
) -> _Folded:
    P, C = prompt_length, input_ids.shape[1] - prompt_length
    device = input_ids.device
    rows = torch.arange(groups.num_rows, device=device)
    # slot of each row among the rows sharing its prompt (0, 1, … in row order)
    same = groups.inverse[:, None] == groups.inverse[None, :]
    slot = (same & (rows[None, :] < rows[:, None])).sum(dim=1)
    slots = int(slot.max()) + 1
    U, L = groups.num_prefixes, P + slots * C
    ids = torch.zeros((U, L), dtype=input_ids.dtype, device=device)
    real = torch.zeros((U, L), dtype=torch.bool, device=device)
    ids[:, :P] = input_ids[groups.unique, :P]
    real[:, :P] = attention_mask[groups.unique, :P].bool()
    columns = P + slot[:, None] * C + torch.arange(C, device=device)  # [R, C]
    ids[groups.inverse[:, None], columns] = input_ids[:, P:]
    real[groups.inverse[:, None], columns] = attention_mask[:, P:].bool()
    # Position in the row each folded column stands for (the column index of the whole-row layout) and in
    # the sequence of real tokens (the position id of the whole-row pass).
    unfolded = torch.arange(L, device=device).expand(U, L).clone()
    unfolded[groups.inverse[:, None], columns] = P + torch.arange(C, device=device)
    segment = torch.zeros((U, L), dtype=torch.long, device=device)
    segment[groups.inverse[:, None], columns] = slot[:, None].expand(-1, C) + 1
    whole_positions = position_ids_from_mask(attention_mask)
    positions = torch.zeros((U, L), dtype=torch.long, device=device)
    positions[:, :P] = whole_positions[groups.unique, :P]
    positions[groups.inverse[:, None], columns] = whole_positions[:, P:]

    q_seg, k_seg = segment[:, :, None], segment[:, None, :]
    q_col, k_col = unfolded[:, :, None], unfolded[:, None, :]
    visible = real[:, None, :] & ((k_seg == 0) | (k_seg == q_seg)) & (k_col <= q_col)
    dtype = model.get_input_embeddings().weight.dtype
    floor = torch.finfo(dtype).min

    def additive(allowed: Tensor) -> Tensor:
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, floor)[:, None]

    masks = {"full_attention": additive(visible)}
    window = getattr(model.config, "sliding_window", None)
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
        masks["sliding_attention"] = additive(visible & (k_col > q_col - window))
    gather = torch.cat([torch.full((groups.num_rows, 1), P - 1, device=device), columns[:, :-1]], dim=1)
    return _Folded(ids, positions, masks, gather)


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
    [:, P − 1 : −1]`` (the whole-row pass), with each distinct prompt encoded once: one sequence per prompt,
    its completions side by side after it, each attending to the prompt and causally to itself only (an
    additive 4-D mask per layer type; a sliding-window layer's window counted in the row's own columns), at
    the positions it has in its own row.

    Args:
        input_ids, attention_mask: ``[R, P + C]``, left-padded prompts then right-padded completions.
        prompt_length: ``P``.
        groups: rows grouped by prompt (default: computed from the prompt block).
    """
    if not 0 < prompt_length < input_ids.shape[1]:
        raise ValueError(f"prompt_length must be in (0, {input_ids.shape[1]}), got {prompt_length}")
    groups = groups or prefix_groups(input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
    folded = _fold(model, input_ids, attention_mask, prompt_length, groups)
    layer_types = getattr(model.config, "layer_types", None)
    mask: Any = folded.masks if layer_types and len(folded.masks) > 1 else folded.masks["full_attention"]
    out = decoder_outputs(
        model,
        input_ids=folded.input_ids,
        attention_mask=mask,
        position_ids=folded.position_ids,
        use_cache=False,
    )
    hidden = out.last_hidden_state  # [U, L, H]
    return hidden[groups.inverse[:, None], folded.gather]


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
    from transformers import DynamicCache

    unique = groups.unique
    cache = DynamicCache(config=model.config)
    decoder_outputs(
        model,
        input_ids=input_ids[unique, :-1],
        attention_mask=attention_mask[unique, :-1],
        position_ids=position_ids_from_mask(attention_mask[unique, :-1]),
        use_cache=True,
        **{cache_kwarg(model): cache},
    )
    return expand_cache(cache, groups.inverse)
