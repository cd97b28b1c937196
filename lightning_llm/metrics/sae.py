r"""Metrics of sparse autoencoders (SAEs) on residual-stream activations, as FAST (arXiv 2506.07691) reports
them.

An SAE (:class:`SAELike`) maps an activation :math:`x \in \mathbb{R}^{d}` to non-negative feature activations
:math:`f = \mathrm{enc}(x) \in \mathbb{R}^{m}_{\ge 0}` and back, :math:`\hat x = \mathrm{dec}(f)`. Over real
(non-padding) tokens :math:`t` of sequences :math:`s`:

* :class:`SequenceMSE`: per sequence the mean squared reconstruction error over its tokens
  :math:`\mathcal{T}_s` (all real tokens, or only the *special* ones, e.g. chat-template tokens),
  averaged over the sequences with :math:`|\mathcal{T}_s| \ge 1`,

  .. math:: \mathrm{MSE} = \frac{1}{|\{s : |\mathcal{T}_s| \ge 1\}|} \sum_{s : |\mathcal{T}_s| \ge 1}
        \frac{1}{|\mathcal{T}_s|} \sum_{t \in \mathcal{T}_s} \lVert x_t - \hat x_t \rVert_2^2,

  optionally reported as :math:`\log_2 \mathrm{MSE}` (FAST's tables).
* :class:`ExplainedVariance`: pooled over all tokens, with :math:`\bar x` the mean activation over tokens,

  .. math:: \mathrm{EV} = 1 - \frac{\sum_t \lVert x_t - \hat x_t\rVert^2}{\sum_t \lVert x_t - \bar x\rVert^2}.

* :class:`MeanL0`: :math:`\frac1N \sum_t |\{i : f_{t,i} > 0\}|`, active features per token.
* :class:`DeadFeatures`: the share of features that fired on none of the last ``window_tokens`` tokens.
* :func:`delta_loss` / :class:`DeltaLoss`: the LM's next-token cross entropy clean (:math:`L_0`), with the SAE
  reconstruction spliced into the residual stream at decoder layer :math:`\ell` (:math:`L_{\mathrm{SAE}}`) and
  with that layer's output zero-ablated (:math:`L_{\mathrm{zero}}`),

  .. math:: \Delta L = \frac{L_{\mathrm{SAE}} - L_0}{L_0}, \qquad
        \mathrm{CE\ recovered} = \frac{L_{\mathrm{zero}} - L_{\mathrm{SAE}}}{L_{\mathrm{zero}} - L_0}.

Every metric keeps sums (fp64) or per-feature counters as ``torchmetrics`` states with a ``dist_reduce_fx``,
so accumulating over batches equals one pass over their concatenation, and DDP ranks holding different data
reduce exactly (:class:`DeadFeatures`: see its windowing under DDP).

The layer convention is :mod:`lightning_llm.callbacks.steering`'s: layer :math:`\ell` is the **output** of
decoder layer :math:`\ell` (0-based), read and written by a forward hook on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_llm.backbones import eval_mode
from lightning_llm.backbones.inspect import decoder_layers, layer_index
from lightning_llm.metrics.perplexity import token_nll_sum
from lightning_llm.types import IGNORE_INDEX

__all__ = [
    "DeadFeatures",
    "DeltaLoss",
    "ExplainedVariance",
    "MeanL0",
    "SAELike",
    "SequenceMSE",
    "delta_loss",
    "spliced_nll",
]


@runtime_checkable
class SAELike(Protocol):
    """What the metrics, the feature analyses and SAE steering need of a sparse autoencoder (an
    ``nn.Module``).

    Attributes:
        d_in: Width of the activations it reconstructs (the LM's hidden size).
        d_sae: Number of features.
        W_dec: ``[d_sae, d_in]`` decoder, unit-norm rows (the feature directions).
    """

    d_in: int
    d_sae: int
    W_dec: Tensor

    def encode(self, x: Tensor) -> Tensor:
        """``[..., d_in] -> [..., d_sae]`` dense feature activations, ``>= 0``."""
        ...

    def decode(self, f: Tensor) -> Tensor:
        """``[..., d_sae] -> [..., d_in]`` reconstruction."""
        ...

    def forward(self, x: Tensor) -> Tensor:
        """``decode(encode(x))``."""
        ...


def _rows(t: Tensor, mask: Tensor | None) -> Tensor:
    """``[N, d]``: the vectors of ``t [..., d]`` at ``mask [...]`` (all of them without a mask)."""
    if mask is None:
        return t.reshape(-1, t.shape[-1])
    if mask.shape != t.shape[:-1]:
        raise ValueError(f"mask {tuple(mask.shape)} does not match the leading dims of {tuple(t.shape)}")
    return t[mask.to(device=t.device, dtype=torch.bool)]


def _check_pair(x: Tensor, x_hat: Tensor) -> None:
    if x.shape != x_hat.shape:
        raise ValueError(f"x {tuple(x.shape)} and x_hat {tuple(x_hat.shape)} differ in shape")


# ------------------------------------------------------------------------------------------ reconstruction


class SequenceMSE(Metric):
    r"""Mean over sequences of the per-sequence mean squared reconstruction error (module docstring).

    ``update(x, x_hat, mask, special_mask=None)``: ``x``, ``x_hat`` are ``[b, T, d_in]``; ``mask`` ``[b, T]``
    marks real tokens; ``special_mask`` ``[b, T]`` the special ones (required with ``special_only``; its
    padding entries are ignored). The squared error of a token is :math:`\lVert x_t - \hat x_t\rVert_2^2`,
    summed over ``d_in`` (not averaged). Sequences without a selected token are skipped; :meth:`compute` is
    NaN when no sequence had one (e.g. ``special_only`` and no special token at all).

    Special and ordinary tokens are best reported apart: in an instruct model the chat-template tokens (the
    attention-sink ``<|im_start|>`` at position 0 above all) have norms far above the rest, so a pooled figure
    mostly measures them (on SmolLM2 a pooled explained variance of 0.99 was 0.73 on ordinary tokens).

    Args:
        special_only: Average over each sequence's special tokens only (FAST's MSE on special tokens).
        ordinary_only: Average over each sequence's ordinary (non-special) tokens only; needs ``special_mask``
            too. At most one of ``special_only`` and ``ordinary_only``.
        log2: Report :math:`\log_2` of the mean (FAST's tables); the mean itself is accumulated.
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    def __init__(
        self, special_only: bool = False, log2: bool = False, *, ordinary_only: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if special_only and ordinary_only:
            raise ValueError("special_only and ordinary_only exclude each other; pick one (or neither: all)")
        self.special_only, self.ordinary_only, self.log2 = special_only, ordinary_only, log2
        self.add_state("mse_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sequences", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, x: Tensor, x_hat: Tensor, mask: Tensor, special_mask: Tensor | None = None) -> None:
        _check_pair(x, x_hat)
        if x.ndim != 3 or mask.shape != x.shape[:2]:
            raise ValueError(
                f"expected x [b, T, d_in] and mask [b, T], got {tuple(x.shape)}, {tuple(mask.shape)}"
            )
        selected = mask.to(device=x.device, dtype=torch.bool)
        if self.special_only or self.ordinary_only:
            if special_mask is None:
                raise ValueError(
                    f"{'special' if self.special_only else 'ordinary'}_only=True needs special_mask"
                )
            if special_mask.shape != mask.shape:
                raise ValueError(
                    f"special_mask {tuple(special_mask.shape)} differs from mask {tuple(mask.shape)}"
                )
            special = special_mask.to(device=x.device, dtype=torch.bool)
            selected = selected & (special if self.special_only else ~special)
        error = (x.detach().double() - x_hat.detach().double()).square().sum(-1)  # [b, T]
        counts = selected.sum(-1)
        summed = torch.where(selected, error, torch.zeros_like(error)).sum(-1)
        keep = counts > 0
        self.mse_sum += (summed[keep] / counts[keep]).sum().to(self.mse_sum)
        self.sequences += keep.sum().to(self.sequences)

    def compute(self) -> Tensor:
        if self.sequences == 0:
            return torch.tensor(float("nan"), dtype=torch.float64, device=self.mse_sum.device)
        mean = self.mse_sum / self.sequences
        return torch.log2(mean) if self.log2 else mean


#: Relative size below which a difference of fp64 sums is rounding, not signal.
_ROUNDING = 1e-12


def _ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator``, NaN where the denominator is 0 (an undefined ratio, not ±inf)."""
    return torch.where(denominator != 0, numerator / denominator, torch.full_like(numerator, float("nan")))


class ExplainedVariance(Metric):
    r"""Explained variance pooled over tokens (:math:`\bar x` their mean),

    .. math:: \mathrm{EV} = 1 - \sum_t\lVert x_t-\hat x_t\rVert^2 \Big/ \sum_t\lVert x_t-\bar x\rVert^2.

    ``update(x, x_hat, mask=None)``: ``x``, ``x_hat`` ``[..., d_in]``, ``mask`` (the leading dims) marks real
    tokens. The states are fp64 sums :math:`N`, :math:`\sum_t x_t` (a ``[d_in]`` vector),
    :math:`\sum_t \lVert x_t\rVert^2` and :math:`\sum_t\lVert x_t-\hat x_t\rVert^2`; the total variance is
    :math:`\sum_t\lVert x_t\rVert^2 - \lVert\sum_t x_t\rVert^2 / N`, so the result over several batches or
    ranks is exactly that of their concatenation (up to fp64 rounding). NaN before any token and when the
    tokens have no variance (a single token, or all equal: a group of special tokens that are all the same
    token), where the ratio is undefined; never ±inf.

    Args:
        d_in: Activation width. Optional on one process (the vector state is sized at the first update); pass
            it under DDP, where a rank that never updated would otherwise hold a state of another shape.
    """

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, d_in: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.d_in = d_in
        self.add_state("tokens", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("sum_x", torch.zeros(d_in or 0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum_sq_x", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("sum_sq_err", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, x: Tensor, x_hat: Tensor, mask: Tensor | None = None) -> None:
        _check_pair(x, x_hat)
        rows, rows_hat = _rows(x.detach(), mask).double(), _rows(x_hat.detach(), mask).double()
        if self.sum_x.numel() == 0:
            self.sum_x = torch.zeros(x.shape[-1], dtype=torch.float64, device=self.sum_x.device)
        if self.sum_x.numel() != x.shape[-1]:
            raise ValueError(f"activation width {x.shape[-1]}, the metric was built for {self.sum_x.numel()}")
        rows, rows_hat = rows.to(self.sum_x.device), rows_hat.to(self.sum_x.device)
        self.tokens += rows.shape[0]
        self.sum_x += rows.sum(0)
        self.sum_sq_x += rows.square().sum()
        self.sum_sq_err += (rows - rows_hat).square().sum()

    def compute(self) -> Tensor:
        if self.tokens == 0:
            return torch.tensor(float("nan"), dtype=torch.float64, device=self.sum_sq_x.device)
        total = self.sum_sq_x - self.sum_x.square().sum() / self.tokens
        # Zero total variance (one token, or all tokens equal) leaves EV undefined: NaN, not ±inf. The sums'
        # difference is then fp64 rounding of sum_sq_x, so anything below that counts as zero.
        if total <= _ROUNDING * self.sum_sq_x:
            return torch.tensor(float("nan"), dtype=torch.float64, device=self.sum_sq_x.device)
        return 1.0 - self.sum_sq_err / total


class MeanL0(Metric):
    r"""Mean number of active features (:math:`f_{t,i} > 0`) per real token.

    ``update(f, mask=None)``: ``f`` ``[..., d_sae]`` feature activations, ``mask`` (the leading dims) the real
    tokens. NaN before any token.
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("active", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("tokens", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, f: Tensor, mask: Tensor | None = None) -> None:
        rows = _rows(f.detach(), mask)
        self.active += (rows > 0).sum().to(self.active)
        self.tokens += rows.shape[0]

    def compute(self) -> Tensor:
        if self.tokens == 0:
            return torch.tensor(float("nan"), dtype=torch.float64, device=self.active.device)
        return self.active.double() / self.tokens


class DeadFeatures(Metric):
    r"""Fraction of features that fired on none of the last ``window_tokens`` real tokens seen.

    Windowing, exactly: the real tokens of each update are taken in row-major order of ``mask`` (sequence by
    sequence, position by position) and appended to one stream. The state ``since_fired[i]`` is the number of
    stream tokens *after* the last token on which feature :math:`i` fired (:math:`f_{t,i} > 0`), or a sentinel
    (:math:`2^{62}`) if it never fired. Feature :math:`i` is dead iff ``since_fired[i] >= window_tokens``: it
    did not fire on any of the last ``window_tokens`` tokens (all of them, while fewer were seen), and a
    feature that never fired is dead from the start. ``tokens_seen`` counts the stream.

    Persistence: the counters live until :meth:`reset` and are ``persistent`` states, so they travel in a
    checkpoint of a module holding the metric. The choice of window span is the caller's: logging the metric
    *object* with ``self.log`` makes Lightning reset it at every epoch end (a per-epoch window); log
    ``float(metric.compute())`` instead to keep counting across epochs, as SAE training usually does.

    DDP: each rank counts its own stream; ``since_fired`` is reduced with ``min``, so a feature is alive iff
    it fired within the last ``window_tokens`` tokens *of some rank* (about ``world_size × window_tokens``
    global tokens). ``tokens_seen`` is summed.

    ``update(f, mask=None)``: ``f`` ``[..., d_sae]``, ``mask`` (the leading dims) the real tokens.

    Args:
        d_sae: Number of features.
        window_tokens: The window, in tokens.
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    NEVER = 2**62

    def __init__(self, d_sae: int, window_tokens: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if d_sae < 1 or window_tokens < 1:
            raise ValueError(f"d_sae and window_tokens must be >= 1, got {d_sae}, {window_tokens}")
        self.d_sae, self.window_tokens = d_sae, window_tokens
        self.add_state(
            "since_fired",
            torch.full((d_sae,), self.NEVER, dtype=torch.long),
            dist_reduce_fx="min",
            persistent=True,
        )
        self.add_state(
            "tokens_seen", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum", persistent=True
        )

    def update(self, f: Tensor, mask: Tensor | None = None) -> None:
        rows = _rows(f.detach(), mask)
        if rows.shape[-1] != self.d_sae:
            raise ValueError(f"{rows.shape[-1]} features, the metric was built for d_sae={self.d_sae}")
        n = rows.shape[0]
        if n == 0:
            return
        fired = (rows > 0).to(self.since_fired.device)  # [n, d_sae]
        # tokens after the last firing = index of the first firing in the reversed batch (argmax: first max)
        since = fired.flip(0).to(torch.uint8).argmax(0)
        aged = torch.where(self.since_fired == self.NEVER, self.since_fired, self.since_fired + n)
        self.since_fired = torch.where(fired.any(0), since, aged)
        self.tokens_seen += n

    def dead_mask(self) -> Tensor:
        """``[d_sae]`` bool, True for the dead features (this process's states, not synchronised)."""
        return self.since_fired >= self.window_tokens

    def compute(self) -> Tensor:
        return self.dead_mask().double().mean()


# ------------------------------------------------------------------------------------------ ΔLoss


@contextmanager
def _replace_layer_output(
    model: nn.Module, layer: int, mask: Tensor, transform: Callable[[Tensor], Tensor]
) -> Iterator[None]:
    """While inside, decoder layer ``layer``'s output ``h`` is ``transform(h)`` at the real tokens."""
    layers = decoder_layers(model)
    index = layer_index(layer, len(layers))
    keep = mask.bool()[..., None]

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        replaced = torch.where(keep, transform(hidden), hidden)
        return (replaced, *output[1:]) if isinstance(output, tuple) else replaced

    # prepend: before any hook already on the layer (transformers 5 records hidden states with one).
    handle = layers[index].register_forward_hook(hook, prepend=True)
    try:
        yield
    finally:
        handle.remove()


def _sae_transform(sae: SAELike, scale: float) -> Callable[[Tensor], Tensor]:
    """``h -> sae(c·h) / c`` in the SAE's dtype and device, returned in ``h``'s."""
    reference = sae.W_dec

    def transform(hidden: Tensor) -> Tensor:
        x = hidden.to(device=reference.device, dtype=reference.dtype)
        return (sae(x * scale) / scale).to(device=hidden.device, dtype=hidden.dtype)

    return transform


@torch.no_grad()
def spliced_nll(
    model: nn.Module,
    sae: SAELike,
    layer: int,
    input_ids: Tensor,
    attention_mask: Tensor,
    labels: Tensor | None = None,
    *,
    scale: float = 1.0,
) -> tuple[Tensor, int]:
    r"""``([clean, spliced, zero], tokens)``: token-summed next-token NLL of three forward passes and the
    count.

    * clean: the model as is;
    * spliced: the output :math:`h` of decoder layer ``layer`` replaced at real tokens
      (``attention_mask == 1``) by :math:`\mathrm{sae}(c\,h) / c`, :math:`c` = ``scale``; padding untouched;
    * zero: that output set to 0 at real tokens.

    ``labels`` default to ``input_ids`` with padding set to ``-100``; position ``t`` predicts
    ``labels[t + 1]`` (HF convention, ``-100`` ignored). Runs in eval mode (restored after) without gradients.
    """
    if scale <= 0 or not math.isfinite(scale):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    if input_ids.shape != attention_mask.shape or input_ids.ndim != 2:
        raise ValueError(
            f"input_ids and attention_mask must both be [b, T], got {tuple(input_ids.shape)}, "
            f"{tuple(attention_mask.shape)}"
        )
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    if labels is None:
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    elif labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} differ from input_ids {tuple(input_ids.shape)}")
    labels = labels.to(device)
    tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())

    def nll() -> Tensor:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return token_nll_sum(logits, labels)

    with eval_mode(model):
        clean = nll()
        with _replace_layer_output(model, layer, attention_mask, _sae_transform(sae, scale)):
            spliced = nll()
        with _replace_layer_output(model, layer, attention_mask, torch.zeros_like):
            zero = nll()
    return torch.stack([clean, spliced, zero]).cpu(), tokens


class DeltaLoss(Metric):
    r"""Clean, SAE-spliced and zero-ablated next-token cross entropy, :math:`\Delta L` and CE recovered.

    ``update(model, sae, input_ids, attention_mask, labels=None)`` runs :func:`spliced_nll` and adds the
    token-summed NLLs and the token count to fp64/long sum states, so the per-token means
    :math:`L = \sum \mathrm{NLL} / N` and the ratios

    .. math:: \Delta L = \frac{L_{\mathrm{SAE}} - L_0}{L_0}, \qquad
        \mathrm{CE\ recovered} = \frac{L_{\mathrm{zero}} - L_{\mathrm{SAE}}}{L_{\mathrm{zero}} - L_0}

    are exact over batches and DDP ranks (pooled over tokens, not averaged over batches). :meth:`compute`
    returns a dict ``clean``, ``spliced``, ``zero`` (mean NLL per token), ``delta_loss`` and ``ce_recovered``
    (NaN without tokens, ``delta_loss`` NaN when the clean loss is 0, ``ce_recovered`` NaN when zero ablation
    does not change the loss: never ±inf).

    Args:
        layer: The decoder layer whose output is spliced (module docstring convention).
        scale: :math:`c`, the constant the SAE's inputs are scaled by
            (:math:`h \leftarrow \mathrm{sae}(c h)/c`).
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    def __init__(self, layer: int, scale: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layer, self.scale = layer, float(scale)
        for name in ("clean_nll", "spliced_nll", "zero_nll"):
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(
        self,
        model: nn.Module,
        sae: SAELike,
        input_ids: Tensor,
        attention_mask: Tensor,
        labels: Tensor | None = None,
    ) -> None:
        sums, tokens = spliced_nll(
            model, sae, self.layer, input_ids, attention_mask, labels, scale=self.scale
        )
        sums = sums.to(self.clean_nll.device)
        self.clean_nll += sums[0]
        self.spliced_nll += sums[1]
        self.zero_nll += sums[2]
        self.tokens += tokens

    def compute(self) -> dict[str, Tensor]:
        n = self.tokens.double()
        clean, spliced, zero = self.clean_nll / n, self.spliced_nll / n, self.zero_nll / n
        return {
            "clean": clean,
            "spliced": spliced,
            "zero": zero,
            "delta_loss": _ratio(spliced - clean, clean),
            "ce_recovered": _ratio(zero - spliced, zero - clean),
        }


def delta_loss(
    model: nn.Module,
    sae: SAELike,
    layer: int,
    input_ids: Tensor,
    attention_mask: Tensor,
    labels: Tensor | None = None,
    *,
    scale: float = 1.0,
) -> dict[str, float]:
    r"""FAST's Delta Loss of one batch: :class:`DeltaLoss` over ``input_ids``, as floats.

    Keys: ``clean``, ``spliced``, ``zero`` (mean next-token NLL per real token of the model as is, with
    :math:`h_\ell \leftarrow \mathrm{sae}(c\,h_\ell)/c` at the real tokens, and with
    :math:`h_\ell \leftarrow 0`), ``delta_loss`` :math:`= (L_{\mathrm{SAE}} - L_0)/L_0` and ``ce_recovered``
    :math:`= (L_{\mathrm{zero}} - L_{\mathrm{SAE}})/(L_{\mathrm{zero}} - L_0)`. See :func:`spliced_nll`.
    """
    metric = DeltaLoss(layer, scale=scale)
    metric.update(model, sae, input_ids, attention_mask, labels)
    return {name: float(value) for name, value in metric.compute().items()}
