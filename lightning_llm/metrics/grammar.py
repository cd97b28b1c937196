r"""How close a language model's next-token distribution is to a PCFG's exact one, and n-gram baselines.

For a sentence :math:`w` of the grammar and each prefix :math:`w_{1:t}` (``t = 0..|w|``), the grammar defines the
exact next-symbol distribution :math:`p_G(\cdot \mid w_{1:t})` over its terminals and end of sentence
(:meth:`~lightning_llm.text.pcfg.PCFG.next_token_logprobs`). The grammar KL of a model is

.. math::

    \mathrm{KL}_t = \sum_{x \in \Sigma \cup \{\mathrm{eos}\}} p_G(x \mid w_{1:t})
        \log \frac{p_G(x \mid w_{1:t})}{p_\theta(x \mid \mathrm{bos}\, w_{1:t})},

averaged over all positions of all sentences. The model's probabilities are its full-vocabulary softmax read
at the terminal tokens (not renormalised over them): mass a model puts on tokens outside the grammar counts
against it, and the KL stays non-negative.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_llm.backbones import eval_mode
from lightning_llm.text.pcfg import PCFG

__all__ = ["GrammarKL", "NGramModel", "grammar_kl", "model_next_token_logprobs", "prefix_batches"]


def grammar_kl(grammar_logprobs: Tensor, model_logprobs: Tensor) -> Tensor:
    """Per-position KL(p_G || p_model) from two ``[positions, V+1]`` log-prob tables (zero-mass symbols skipped)."""
    if grammar_logprobs.shape != model_logprobs.shape:
        raise ValueError(f"shapes differ: {tuple(grammar_logprobs.shape)} vs {tuple(model_logprobs.shape)}")
    p = grammar_logprobs.exp()
    terms = p * (grammar_logprobs - model_logprobs.to(grammar_logprobs.dtype))
    return torch.where(p > 0, terms, torch.zeros_like(terms)).sum(-1)


def prefix_batches(
    sentences: Sequence[Sequence[int]], *, token_ids: Sequence[int], bos_id: int, pad_id: int, batch_size: int
) -> Iterator[tuple[Sequence[Sequence[int]], Tensor, Tensor]]:
    """``(chunk, input_ids, attention_mask)`` of right-padded ``bos w_1 … w_T`` batches (no eos), in order.

    Position ``t`` of a row is the model's state after ``t`` words: what the grammar-KL metric and the probes
    read. ``token_ids[w]`` is the vocabulary id of terminal ``w``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for first in range(0, len(sentences), batch_size):
        chunk = sentences[first : first + batch_size]
        ids = torch.full((len(chunk), max(len(s) for s in chunk) + 1), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, sentence in enumerate(chunk):
            ids[row, : len(sentence) + 1] = torch.tensor([bos_id, *(token_ids[w] for w in sentence)])
            mask[row, : len(sentence) + 1] = 1
        yield chunk, ids, mask


@torch.no_grad()
def model_next_token_logprobs(
    model: torch.nn.Module,
    sentences: Sequence[Sequence[int]],
    *,
    token_ids: Sequence[int],
    bos_id: int,
    eos_id: int,
    batch_size: int = 64,
) -> list[Tensor]:
    """A causal LM's ``log p(x | bos w_{1:t})`` at the terminal tokens and eos: one ``[|w|+1, V+1]`` per sentence.

    Sentences are fed as ``bos w_1 … w_T`` (right-padded, masked); row t is the softmax after ``t`` words.
    """
    columns = torch.tensor([*token_ids, eos_id])
    device = next(model.parameters()).device
    out: list[Tensor] = []
    with eval_mode(model):
        batches = prefix_batches(
            sentences, token_ids=token_ids, bos_id=bos_id, pad_id=eos_id, batch_size=batch_size
        )
        for chunk, ids, mask in batches:
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
            logprobs = logits.log_softmax(-1)[..., columns.to(device)].double().cpu()
            out += [logprobs[row, : len(s) + 1] for row, s in enumerate(chunk)]
    return out


class NGramModel:
    r"""An n-gram model over the terminals with end of sentence, add-``k`` smoothed: the baseline a transformer
    must beat to show it learnt more than local statistics.

    :math:`p(x \mid h) = (c(h, x) + k) / (c(h) + k\,(V+1))` for the last ``order - 1`` symbols ``h`` (sentence start
    padded with a bos symbol).
    """

    def __init__(self, order: int, num_terminals: int, *, smoothing: float = 0.01) -> None:
        if order < 1:
            raise ValueError(f"order must be >= 1, got {order}")
        if smoothing <= 0:
            raise ValueError(
                f"smoothing must be > 0 (zero gives infinite KL on unseen events), got {smoothing}"
            )
        self.order, self.num_terminals, self.smoothing = order, num_terminals, smoothing
        self._counts: Counter[tuple[int, ...]] = Counter()
        self._context: Counter[tuple[int, ...]] = Counter()

    def _history(self, sentence: Sequence[int], t: int) -> tuple[int, ...]:
        padded = [-1] * (self.order - 1) + list(sentence)  # -1 = bos
        return tuple(padded[t : t + self.order - 1])

    def fit(self, sentences: Sequence[Sequence[int]]) -> NGramModel:
        eos = self.num_terminals
        for sentence in sentences:
            for t, symbol in enumerate([*sentence, eos]):
                history = self._history(sentence, t)
                self._counts[(*history, symbol)] += 1
                self._context[history] += 1
        return self

    def next_token_logprobs(self, sentences: Sequence[Sequence[int]]) -> list[Tensor]:
        """``[|w|+1, V+1]`` log-probabilities per sentence, in the layout of the grammar's tables."""
        k, size = self.smoothing, self.num_terminals + 1
        out = []
        for sentence in sentences:
            rows = []
            for t in range(len(sentence) + 1):
                history = self._history(sentence, t)
                counts = torch.tensor([self._counts[(*history, x)] for x in range(size)], dtype=torch.float64)
                rows.append(((counts + k) / (self._context[history] + k * size)).log())
            out.append(torch.stack(rows))
        return out


class GrammarKL(Metric):
    r"""Mean per-position :math:`\mathrm{KL}(p_G \,\|\, p_\theta)` over sentences of a grammar (module docstring).

    ``update(model_logprobs, sentences)`` takes the model's ``[|w|+1, V+1]`` tables (e.g. from
    :func:`model_next_token_logprobs`) for the given sentences; the exact grammar tables are computed on first
    sight of a sentence and cached, so evaluating a fixed set every epoch costs one grammar pass. States are sums,
    so DDP ranks holding different sentences reduce exactly.

    Args:
        grammar: The PCFG the sentences were sampled from.
        max_length: The sampler's length cap (the grammar distribution is the capped one).
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    def __init__(self, grammar: PCFG, max_length: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.grammar, self.max_length = grammar, max_length
        self._exact_tables: dict[tuple[int, ...], Tensor] = {}
        self.add_state("kl_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("positions", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def grammar_logprobs(self, sentences: Sequence[Sequence[int]]) -> list[Tensor]:
        """The exact tables of ``sentences`` (cached)."""
        missing = list(dict.fromkeys(tuple(s) for s in sentences if tuple(s) not in self._exact_tables))
        if missing:
            tables = self.grammar.next_token_logprobs(missing, max_length=self.max_length)
            self._exact_tables.update(zip(missing, tables, strict=True))
        return [self._exact_tables[tuple(s)] for s in sentences]

    def update(self, model_logprobs: Sequence[Tensor], sentences: Sequence[Sequence[int]]) -> None:
        if len(model_logprobs) != len(sentences):
            raise ValueError(f"{len(model_logprobs)} model tables for {len(sentences)} sentences")
        for exact, model in zip(self.grammar_logprobs(sentences), model_logprobs, strict=True):
            kl = grammar_kl(exact, model.detach().cpu())
            self.kl_sum += kl.sum().to(self.kl_sum)
            self.positions += kl.numel()

    def compute(self) -> Tensor:
        return self.kl_sum / self.positions.clamp_min(1)
