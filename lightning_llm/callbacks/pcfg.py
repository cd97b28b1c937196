r"""Callbacks that read a language model trained on PCFG sentences against the grammar's exact quantities.

- :class:`GrammarKLMonitor` logs the grammar KL (:class:`~lightning_llm.metrics.GrammarKL`) of the model on the
  DataModule's validation sentences, next to bigram and trigram baselines fitted on the training sentences.
- :class:`LayerwiseProbe` trains linear probes on every layer's hidden states to read the grammar's parse: for a
  span :math:`[i, j)` of a held-out sentence the target is the non-terminal that spans it in the Viterbi parse,
  or "no constituent". The feature is :math:`[h_\ell(i);\ h_\ell(j)]`: the state at the token just before the span
  (bos for a span starting the sentence) and at the span's last word, which under causal attention is the
  earliest point where the whole span has been read. Accuracy is reported per layer and span length; "local to
  global" emergence shows as accuracy on long spans rising with depth.

Both need a :class:`~lightning_llm.datamodules.PCFGDataModule` (its grammar, token map and sentences) and both
compute on every DDP rank from identical inputs, so there is nothing to synchronise. Plain functions beside them
(:func:`span_targets`, :func:`hidden_states`, :func:`probe_accuracy`) do the work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_llm.backbones import eval_mode
from lightning_llm.datamodules.pcfg import PCFGDataModule
from lightning_llm.metrics.grammar import (
    GrammarKL,
    NGramModel,
    grammar_kl,
    model_next_token_logprobs,
    prefix_batches,
)
from lightning_llm.text.pcfg import PCFG

__all__ = ["GrammarKLMonitor", "LayerwiseProbe", "hidden_states", "probe_accuracy", "span_targets"]


def _pcfg_datamodule(trainer: L.Trainer, who: str) -> PCFGDataModule:
    datamodule = trainer.datamodule
    if not isinstance(datamodule, PCFGDataModule):
        raise TypeError(f"{who} needs a PCFGDataModule, got {type(datamodule).__name__}")
    if not datamodule.val_sentences:
        raise ValueError(f"{who} needs validation sentences: set num_val > 0 on the PCFGDataModule")
    return datamodule


def _backbone(pl_module: L.LightningModule) -> torch.nn.Module:
    model = getattr(pl_module, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected the LightningModule to hold its causal LM as `.model`, got {type(model)}")
    return model


class GrammarKLMonitor(Callback):
    """Log ``val/grammar_kl`` (model) and ``val/grammar_kl_{bigram,trigram}`` (baselines) after each validation.

    The exact grammar tables of the first ``num_sentences`` validation sentences are computed once and cached;
    the baselines are fitted once, on the training sentences. ``history`` keeps ``(global_step, kl)`` pairs and
    travels in checkpoints.

    Args:
        num_sentences: Validation sentences scored (the first ones, a fixed set).
        batch_size: Sentences per model forward pass.
    """

    def __init__(self, num_sentences: int = 128, batch_size: int = 64) -> None:
        if num_sentences < 1 or batch_size < 1:
            raise ValueError(f"num_sentences and batch_size must be >= 1, got {num_sentences}, {batch_size}")
        self.num_sentences, self.batch_size = num_sentences, batch_size
        self._metric: GrammarKL | None = None
        self._baselines: dict[str, float] | None = None
        self.history: list[tuple[int, float]] = []

    def evaluate(self, model: torch.nn.Module, datamodule: PCFGDataModule) -> dict[str, float]:
        """Grammar KL of ``model`` and of the n-gram baselines on the fixed validation sentences."""
        sentences = datamodule.val_sentences[: self.num_sentences]
        if self._metric is None:
            self._metric = GrammarKL(datamodule.grammar, datamodule.hparams.max_length)
        exact = self._metric.grammar_logprobs(sentences)
        if self._baselines is None:
            self._baselines = {}
            for name, order in (("bigram", 2), ("trigram", 3)):
                ngram = NGramModel(order, datamodule.grammar.num_terminals).fit(datamodule.train_sentences)
                tables = ngram.next_token_logprobs(sentences)
                kl = torch.cat([grammar_kl(e, m) for e, m in zip(exact, tables, strict=True)]).mean()
                self._baselines[name] = float(kl)
        self._metric.reset()
        tables = model_next_token_logprobs(
            model,
            sentences,
            token_ids=datamodule.token_ids,
            bos_id=datamodule.bos_id,
            eos_id=datamodule.eos_id,
            batch_size=self.batch_size,
        )
        self._metric.update(tables, sentences)
        return {"model": float(self._metric.compute()), **self._baselines}

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        result = self.evaluate(_backbone(pl_module), _pcfg_datamodule(trainer, type(self).__name__))
        self.history.append((trainer.global_step, result["model"]))
        for name, value in result.items():
            key = "val/grammar_kl" if name == "model" else f"val/grammar_kl_{name}"
            pl_module.log(key, value, rank_zero_only=False, sync_dist=False)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [tuple(item) for item in state_dict["history"]]


def span_targets(
    grammar: PCFG, sentences: Sequence[Sequence[int]], *, max_span: int, min_span: int = 2
) -> list[list[tuple[int, int, int]]]:
    """``(start, end, label)`` of every span with ``min_span <= end - start <= max_span`` of each sentence.

    The label is the non-terminal of the span in the Viterbi parse, or ``grammar.num_nonterminals`` ("no
    constituent") when the parse has no node over it.
    """
    none = grammar.num_nonterminals
    out = []
    for sentence, (_, nodes) in zip(sentences, grammar.viterbi(sentences), strict=True):
        labels = {(c.start, c.end): c.label for c in nodes}
        out.append(
            [
                (i, i + k, labels.get((i, i + k), none))
                for k in range(min_span, max_span + 1)
                for i in range(len(sentence) - k + 1)
            ]
        )
    return out


@torch.no_grad()
def hidden_states(
    model: torch.nn.Module,
    sentences: Sequence[Sequence[int]],
    *,
    token_ids: Sequence[int],
    bos_id: int,
    pad_id: int,
    batch_size: int = 64,
) -> list[Tensor]:
    """Hidden states of ``bos w_1 … w_T``: one ``[layers+1, T+1, D]`` fp32 tensor per sentence (embeddings first)."""
    device = next(model.parameters()).device
    out: list[Tensor] = []
    with eval_mode(model):
        batches = prefix_batches(
            sentences, token_ids=token_ids, bos_id=bos_id, pad_id=pad_id, batch_size=batch_size
        )
        for chunk, ids, mask in batches:
            result = model(
                input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True
            )
            stacked = torch.stack(result.hidden_states, 1).float().cpu()  # [B, layers+1, T+1, D]
            out += [stacked[row, :, : len(s) + 1] for row, s in enumerate(chunk)]
    return out


def _ridge_fit(features: Tensor, labels: Tensor, classes: int, alpha: float) -> tuple[Tensor, Tensor, Tensor]:
    """Closed-form class-balanced ridge classifier on standardised features: (mean, std, weights + bias row).

    Each sample is weighted by the inverse frequency of its class, so a rare label (a long constituent among
    many non-constituent spans) counts as much as the majority: the probe cannot score by predicting "none".
    """
    mean, std = features.mean(0), features.std(0).clamp_min(1e-6)
    x = torch.cat([(features - mean) / std, torch.ones(len(features), 1)], 1).double()
    y = torch.nn.functional.one_hot(labels, classes).double()
    counts = y.sum(0)
    w = (len(labels) / (counts.clamp_min(1) * (counts > 0).sum()))[labels].unsqueeze(1)  # mean weight 1
    gram = x.T @ (w * x)
    reg = alpha * len(x) * torch.eye(x.shape[1], dtype=torch.float64)
    reg[-1, -1] = 0  # the bias is not shrunk
    return mean, std, torch.linalg.solve(gram + reg, x.T @ (w * y)).float()


def _balanced_accuracy(predicted: Tensor, labels: Tensor) -> float:
    """Mean over the classes present of the fraction of their samples predicted right (chance: 1 / classes)."""
    recalls = [(predicted[labels == c] == c).float().mean() for c in labels.unique()]
    return float(torch.stack(recalls).mean())


def probe_accuracy(
    states: Sequence[Tensor],
    targets: Sequence[Sequence[tuple[int, int, int]]],
    *,
    num_classes: int,
    max_span: int,
    train_fraction: float = 0.7,
    alpha: float = 1e-3,
) -> Tensor:
    """Held-out balanced accuracy ``[layers+1, max_span+1]`` of one linear probe per layer (NaN: no span that long).

    The first ``train_fraction`` of the sentences train the probes (closed-form, class-balanced ridge regression
    on one-hot labels, ``alpha`` relative to the sample count: deterministic and fast); the rest are scored. One
    probe per layer covers all span lengths; its balanced accuracy (mean per-class recall over the labels
    present, so predicting the majority label scores 1 / #labels) is then reported per span length.
    """
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    split = max(1, int(len(states) * train_fraction))
    if split >= len(states):
        raise ValueError(
            f"need at least two sentences to split into probe train and test sets, got {len(states)}"
        )

    def gather(rows: range) -> tuple[Tensor, Tensor, Tensor]:
        feats, labels, lengths = [], [], []
        for r in rows:
            spans = torch.tensor(targets[r], dtype=torch.long).view(-1, 3)
            if len(spans) == 0:
                continue
            # [layers+1, spans, 2D]: state before the span and at its last word (input positions i and j).
            feats.append(torch.cat([states[r][:, spans[:, 0]], states[r][:, spans[:, 1]]], -1))
            labels.append(spans[:, 2])
            lengths.append(spans[:, 1] - spans[:, 0])
        if not feats:
            raise ValueError("no spans to probe: sentences too short for the span lengths asked")
        return torch.cat(feats, 1), torch.cat(labels), torch.cat(lengths)

    train_x, train_y, _ = gather(range(split))
    test_x, test_y, test_len = gather(range(split, len(states)))
    accuracy = torch.full((train_x.shape[0], max_span + 1), float("nan"))
    for layer in range(train_x.shape[0]):
        mean, std, weights = _ridge_fit(train_x[layer], train_y, num_classes, alpha)
        x = torch.cat([(test_x[layer] - mean) / std, torch.ones(len(test_x[layer]), 1)], 1)
        predicted = (x @ weights).argmax(-1)
        for k in range(max_span + 1):
            chosen = test_len == k
            if chosen.any():
                accuracy[layer, k] = _balanced_accuracy(predicted[chosen], test_y[chosen])
    return accuracy


class LayerwiseProbe(Callback):
    """Linear probes of the Viterbi span labels on every layer, after each validation (module docstring).

    Logs ``probe/layer{l}`` (accuracy over all probed spans of layer l, lengths weighted equally) and
    ``probe/layer{l}_span{k}`` (spans of k words), and keeps the latest ``[layers+1, max_span+1]`` accuracy
    table in :attr:`accuracy` (in checkpoints too); ``history`` holds ``(global_step, table)``. :meth:`probe`
    runs the same measurement on any model.

    Args:
        num_sentences: Validation sentences used (70 % train the probes, 30 % score them).
        min_span: Shortest span probed (1 would include the preterminals).
        max_span: Longest span probed.
        alpha: Ridge regularisation of the probes, relative to the number of spans.
        batch_size: Sentences per forward pass.
    """

    def __init__(
        self,
        num_sentences: int = 256,
        *,
        min_span: int = 2,
        max_span: int = 8,
        alpha: float = 1e-3,
        batch_size: int = 64,
    ) -> None:
        if not 1 <= min_span <= max_span:
            raise ValueError(f"need 1 <= min_span <= max_span, got {min_span}, {max_span}")
        if num_sentences < 2:
            raise ValueError(f"num_sentences must be >= 2 (train and test probes), got {num_sentences}")
        self.num_sentences, self.min_span, self.max_span = num_sentences, min_span, max_span
        self.alpha, self.batch_size = alpha, batch_size
        self.accuracy: Tensor | None = None
        self.history: list[tuple[int, Tensor]] = []
        self._targets: list[list[tuple[int, int, int]]] | None = None

    def probe(self, model: torch.nn.Module, datamodule: PCFGDataModule) -> Tensor:
        """The ``[layers+1, max_span+1]`` held-out accuracy table of ``model`` on the DataModule's sentences."""
        sentences = datamodule.val_sentences[: self.num_sentences]
        if self._targets is None:
            self._targets = span_targets(
                datamodule.grammar, sentences, max_span=self.max_span, min_span=self.min_span
            )
        states = hidden_states(
            model,
            sentences,
            token_ids=datamodule.token_ids,
            bos_id=datamodule.bos_id,
            pad_id=datamodule.eos_id,
            batch_size=self.batch_size,
        )
        return probe_accuracy(
            states,
            self._targets,
            num_classes=datamodule.grammar.num_nonterminals + 1,
            max_span=self.max_span,
            alpha=self.alpha,
        )

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.accuracy = self.probe(_backbone(pl_module), _pcfg_datamodule(trainer, type(self).__name__))
        self.history.append((trainer.global_step, self.accuracy.clone()))
        for layer, row in enumerate(self.accuracy):
            pl_module.log(f"probe/layer{layer}", float(row.nanmean()), rank_zero_only=False, sync_dist=False)
            for span in range(self.min_span, self.max_span + 1):
                if not torch.isnan(row[span]):
                    pl_module.log(f"probe/layer{layer}_span{span}", float(row[span]), sync_dist=False)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"accuracy": self.accuracy, "history": list(self.history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.accuracy = state_dict["accuracy"]
        self.history = list(state_dict["history"])
