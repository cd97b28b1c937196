"""Sentences of a probabilistic context-free grammar (:class:`~lightning_llm.metrics.PCFG`) as causal-LM batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_llm.datamodules.sources import epoch_sampler, pad_sequences
from lightning_llm.datamodules.tokenizer import check_same_tokenizer, model_tokenizer, resolve_tokenizer
from lightning_llm.text.pcfg import PCFG
from lightning_llm.types import IGNORE_INDEX

__all__ = ["PCFGDataModule"]


class PCFGDataModule(L.LightningDataModule):
    """Sentences of a PCFG as causal-LM batches: ``[bos] w_1 … w_T [eos]``, each terminal one token.

    The grammar is a JSON file (:meth:`~lightning_llm.metrics.PCFG.save_json`'s format), a
    :class:`~lightning_llm.metrics.PCFG`, or a random grammar from ``random_grammar`` (the keyword arguments of
    :meth:`~lightning_llm.metrics.PCFG.random`). Sentences are sampled with the length cap
    ``max_length`` (words, excluding bos/eos): train and validation sets from different seeds, so a short
    sentence can occur in both, as it would in any sample of the language. Every token after bos is trained,
    the end of sentence included, so the model learns the full next-token distribution the grammar defines.

    Terminal ``i`` is the token ``terminal_tokens[i]`` (default: the grammar's terminal names, which for a
    random grammar are the single letters ``a, b, …``, one byte-level token each); each must be a single token of
    the tokenizer's vocabulary. ``bos`` is the tokenizer's bos token, or its eos token when it has none (as
    GPT-2 and Qwen do), and ``eos`` its eos token.

    Batch: ``dict(input_ids, attention_mask, labels)`` (right-padded, pads labelled -100). The exact sentences are
    :attr:`train_sentences` / :attr:`val_sentences` (terminal indices), for :class:`~lightning_llm.metrics.GrammarKL`
    and the probes.

    Args:
        tokenizer: ``None`` (default): the tokenizer of the model this DataModule is fitted with (the tiny one
            when used without a Trainer); a name or path loads that one, and must then be the model's.
        grammar: Path of a grammar JSON file, or a :class:`~lightning_llm.metrics.PCFG`; None uses
            ``random_grammar``.
        random_grammar: Keyword arguments of :meth:`~lightning_llm.metrics.PCFG.random` (used when ``grammar``
            is None).
        terminal_tokens: The vocabulary token of each terminal, in the grammar's terminal order.
        num_train: Training sentences.
        num_val: Validation sentences.
        max_length: Length cap of a sentence, in words.
        batch_size: Sentences per batch.
        seed: Seed of the samples and of the training order.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        *,
        tokenizer: str | None = None,
        grammar: str | PCFG | None = None,
        random_grammar: dict[str, Any] | None = None,
        terminal_tokens: list[str] | None = None,
        num_train: int = 20000,
        num_val: int = 256,
        max_length: int = 32,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if grammar is not None and random_grammar:
            raise ValueError("give either `grammar` or `random_grammar`, not both")
        for name, value, minimum in (
            ("num_train", num_train, 1),
            ("num_val", num_val, 0),
            ("max_length", max_length, 1),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
        ):
            if value < minimum:
                raise ValueError(f"{name} must be >= {minimum}, got {value}")
        self.save_hyperparameters(ignore=["grammar"])
        self.hparams["grammar"] = grammar if not isinstance(grammar, PCFG) else None
        if isinstance(grammar, PCFG):
            self.grammar = grammar
        elif grammar is not None:
            self.grammar = PCFG.from_json(grammar)
        else:
            self.grammar = PCFG.random(**(random_grammar or {}))
        tokens = terminal_tokens if terminal_tokens is not None else self.grammar.terminals
        if len(tokens) != self.grammar.num_terminals:
            raise ValueError(
                f"terminal_tokens has {len(tokens)} tokens for {self.grammar.num_terminals} terminals"
            )
        self._terminal_tokens = list(tokens)
        self._tokenizer = None
        self._token_ids: list[int] | None = None
        self.train_sentences: list[list[int]] = []
        self.val_sentences: list[list[int]] = []

    @property
    def tokenizer(self):
        """The tokenizer (see ``tokenizer`` in the class docstring), resolved on first use."""
        if self._tokenizer is None:
            self._tokenizer = resolve_tokenizer(self, self.hparams.tokenizer)
        return self._tokenizer

    @property
    def token_ids(self) -> list[int]:
        """Vocabulary id of each terminal, checked to be single, distinct, known tokens."""
        if self._token_ids is None:
            tokenizer = self.tokenizer
            ids = []
            for token in self._terminal_tokens:
                token_id = tokenizer.convert_tokens_to_ids(token)
                if token_id is None or token_id == tokenizer.unk_token_id:
                    raise ValueError(
                        f"terminal token {token!r} is not a single token of {self.tokenizer.name_or_path!r}; set "
                        "terminal_tokens to tokens of its vocabulary"
                    )
                ids.append(int(token_id))
            if len(set(ids)) != len(ids) or {self.bos_id, self.eos_id} & set(ids):
                raise ValueError(f"terminal tokens must be distinct and differ from bos/eos, got ids {ids}")
            self._token_ids = ids
        return self._token_ids

    @property
    def bos_id(self) -> int:
        tokenizer = self.tokenizer
        return int(tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id)

    @property
    def eos_id(self) -> int:
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {self.tokenizer.name_or_path!r} has no eos token")
        return int(self.tokenizer.eos_token_id)

    def encode(self, sentences: Sequence[Sequence[int]]) -> list[Tensor]:
        """Token ids ``[bos, w_1, …, w_T, eos]`` of each sentence."""
        ids = self.token_ids
        return [torch.tensor([self.bos_id, *(ids[w] for w in s), self.eos_id]) for s in sentences]

    def prepare_data(self) -> None:
        self.tokenizer  # noqa: B018  (builds the tiny tokenizer once, before the processes load it)

    def setup(self, stage: str | None = None) -> None:
        fitted = model_tokenizer(self)
        if self.hparams.tokenizer is None and fitted is not None and fitted is not self._tokenizer:
            self._tokenizer, self._token_ids, self.train_sentences = (
                None,
                None,
                [],
            )  # re-encode with the model's
        check_same_tokenizer(self, self.tokenizer, self.hparams.tokenizer)
        if self.train_sentences:
            return
        hp = self.hparams
        self.train_sentences = self.grammar.sample(hp.num_train, max_length=hp.max_length, seed=hp.seed)
        # A distinct stream for validation (the seed is offset by a large odd constant).
        self.val_sentences = self.grammar.sample(
            hp.num_val, max_length=hp.max_length, seed=hp.seed + 1_000_003
        )
        self._train, self._val = self.encode(self.train_sentences), self.encode(self.val_sentences)

    def _collate(self, items: list[Tensor]) -> dict[str, Tensor]:
        input_ids = pad_sequences(items, self.eos_id)
        labels = pad_sequences(items, IGNORE_INDEX)
        labels[:, 0] = IGNORE_INDEX  # bos is given, never predicted
        return {
            "input_ids": input_ids,
            "attention_mask": pad_sequences([torch.ones_like(item) for item in items], 0),
            "labels": labels,
        }

    def train_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(
            self._train,
            batch_size=self.hparams.batch_size,
            sampler=epoch_sampler(self._train, self.trainer, shuffle=True, seed=self.hparams.seed),
            collate_fn=self._collate,
            num_workers=self.hparams.num_workers,
            # the loader draws its base seeds from this generator, not from the global RNG
            generator=torch.Generator().manual_seed(self.hparams.seed),
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self._val,
            batch_size=self.hparams.batch_size,
            shuffle=False,
            collate_fn=self._collate,
            num_workers=self.hparams.num_workers,
        )
