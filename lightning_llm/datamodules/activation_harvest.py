r"""Harvesting a frozen backbone's residual stream from chat dialogues: the rows it reads and what is kept.

FAST (arXiv 2506.07691) trains SAEs for instruct models *sequentially*: every dialogue is rendered by the chat
template (special tokens included) and run through the model on its own, one dialogue per sequence, no packing,
truncated at ``max_length``, which is how the model sees text when it is deployed. The usual baseline, *block
training*, concatenates dialogues into fixed-length blocks, so a token attends to the tail of unrelated
dialogues and its activation is one the deployed model never produces. :func:`dialogue_rows` builds the rows of
either mode from the same dialogues (validation always in the sequential format) and :func:`harvest` runs the
backbone over them. :func:`harvest_corpus` does the same for the shipped chat corpus in memory, at an exact
token count per mode (:func:`render_corpus` gives its conversations' token ids).

Layer convention (as in :mod:`lightning_llm.callbacks.steering`): *layer* :math:`\ell` is the 0-based index into
:func:`~lightning_llm.backbones.inspect.decoder_layers` and the activation is the **output of that decoder
layer**, read by a forward hook; it equals Hugging Face's ``hidden_states[ℓ + 1]`` for every layer but the last
(HF applies the final norm there). The forward stops right after layer :math:`\ell`.

Special tokens: a token is *special* when its id is in the tokenizer's ``all_special_ids`` (bos/eos/pad/unk...
and ``additional_special_tokens``) or is an added token registered with ``special=True``
(``tokenizer.added_tokens_decoder``). The second set matters: ChatML's ``<|im_start|>`` is an added special
token but not in ``all_special_ids``. Tags added as ordinary tokens (the tiny tokenizer's ``<think>``,
``<answer>``...) are not special: they are text the model writes, not template structure. In the tiny backbone
the special tokens are ``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>`` (eos).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from lightning_llm.backbones import apply_chat_template
from lightning_llm.backbones.inspect import layer_output_reader
from lightning_llm.datamodules.activation_store import ShardWriter, ValidationSet
from lightning_llm.datamodules.chat_corpus import load_chat_corpus
from lightning_llm.datamodules.chat_sft import ChatSFTDataModule
from lightning_llm.datamodules.sources import pad_sequences

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "dialogue_rows",
    "harvest",
    "harvest_corpus",
    "layer_activations",
    "render_corpus",
    "special_token_ids",
]


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """``all_special_ids`` plus every added token registered as special (ChatML's ``<|im_start|>``...)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(tokenizer.all_special_ids) | frozenset(
        index for index, token in added.items() if getattr(token, "special", False)
    )


def _dialogues(tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> ChatSFTDataModule:
    """A set-up :class:`~lightning_llm.datamodules.ChatSFTDataModule` of ``kwargs`` rendering with ``tokenizer``."""
    data = ChatSFTDataModule(**kwargs)
    data.use_tokenizer(tokenizer)
    data.setup()
    return data


def dialogue_rows(
    tokenizer: PreTrainedTokenizerBase,
    *,
    mode: Literal["sequential", "block"],
    block_size: int | None,
    num_tokens: int | None,
    **data: Any,
) -> tuple[list[Tensor], list[Tensor]]:
    """Token ids of the rows the backbone reads: training rows and validation dialogues.

    The conversations, their rendering, truncation and packing are
    :class:`~lightning_llm.datamodules.ChatSFTDataModule`'s (``data`` are its data arguments: ``task``,
    ``source``, ``num_train``, ``num_val``, ``max_length``...). Training rows are the dialogues cut at
    ``max_length`` (``mode="sequential"``) or the packed blocks of ``block_size`` tokens (``mode="block"``),
    the first ones in data order up to ``num_tokens`` tokens (None: all); validation rows are the held-out
    dialogues in the sequential format in both modes.
    """
    dialogues = _dialogues(tokenizer, packing="none", **data)
    val_rows = [item["input_ids"] for item in dialogues.val_dataloader().dataset]
    training = (
        _dialogues(tokenizer, packing="block", block_size=block_size, **data)
        if mode == "block"
        else dialogues
    )
    rows = [item["input_ids"] for item in training.train_items]
    available = sum(len(row) for row in rows)
    if num_tokens is not None:
        if num_tokens > available:
            raise ValueError(
                f"num_tokens={num_tokens} but the {mode} training data has only {available} tokens "
                f"(num_train={data['num_train']}, max_length={data['max_length']}); lower num_tokens or raise "
                "num_train"
            )
        used = 0
        for count, row in enumerate(rows, start=1):
            used += len(row)
            if used >= num_tokens:
                rows = rows[:count]
                break
    return rows, val_rows


@torch.no_grad()
def layer_activations(
    model: nn.Module, layer: int, rows: Sequence[Tensor], *, batch_size: int, pad_id: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """``(activations [n, d] float32 CPU, token_ids [n])`` of the real tokens of each forward, row-major.

    ``batch_size`` rows per forward, right-padded with attention mask 0; the padding positions are dropped. Each
    row is attended on its own (rows of a batch never see each other), so a row is the unit of attention: one
    dialogue in sequential mode, one packed block in block mode. The model runs without gradients and stops
    after ``layer``.
    """
    device = next(model.parameters()).device
    with layer_output_reader(model, layer) as read:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            input_ids = pad_sequences(chunk, pad_id)
            attention_mask = pad_sequences([torch.ones_like(row) for row in chunk], 0)
            hidden = read(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
            keep = attention_mask.bool()
            yield hidden[keep.to(device)].float().cpu(), input_ids[keep]


def harvest(
    model: nn.Module,
    layer: int,
    train_rows: Sequence[Tensor],
    val_rows: Sequence[Tensor],
    writer: ShardWriter,
    *,
    num_tokens: int | None,
    batch_size: int,
    pad_id: int,
    special_ids: frozenset[int],
    device: torch.device,
) -> ValidationSet:
    """Harvest the training rows into ``writer`` (exactly ``num_tokens`` tokens; None: all) and return the
    validation set.

    Tokens are flagged special by ``special_ids``. The model runs on ``device`` and is moved back afterwards.
    """
    special = torch.tensor(sorted(special_ids))
    budget = num_tokens if num_tokens is not None else sum(len(row) for row in train_rows)
    home = next(model.parameters()).device
    model.to(device)
    try:
        chunks = layer_activations(model, layer, train_rows, batch_size=batch_size, pad_id=pad_id)
        with contextlib.closing(chunks):
            for activations, token_ids in chunks:
                take = min(budget, len(token_ids))
                budget -= take
                writer.add(activations[:take], torch.isin(token_ids[:take], special), token_ids[:take])
                if budget == 0:
                    break
        val = list(layer_activations(model, layer, val_rows, batch_size=batch_size, pad_id=pad_id))
    finally:
        model.to(home)
    if val:
        activations, token_ids = torch.cat([a for a, _ in val]), torch.cat([t for _, t in val])
    else:
        activations = torch.zeros(0, model.config.get_text_config().hidden_size)
        token_ids = torch.zeros(0, dtype=torch.long)
    lengths = torch.tensor([len(row) for row in val_rows], dtype=torch.long)
    return ValidationSet(activations, torch.isin(token_ids, special), token_ids, lengths)


def render_corpus(tokenizer: Any, max_length: int) -> list[Tensor]:
    """Token ids of every corpus conversation in the chat template, cut at ``max_length``."""
    rows = []
    for item in load_chat_corpus():
        text = apply_chat_template(tokenizer, item["messages"])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_length]
        rows.append(torch.tensor(ids, dtype=torch.long))
    return rows


def _training_rows(dialogues: list[Tensor], mode: str, num_tokens: int, block_size: int) -> list[Tensor]:
    """The rows whose first ``num_tokens`` tokens are harvested: conversations, or blocks of their concatenation."""
    if mode == "block":
        stream = torch.cat(dialogues)
        dialogues = list(stream[: len(stream) // block_size * block_size].split(block_size))
    rows, used = [], 0
    for row in dialogues:
        rows.append(row)
        used += len(row)
        if used >= num_tokens:
            return rows
    raise ValueError(
        f"{mode}: the training conversations hold {used} tokens, fewer than num_tokens={num_tokens}"
    )


def harvest_corpus(
    model: Any, tokenizer: Any, *, layer: int, mode: str, num_tokens: int, num_val: int, max_length: int = 256,
    block_size: int = 256, batch_size: int = 8,
) -> dict[str, Any]:  # fmt: skip
    """Training activations of ``mode`` (``train [num_tokens, d]``, ``train_special [num_tokens]``) and the held-out
    conversations padded (``val``: ``input_ids``, ``attention_mask``, ``activations``, ``special_mask``)."""
    dialogues = render_corpus(tokenizer, max_length)
    if not 0 < num_val < len(dialogues):
        raise ValueError(f"num_val must be in [1, {len(dialogues) - 1}], got {num_val}")
    train_dialogues, val_dialogues = dialogues[:-num_val], dialogues[-num_val:]
    special = torch.tensor(sorted(special_token_ids(tokenizer)))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def run(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
        parts = list(layer_activations(model, layer, rows, batch_size=batch_size, pad_id=pad))
        return torch.cat([a for a, _ in parts]), torch.cat([t for _, t in parts])

    acts, ids = run(_training_rows(train_dialogues, mode, num_tokens, block_size))
    val_acts, _ = run(val_dialogues)
    lengths = [len(row) for row in val_dialogues]
    mask = pad_sequences([torch.ones_like(row) for row in val_dialogues], 0)
    input_ids = pad_sequences(val_dialogues, pad)
    padded = torch.zeros(*mask.shape, val_acts.shape[1])
    padded[mask.bool()] = val_acts
    return {
        "train": acts[:num_tokens],
        "train_special": torch.isin(ids[:num_tokens], special),
        "val": {
            "input_ids": input_ids,
            "attention_mask": mask,
            "activations": padded,
            "special_mask": torch.isin(input_ids, special) & mask.bool(),
        },
        "val_tokens": sum(lengths),
    }
