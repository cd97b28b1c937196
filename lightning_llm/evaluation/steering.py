r"""The Cylindrical Representation Hypothesis (CRH, mbzuai-nlp/CRH): geometry of concept steering directions.

For each sample :math:`q` (a prompt), the per-sample difference vector is read at the last token after a decoder
layer :math:`\ell` (:func:`~lightning_llm.callbacks.steering.last_token_hidden`):

.. math::
    d_q = h_\ell(q \oplus y^{+}_q) - h_\ell(q \oplus y^{-}_q),

with :math:`y^+_q` a response expressing the concept and :math:`y^-_q` one without it. The hypothesis is that
the :math:`d_q` lie on a *cylinder* around a shared axis

.. math::
    a = \frac1N \sum_q d_q, \qquad \hat a = a / \lVert a \rVert, \qquad
    \cos\theta_q = \frac{\langle d_q, a\rangle}{\lVert d_q\rVert\,\lVert a\rVert},

with a per-sample *normal direction* in the plane orthogonal to the axis

.. math::
    u_q = \frac{d_q - \langle d_q, \hat a\rangle \hat a}{\lVert d_q - \langle d_q, \hat a\rangle \hat a\rVert}.

Penalty steering of sample :math:`q` with length :math:`L` and penalty :math:`p \in [0, 1]` adds

.. math::
    v_q(L, p) = L\,\big(\cos\theta_q\, \hat a + (1 - p)\,\sin\theta_q\, u_q\big)

to the residual stream (``p = 1``: axis only, length :math:`L\cos\theta_q`; ``p = 0``: :math:`L\, d_q/\lVert d_q\rVert`).
The paper's predictions checked here: a sample's steerability by the axis falls with :math:`\theta_q` (large
:math:`\sin\theta_q` needs a larger :math:`L`), the low-dimensional *normal plane* spanned by the
:math:`d_q - \langle d_q,\hat a\rangle\hat a` is recoverable from the differences, while the *sector* (where in
that plane :math:`u_q` points) is not predictable from the input.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from lightning_llm.callbacks.steering import ActivationSteering

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ConceptDetector",
    "CylindricalAnalysis",
    "LLMJudgeDetector",
    "RegexConceptDetector",
    "Steerability",
    "sector_predictability",
    "steerability",
    "steerability_correlation",
    "steerability_relation",
    "steered_generations",
]

_EPS = 1e-12


def _unit_rows(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)


def _fold_ids(n: int, folds: int, seed: int) -> Tensor:
    if not 2 <= folds <= n:
        raise ValueError(f"folds must be in [2, {n}], got {folds}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    ids = torch.empty(n, dtype=torch.long)
    ids[perm] = torch.arange(n) % folds
    return ids


class CylindricalAnalysis:
    r"""CRH geometry of per-sample difference vectors :math:`d_q` (``[N, D]``; computed in float64).

    ``axis`` defaults to the samples' own mean difference. The authors measure held-out samples against the
    axis of the *training* questions (``penalty_exp/*``, ``compute_diffmean_from_training`` then
    ``compute_angle_components``): pass that mean as ``axis``, or use :meth:`held_out`.

    Attributes (all tensors, float64):
        differences: the :math:`d_q`, ``[N, D]``.
        axis: :math:`a` (by default :math:`\mathrm{mean}_q d_q`), ``[D]``; ``axis_unit`` is :math:`\hat a`.
        axial: :math:`\langle d_q, \hat a\rangle`, ``[N]``.
        cos_theta / sin_theta / theta: :math:`\cos\theta_q`, :math:`\sin\theta_q = \sqrt{1-\cos^2\theta_q}`,
            :math:`\theta_q \in [0, \pi]`, ``[N]``.
        normal_components: :math:`d_q - \langle d_q,\hat a\rangle\hat a`, ``[N, D]`` (they sum to zero when
            the axis is the samples' own mean).
        normal_directions: :math:`u_q`, ``[N, D]`` (zero where the normal component vanishes).
    """

    def __init__(self, differences: Tensor, axis: Tensor | None = None) -> None:
        if differences.ndim != 2 or differences.shape[0] < 2:
            raise ValueError(f"differences must be [N >= 2, D], got {tuple(differences.shape)}")
        d = differences.detach().to(torch.float64).cpu()
        if axis is not None and tuple(axis.shape) != (d.shape[1],):
            raise ValueError(f"axis must be [{d.shape[1]}], got {tuple(axis.shape)}")
        self.differences = d
        self.axis = d.mean(0) if axis is None else axis.detach().to(torch.float64).cpu()
        norm = self.axis.norm()
        if norm <= _EPS:
            raise ValueError("the mean difference is zero: there is no axis")
        self.axis_unit = self.axis / norm
        self.axial = d @ self.axis_unit
        self.cos_theta = (self.axial / d.norm(dim=-1).clamp_min(_EPS)).clamp(-1.0, 1.0)
        self.sin_theta = (1.0 - self.cos_theta**2).clamp_min(0.0).sqrt()
        self.theta = torch.arccos(self.cos_theta)
        self.normal_components = d - self.axial[:, None] * self.axis_unit
        lengths = self.normal_components.norm(dim=-1, keepdim=True)
        self.normal_directions = torch.where(
            lengths > _EPS, self.normal_components / lengths.clamp_min(_EPS), 0.0
        )

    @classmethod
    def held_out(cls, train: Tensor, differences: Tensor) -> CylindricalAnalysis:
        """The geometry of ``differences`` against the axis of other samples, ``train`` (``[M >= 1, D]``).

        The authors' protocol: the axis (their *diffmean*) is the mean difference of the training questions of
        a concept, and each test question's angle is measured against it.
        """
        if train.ndim != 2 or train.shape[0] < 1:
            raise ValueError(f"train must be [M >= 1, D], got {tuple(train.shape)}")
        return cls(differences, axis=train.detach().to(torch.float64).cpu().mean(0))

    @property
    def num_samples(self) -> int:
        return self.differences.shape[0]

    def length_grid(self, steps: int = 25, max_multiple: float = 3.0) -> Tensor:
        r"""The authors' steering lengths: ``steps`` equal steps up to ``max_multiple`` :math:`\lVert a\rVert`.

        ``linspace(0, max_multiple * ‖a‖, steps + 1)[1:]`` (``penalty_exp/*``: 25 steps to 3 ‖a‖), ``[steps]``.
        """
        if steps < 2 or max_multiple <= 0:
            raise ValueError(f"steps must be >= 2 and max_multiple > 0, got {steps}, {max_multiple}")
        return torch.linspace(0.0, max_multiple * float(self.axis.norm()), steps + 1, dtype=torch.float64)[1:]

    # ------------------------------------------------------------------ the normal plane

    def normal_plane(self, k: int = 2) -> Tensor:
        r"""``[k, D]`` orthonormal basis of the principal subspace of the normal components.

        The top-``k`` right singular vectors of :math:`[d_q - \langle d_q,\hat a\rangle\hat a]_q` (PCA when the
        axis is the samples' own mean: these components then have mean zero, since
        :math:`\frac1N\sum_q \langle d_q,\hat a\rangle\hat a = a`; with a held-out axis, the uncentred basis).
        The authors' code has no such plane: this is our reading of the paper's normal plane.
        """
        _, _, vh = torch.linalg.svd(self.normal_components, full_matrices=False)
        if not 1 <= k <= vh.shape[0]:
            raise ValueError(f"k must be in [1, {vh.shape[0]}], got {k}")
        return vh[:k]

    def normal_variance_explained(self, k: int = 2) -> float:
        """Fraction of the normal components' energy (squared norm) inside :meth:`normal_plane` ``(k)``."""
        s = torch.linalg.svdvals(self.normal_components)
        return float((s[:k] ** 2).sum() / (s**2).sum().clamp_min(_EPS))

    def plane_coordinates(self, k: int = 2, *, normalise: bool = True) -> Tensor:
        r"""``[N, k]`` coordinates of :math:`u_q` in the :meth:`normal_plane` basis (re-normalised within it).

        The *sector* of sample :math:`q` is the direction of this vector, e.g. its angle for ``k = 2``.
        """
        coords = self.normal_directions @ self.normal_plane(k).T
        return _unit_rows(coords) if normalise else coords

    def plane_recoverability(self, k: int = 2, folds: int = 5, seed: int = 0) -> float:
        r"""Cross-validated fraction of held-out normal energy captured by a plane fitted on the other folds.

        Per fold: the axis and the top-``k`` normal plane are fitted on the training samples; the held-out
        samples' normal components (w.r.t. the training axis) are projected on that plane. Close to
        :meth:`normal_variance_explained` when the plane is a property of the concept, near ``k / (D - 1)``
        when the normal components are isotropic noise.
        """
        ids = _fold_ids(self.num_samples, folds, seed)
        inside = total = 0.0
        for f in range(folds):
            train = CylindricalAnalysis(self.differences[ids != f])
            held = self.differences[ids == f]
            normal = held - (held @ train.axis_unit)[:, None] * train.axis_unit
            inside += float(((normal @ train.normal_plane(k).T) ** 2).sum())
            total += float((normal**2).sum())
        return inside / max(total, _EPS)

    # ------------------------------------------------------------------ steering vectors

    def penalty_vector(self, q: int, length: float, p: float) -> Tensor:
        r""":math:`v_q = L\,(\cos\theta_q\,\hat a + (1-p)\,\sin\theta_q\,u_q)`, ``[D]`` float64.

        ``p = 1`` is the pure axis vector of length :math:`L\cos\theta_q`; ``p = 0`` is :math:`L\,d_q/\lVert d_q\rVert`.
        """
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        return length * (
            self.cos_theta[q] * self.axis_unit + (1.0 - p) * self.sin_theta[q] * self.normal_directions[q]
        )

    def penalty_vectors(self, length: float, p: float) -> Tensor:
        r"""``[N, D]``: :meth:`penalty_vector` of every sample (for per-row steering of a whole batch at once)."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        return length * (
            self.cos_theta[:, None] * self.axis_unit
            + (1.0 - p) * self.sin_theta[:, None] * self.normal_directions
        )

    def sweep(
        self,
        success_fn: Callable[[int, Tensor], float],
        lengths: Sequence[float],
        penalties: Sequence[float] = (1.0,),
        samples: Sequence[int] | None = None,
    ) -> Tensor:
        r"""``[S, P, len(lengths)]`` of ``success_fn(q, penalty_vector(q, L, p))`` over samples, ``p`` and ``L``.

        ``success_fn(q, v)`` steers sample ``q`` with ``v`` and scores it (e.g. the concept rate of its
        generations, see :func:`steered_generations` and a :class:`ConceptDetector`). ``samples`` defaults to
        all. Feed ``result[:, i]`` to :func:`steerability` for penalty ``penalties[i]``.
        """
        qs = range(self.num_samples) if samples is None else samples
        out = torch.empty(len(qs), len(penalties), len(lengths), dtype=torch.float64)
        for i, q in enumerate(qs):
            for j, p in enumerate(penalties):
                for k, length in enumerate(lengths):
                    out[i, j, k] = float(success_fn(q, self.penalty_vector(q, length, p)))
        return out


# ------------------------------------------------------------------------------------------ steerability


@dataclass(frozen=True)
class Steerability:
    """Per-sample and per-concept steerability from a success grid over sorted lengths ``L``.

    Attributes:
        per_sample: ``[S]`` the first ``L`` at which a sample's success reaches the threshold (``inf``: never).
            Ours: the authors' code has no per-sample steerability.
        slope: least-squares slope of the mean success over samples vs ``L`` (per concept).
        lengths: the grid.
        step_slope: the authors' steerability (``visualization/sincos_rel.py``,
            ``calculate_steerability_from_all_outputs``): the least-squares slope of the mean success over
            samples vs the *step number* 1, 2, …, ``len(lengths)``. On the authors' grid (equal steps up to
            3 ‖a‖, :meth:`CylindricalAnalysis.length_grid`) it is ``slope`` times the step ``3 ‖a‖ / 25``.
    """

    per_sample: Tensor
    slope: float
    lengths: Tensor
    step_slope: float


def steerability(success: Tensor, lengths: Sequence[float], threshold: float = 0.5) -> Steerability:
    """Steerability from ``success`` (``[S, len(lengths)]`` or ``[len(lengths)]``) on a sorted ``lengths`` grid."""
    grid = torch.as_tensor(lengths, dtype=torch.float64)
    if grid.ndim != 1 or len(grid) < 2 or bool((grid[1:] <= grid[:-1]).any()):
        raise ValueError("lengths must be a strictly increasing sequence of at least two values")
    s = torch.as_tensor(success, dtype=torch.float64)
    s = s[None] if s.ndim == 1 else s
    if s.ndim != 2 or s.shape[1] != len(grid):
        raise ValueError(f"success must be [S, {len(grid)}], got {tuple(s.shape)}")
    reached = s >= threshold
    first = reached.to(torch.int8).argmax(-1)
    per_sample = torch.where(reached.any(-1), grid[first], torch.tensor(math.inf, dtype=torch.float64))
    mean = s.mean(0)
    slope = _ls_slope(grid, mean)
    steps = torch.arange(1, len(grid) + 1, dtype=torch.float64)
    return Steerability(per_sample=per_sample, slope=slope, lengths=grid, step_slope=_ls_slope(steps, mean))


def _ls_slope(x: Tensor, y: Tensor) -> float:
    centred = x - x.mean()
    return float((centred * (y - y.mean())).sum() / (centred**2).sum())


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions), as Spearman's rho needs."""
    _values, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    starts = np.cumsum(counts) - counts
    return (starts + (counts - 1) / 2.0)[inverse]


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    xc, yc = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((xc**2).sum() * (yc**2).sum()))
    return float((xc * yc).sum() / denom) if denom > 0 else math.nan


def steerability_correlation(
    per_sample: Tensor,
    sin_theta: Tensor,
    cos_theta: Tensor,
    never: Literal["exclude", "cap"] = "exclude",
) -> dict[str, float]:
    r"""Pearson and Spearman correlations of per-sample steerability with :math:`\sin\theta_q` and :math:`\cos\theta_q`.

    CRH predicts a positive correlation with :math:`\sin\theta` (samples far from the axis need larger
    :math:`L`) and a negative one with :math:`\cos\theta`. Samples never steered (``inf``) are dropped
    (``never="exclude"``) or set to twice the largest finite value (``"cap"``, which keeps them in the ranks).

    Returns ``{"pearson_sin", "spearman_sin", "pearson_cos", "spearman_cos", "n"}`` (``nan`` when a side is
    constant or fewer than 3 samples remain).
    """
    s = torch.as_tensor(per_sample, dtype=torch.float64).cpu().numpy().copy()
    sin = torch.as_tensor(sin_theta, dtype=torch.float64).cpu().numpy()
    cos = torch.as_tensor(cos_theta, dtype=torch.float64).cpu().numpy()
    if not s.shape == sin.shape == cos.shape or s.ndim != 1:
        raise ValueError("per_sample, sin_theta and cos_theta must be 1-D of the same length")
    finite = np.isfinite(s)
    if never == "cap":
        s[~finite] = 2.0 * s[finite].max() if finite.any() else 1.0
        keep = np.ones_like(finite)
    elif never == "exclude":
        keep = finite
    else:
        raise ValueError(f"never must be 'exclude' or 'cap', got {never!r}")
    s, sin, cos = s[keep], sin[keep], cos[keep]
    out = {"n": float(len(s))}
    for name, x in (("sin", sin), ("cos", cos)):
        ok = len(s) >= 3
        out[f"pearson_{name}"] = _pearson(s, x) if ok else math.nan
        out[f"spearman_{name}"] = _pearson(_ranks(s), _ranks(x)) if ok else math.nan
    return out


def steerability_relation(
    sin_theta: Tensor,
    cos_theta: Tensor,
    steerability: Tensor,
    axis_norm: Tensor,
    *,
    power: float = 2.0,
    cos_power: float = 0.0,
) -> dict[str, float]:
    r"""The authors' steerability–angle relation: Pearson :math:`r` of :math:`x_q` and :math:`y_q` over samples.

    .. math::
        x_q = \sin^{P}\theta_q\, \cos^{c}\theta_q, \qquad y_q = s_{c(q)} / \lVert a_{c(q)}\rVert^{P}

    with :math:`s` the steerability of sample :math:`q`'s concept (its :attr:`Steerability.step_slope`, the same
    for every sample of a concept) and :math:`a` that concept's axis; ``power`` is :math:`P`, ``cos_power``
    :math:`c`. Inputs are per sample (``[N]``), pooled over concepts. This is ``visualization/sincos_rel.py``
    for one exponent pair (there :math:`c = p - t` with :math:`p + t = P`); the authors plot, for each
    :math:`P`, the *largest* :math:`r` over a grid of :math:`p`, a maximum over exponents that a caller doing
    the same search must account for. Returns ``{"pearson", "n"}`` (``nan`` below 3 finite samples or for a
    constant side).
    """
    arrays = [
        torch.as_tensor(v, dtype=torch.float64).cpu().numpy()
        for v in (sin_theta, cos_theta, steerability, axis_norm)
    ]
    sin, cos, steer, norm = arrays
    if not sin.shape == cos.shape == steer.shape == norm.shape or sin.ndim != 1:
        raise ValueError("sin_theta, cos_theta, steerability and axis_norm must be 1-D of the same length")
    if bool((norm <= 0).any()):
        raise ValueError("axis_norm must be positive")
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.abs(sin) ** power * np.abs(cos) ** cos_power
        y = steer / norm**power
    keep = np.isfinite(x) & np.isfinite(y)
    n = int(keep.sum())
    return {"pearson": _pearson(x[keep], y[keep]) if n >= 3 else math.nan, "n": float(n)}


# -------------------------------------------------------------------------------------------- the sector


def sector_predictability(
    features: Tensor,
    targets: Tensor,
    alpha: float = 1.0,
    folds: int = 5,
    seed: int = 0,
) -> dict[str, float]:
    r"""How well a ridge regression from input features predicts each sample's sector, cross-validated.

    ``targets`` are the in-plane directions of :math:`u_q` (``CylindricalAnalysis.plane_coordinates(k)``,
    ``[N, k]``); ``features`` anything known before the response (e.g. the pre-response hidden state,
    ``[N, F]``). Per fold, features are standardised with the training fold's statistics and
    :math:`W = (X^\top X + \alpha I)^{-1} X^\top (Y - \bar Y)` is fitted. Returns out-of-fold
    ``{"r2", "mean_cosine", "n"}``: :math:`R^2 = 1 - \sum\lVert y - \hat y\rVert^2 / \sum\lVert y - \bar y_{train}\rVert^2`
    (0 or below: no better than the mean) and the mean cosine between :math:`\hat y` and :math:`y` (0 for a
    predictor that knows nothing about the direction).
    """
    x = torch.as_tensor(features, dtype=torch.float64).cpu()
    y = torch.as_tensor(targets, dtype=torch.float64).cpu()
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"features [N, F] and targets [N, k] needed, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    ids = _fold_ids(x.shape[0], folds, seed)
    pred = torch.empty_like(y)
    baseline = torch.empty_like(y)
    for f in range(folds):
        tr, te = ids != f, ids == f
        mu, sd = x[tr].mean(0), x[tr].std(0).clamp_min(1e-8)
        xtr, xte = (x[tr] - mu) / sd, (x[te] - mu) / sd
        ymean = y[tr].mean(0)
        gram = xtr.T @ xtr + alpha * torch.eye(x.shape[1], dtype=torch.float64)
        w = torch.linalg.solve(gram, xtr.T @ (y[tr] - ymean))
        pred[te] = xte @ w + ymean
        baseline[te] = ymean
    r2 = 1.0 - float(((y - pred) ** 2).sum() / ((y - baseline) ** 2).sum().clamp_min(_EPS))
    cosine = float((_unit_rows(pred) * _unit_rows(y)).sum(-1).mean())
    return {"r2": r2, "mean_cosine": cosine, "n": float(x.shape[0])}


# ------------------------------------------------------------------------------------------- detectors


@runtime_checkable
class ConceptDetector(Protocol):
    """Anything that says, per text, whether it expresses the concept."""

    def __call__(self, texts: Sequence[str]) -> list[bool]: ...


class RegexConceptDetector:
    """Concept present iff ``re.search(pattern, text)`` matches (synthetic concepts, marker tokens)."""

    def __init__(self, pattern: str | re.Pattern[str], flags: int = 0) -> None:
        self.pattern = re.compile(pattern, flags) if isinstance(pattern, str) else pattern

    def __call__(self, texts: Sequence[str]) -> list[bool]:
        return [self.pattern.search(t) is not None for t in texts]


_JUDGE_TEMPLATE = (
    "Does the following text express the concept '{concept}'? Answer with exactly one word, yes or no.\n\n"
    "Text: {text}\n\nAnswer:"
)


class LLMJudgeDetector:
    """Concept detection by a judge model: any callable ``judge(prompt) -> str`` (an API client, a local model).

    The judge's reply is only *parsed*, never executed: after stripping whitespace, surrounding quotes and
    trailing punctuation and lower-casing, it must be exactly ``"yes"`` or ``"no"``. Anything else raises
    ``ValueError`` (``on_invalid="raise"``) or counts as absent (``"false"``).

    Args:
        judge: ``prompt -> reply``.
        concept: the concept's description, inserted in the prompt.
        template: prompt with ``{concept}`` and ``{text}`` fields.
        on_invalid: ``"raise"`` or ``"false"``.
    """

    def __init__(
        self,
        judge: Callable[[str], str],
        concept: str,
        template: str = _JUDGE_TEMPLATE,
        on_invalid: Literal["raise", "false"] = "raise",
    ) -> None:
        if on_invalid not in ("raise", "false"):
            raise ValueError(f"on_invalid must be 'raise' or 'false', got {on_invalid!r}")
        if "{text}" not in template:
            raise ValueError("template needs a {text} field")
        self.judge = judge
        self.concept = concept
        self.template = template
        self.on_invalid = on_invalid

    @staticmethod
    def parse(reply: str) -> bool | None:
        """``True`` for yes, ``False`` for no, ``None`` for anything else."""
        word = reply.strip().strip("\"'`").rstrip(".!").strip().lower()
        return {"yes": True, "no": False}.get(word)

    def __call__(self, texts: Sequence[str]) -> list[bool]:
        out = []
        for text in texts:
            reply = self.judge(self.template.format(concept=self.concept, text=text))
            verdict = self.parse(reply) if isinstance(reply, str) else None
            if verdict is None:
                if self.on_invalid == "raise":
                    raise ValueError(f"judge reply is not a plain yes/no: {reply!r}")
                verdict = False
            out.append(verdict)
        return out


# ------------------------------------------------------------------------------------------ generation


@torch.no_grad()
def steered_generations(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    vector: Tensor | None,
    layer: int,
    *,
    multiplier: float = 1.0,
    positions: Literal["prompt", "all"] = "all",
    max_new_tokens: int = 8,
    batch_size: int = 32,
    **generate_kwargs: Any,
) -> list[str]:
    """Decoded continuations of ``prompts`` with ``vector`` added at layer ``layer`` (``None``: unsteered).

    ``vector`` is ``[hidden]`` (the same for every prompt) or ``[len(prompts), hidden]`` (one per prompt, added
    row-wise, so a per-sample sweep runs as one batched ``generate``). Batched with left padding (the
    tokenizer's side is restored afterwards); greedy unless ``generate_kwargs`` say otherwise. Only the new
    tokens are decoded, special tokens skipped.
    """
    if vector is not None and vector.ndim == 2 and vector.shape[0] != len(prompts):
        raise ValueError(f"{vector.shape[0]} per-prompt vectors for {len(prompts)} prompts")
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    kwargs = {"do_sample": False, "pad_token_id": tokenizer.pad_token_id, **generate_kwargs}
    out: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start : start + batch_size])
            enc = tokenizer(chunk, return_tensors="pt", padding=True).to(device)
            rows = vector[start : start + batch_size] if vector is not None and vector.ndim == 2 else vector
            if rows is None:
                ids = model.generate(**enc, max_new_tokens=max_new_tokens, **kwargs)
            else:
                steering = ActivationSteering(rows, layer=layer, multiplier=multiplier, positions=positions)
                with steering.attach(model):
                    ids = model.generate(**enc, max_new_tokens=max_new_tokens, **kwargs)
            out.extend(tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    finally:
        tokenizer.padding_side = side
    return out
