r"""RepCore (arXiv 2602.00710): benchmark coresets from the *aligned hidden states* of a few source models.

Evaluating a model on a whole benchmark is expensive; a coreset method evaluates it on :math:`K` anchor items
and extrapolates the full score. The classic methods profile items by the correctness of many source models
(anchor points, IRT), which is unstable with few sources. RepCore profiles items by the source models' hidden
states instead, which carry far more than one bit per item and model:

1. **Extract** (:func:`extract_hidden_states`): :math:`X_m \in \mathbb R^{N\times D_m}`, one row per item, for
   each source model :math:`m = 1..M` (widths :math:`D_m` differ).
2. **Align** (:func:`align_representations`): each :math:`X_m` is centred, reduced to its top :math:`k`
   principal directions and scaled to unit Frobenius norm, :math:`Y_m = \tilde X_m P_m / \lVert \tilde X_m P_m
   \rVert_F` (optionally whitened, which makes the alignment a generalized CCA), then a **generalized
   Procrustes analysis** finds rotations and a consensus

   .. math::
       \min_{R_1..R_M \in O(k),\; Z} \sum_{m=1}^M \lVert Y_m R_m - Z \rVert_F^2,
       \qquad Z = \frac1M \sum_m Y_m R_m,

   by alternating orthogonal Procrustes steps :math:`R_m = U V^\top` with :math:`U \Sigma V^\top = Y_m^\top Z`.
   The per-model linear projection into the shared space is :math:`W_m = P_m R_m / s_m`.
3. **Select**: k-means (k-means++ init, seeded) on the consensus rows :math:`z_i`; the anchor of each cluster
   is its item nearest the centroid, with weight :math:`w_c = |C_c| / N`.
4. **Extrapolate** (:class:`AnchorRidge`): ridge regression from the source models' anchor correctness
   :math:`a_m \in \{0,1\}^K` to their full-benchmark score :math:`s_m`, shrunk towards the cluster weights

   .. math::
       \min_{c,\beta} \sum_m (s_m - c - a_m^\top \beta)^2 + \alpha \lVert \beta - w \rVert^2,

   so with few source models (large :math:`\alpha`, chosen by leave-one-out over the sources) it reduces to
   the stratified estimate :math:`\sum_c w_c a_{c}` plus a bias correction, and with many it learns which
   anchors matter. A new model's score is :math:`c + a^\top\beta` from its :math:`K` anchor results only.

The paper's exact alignment objective and regressor hyper-parameters are not given in its abstract; this is the
simplest reading of "per-model linear projections into a unified latent space" (a documented choice, not a
transcription). Baselines in the same API (``fit(correctness, ...)``, ``anchors``, ``predict``):
:class:`RandomCoreset` (uniform random items), :class:`AnchorPoints` (Vivek et al., 2023: cluster items by their
correctness vector across source models) and :class:`IRTCoreset` (tinyBenchmarks, Polo et al., 2024: a 2PL IRT
model, anchors clustered in item-parameter space, p-IRT extrapolation).
"""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch import Tensor

from lightning_llm.backbones import eval_mode, lightning_llm_home

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "Alignment",
    "AnchorPoints",
    "AnchorRidge",
    "IRTCoreset",
    "RandomCoreset",
    "RepCore",
    "align_representations",
    "extract_hidden_states",
    "score_multiple_choice",
    "spearman",
]

Pooling = Literal["last", "mean"]
ArrayLike = Tensor | np.ndarray


# ------------------------------------------------------------------------------------------ hidden states


def _model_fingerprint(model: nn.Module) -> str:
    """Config plus a strided sample of every parameter: changes when the weights do, cheap for large models."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    h.update((config.to_json_string() if config is not None else type(model).__name__).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            sample = flat[:: max(flat.numel() // 4096, 1)].float().cpu().contiguous()
            h.update(name.encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def _cache_path(kind: str, model: nn.Module, model_id: str | None, payload: object) -> Path:
    model_key = hashlib.sha256((model_id or _model_fingerprint(model)).encode()).hexdigest()[:16]
    items_key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    return lightning_llm_home() / "repcore_cache" / f"{kind}-{model_key}-{items_key}.safetensors"


def _load_or_compute(path: Path | None, compute) -> Tensor:
    from safetensors.torch import load_file, save_file

    if path is not None and path.is_file():
        return load_file(str(path))["value"]
    value = compute()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{id(value)}")
        save_file({"value": value.contiguous()}, str(tmp))
        tmp.replace(path)  # atomic: a concurrent reader sees the old state or the whole file
    return value


def _batches(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], batch_size: int):
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(list(texts[start : start + batch_size]), return_tensors="pt", padding=True)
        yield start, enc


@torch.no_grad()
def extract_hidden_states(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    pooling: Pooling = "mean",
    layer: int = -1,
    batch_size: int = 32,
    model_id: str | None = None,
    cache: bool = True,
) -> Tensor:
    """Per-item hidden states ``[N, D]`` (float32, CPU) of a causal LM.

    Args:
        pooling: ``"mean"`` over the prompt's tokens (default), or ``"last"``, the state at the last prompt
            token. The last-token state of a trained model is dominated by its *answer* (items cluster by
            predicted digit, not by what they test); mean pooling keeps the item's content, and gave clearly
            better coresets on :mod:`~lightning_llm.evaluation.skills_benchmark` (MAE 0.085 vs 0.107 at 10
            anchors, 10 source models), so it is the default.
        layer: index into ``output_hidden_states`` (0 = embeddings, -1 = last layer, after the final norm in
            Llama/Qwen implementations).
        model_id: identity of the model in the cache key; defaults to a fingerprint of its config and weights.
        cache: read/write ``lightning_llm_home()/repcore_cache/hidden-<model>-<items>.safetensors`` (keyed by
            the model, the prompts, pooling and layer), so re-runs are free.

    Works with left or right padding (the position of the last real token is read from the attention mask).
    """
    if pooling not in ("last", "mean"):
        raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
    if not prompts:
        raise ValueError("no prompts given")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    payload = {"prompts": list(prompts), "pooling": pooling, "layer": layer}
    path = _cache_path("hidden", model, model_id, payload) if cache else None

    def compute() -> Tensor:
        device = next(model.parameters()).device
        rows = []
        with eval_mode(model):
            for _, enc in _batches(tokenizer, prompts, batch_size):
                enc = enc.to(device)
                out = model(**enc, output_hidden_states=True, use_cache=False)
                h = out.hidden_states[layer].float()
                mask = enc["attention_mask"]
                if pooling == "last":
                    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # last position whose mask is 1
                    rows.append(h[torch.arange(h.shape[0], device=device), last].cpu())
                else:
                    m = mask.unsqueeze(-1).to(h.dtype)
                    rows.append(((h * m).sum(1) / m.sum(1).clamp_min(1)).cpu())
        return torch.cat(rows)

    return _load_or_compute(path, compute)


@torch.no_grad()
def score_multiple_choice(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    choices: Sequence[Sequence[str]],
    answers: Sequence[int],
    *,
    batch_size: int = 32,
    model_id: str | None = None,
    cache: bool = True,
) -> Tensor:
    r"""Correctness ``[N]`` (bool) of a causal LM on multiple-choice items, by comparing choice log-probabilities.

    Item :math:`i` is correct iff :math:`\log p(\text{choices}_i[\text{answers}_i] \mid \text{prompt}_i)` (the
    sum over the choice's tokens of ``prompt + choice``) is strictly the largest. When every choice adds one
    token to its prompt's tokenisation (digits, letters) this takes one forward per item; otherwise one per
    (item, choice). Cached like :func:`extract_hidden_states`.
    """
    if not (len(prompts) == len(choices) == len(answers)) or not prompts:
        raise ValueError(
            f"need equally many (>0) prompts, choices and answers, got {len(prompts)}, {len(choices)}, "
            f"{len(answers)}"
        )
    for i, (options, answer) in enumerate(zip(choices, answers, strict=True)):
        if len(options) < 2 or not 0 <= answer < len(options):
            raise ValueError(f"item {i}: need >= 2 choices and 0 <= answer < {len(options)}, got {answer}")
    payload = {"prompts": list(prompts), "choices": [list(c) for c in choices], "answers": list(answers)}
    path = _cache_path("mc", model, model_id, payload) if cache else None

    def compute() -> Tensor:
        device = next(model.parameters()).device
        prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        flat = [p + c for p, options in zip(prompts, choices, strict=True) for c in options]
        full_ids = tokenizer(flat, add_special_tokens=False)["input_ids"]
        # Per (item, choice): the continuation tokens, valid only if the prompt's tokens are a prefix.
        conts, k = [], 0
        for ids, options in zip(prompt_ids, choices, strict=True):
            row = []
            for _ in options:
                full = full_ids[k]
                k += 1
                row.append(full[len(ids) :] if full[: len(ids)] == ids and len(full) > len(ids) else None)
            conts.append(row)
        single = all(c is not None and len(c) == 1 for row in conts for c in row)
        scores: list[Tensor] = []
        with eval_mode(model):
            if single:
                for start in range(0, len(prompts), batch_size):
                    logp = _last_logprobs(model, tokenizer, prompt_ids[start : start + batch_size], device)
                    for j, row in enumerate(conts[start : start + batch_size]):
                        scores.append(logp[j, [c[0] for c in row]])
            else:
                pair_scores = _sequence_logprobs(model, tokenizer, prompt_ids, choices, full_ids, batch_size)
                k = 0
                for options in choices:
                    scores.append(pair_scores[k : k + len(options)])
                    k += len(options)
        correct = []
        for s, answer in zip(scores, answers, strict=True):
            others = torch.cat([s[:answer], s[answer + 1 :]])
            correct.append(bool(s[answer] > others.max()))
        return torch.tensor(correct)

    return _load_or_compute(path, compute)


def _pad(tokenizer: PreTrainedTokenizerBase, rows: list[list[int]], device) -> tuple[Tensor, Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):  # right padding: position i of a row never attends to padding
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids.to(device), mask.to(device)


def _last_logprobs(model, tokenizer, rows: list[list[int]], device) -> Tensor:
    ids, mask = _pad(tokenizer, rows, device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    last = mask.sum(1) - 1
    return logits[torch.arange(len(rows), device=device), last].log_softmax(-1).cpu()


def _sequence_logprobs(model, tokenizer, prompt_ids, choices, full_ids, batch_size) -> Tensor:
    """Sum of log p(choice tokens | prompt) per (item, choice), with the choice's tokens taken from the full
    tokenisation after the longest common prefix with the prompt's (robust to merges at the boundary)."""
    device = next(model.parameters()).device
    starts = []
    k = 0
    for ids, options in zip(prompt_ids, choices, strict=True):
        for _ in options:
            full = full_ids[k]
            common = 0
            while common < min(len(ids), len(full) - 1) and full[common] == ids[common]:
                common += 1
            starts.append(max(common, 1))
            k += 1
    out = []
    for b in range(0, len(full_ids), batch_size):
        rows = full_ids[b : b + batch_size]
        ids, mask = _pad(tokenizer, rows, device)
        logp = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().log_softmax(-1)
        token_logp = logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).cpu()
        for j, row in enumerate(rows):
            out.append(token_logp[j, starts[b + j] - 1 : len(row) - 1].sum())
    return torch.stack(out)


# ------------------------------------------------------------------------------------------------ alignment


@dataclass
class Alignment:
    """Result of :func:`align_representations`.

    Attributes:
        consensus: ``[N, k]`` shared representation :math:`Z` of the items.
        projections: per model ``[D_m, k]`` linear maps :math:`W_m` (applied to centred states).
        means: per model ``[D_m]`` centring vectors.
        residuals: per model :math:`\\lVert X_m W_m - Z\\rVert_F / \\lVert Z\\rVert_F` (0 = perfect agreement).
    """

    consensus: Tensor
    projections: list[Tensor]
    means: list[Tensor]
    residuals: list[float]

    def transform(self, model: int, states: ArrayLike) -> Tensor:
        """Map ``[n, D_model]`` states of source model ``model`` into the shared space, ``[n, k]``."""
        x = torch.as_tensor(states, dtype=torch.float64)
        if x.ndim != 2 or x.shape[1] != self.projections[model].shape[0]:
            raise ValueError(
                f"model {model} has width {self.projections[model].shape[0]}, got {tuple(x.shape)}"
            )
        return (x - self.means[model]) @ self.projections[model]

    def relative_map(self, source: int, target: int) -> Tensor:
        """Least-squares linear map from model ``source``'s (centred) space to ``target``'s through the shared
        space, :math:`W_{source} W_{target}^{+}` (``[D_source, D_target]``)."""
        return self.projections[source] @ torch.linalg.pinv(self.projections[target])


def _as_matrix(x: ArrayLike, name: str) -> Tensor:
    t = torch.as_tensor(x).detach().to(torch.float64).cpu()
    if t.ndim != 2:
        raise ValueError(f"{name} must be a 2-D [items, width] matrix, got shape {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} has non-finite values")
    return t


def align_representations(
    representations: Sequence[ArrayLike],
    dim: int | None = 16,
    *,
    whiten: bool = False,
    max_iter: int = 100,
    tol: float = 1e-10,
) -> Alignment:
    """Align per-item representations of several models (widths may differ) into one shared space.

    Generalized Procrustes analysis to a consensus after per-model PCA to ``dim`` dimensions and unit Frobenius
    scaling (every model weighs the same); see the module docstring for the objective. ``whiten=True`` scales
    each principal direction to unit variance first (a generalized-CCA reading: only correlation structure is
    aligned, not variance). ``dim=None`` keeps ``min(D_m, N - 1)`` over models.

    Raises:
        ValueError: fewer than two models, differing item counts, or ``dim`` out of range.
    """
    if len(representations) < 2:
        raise ValueError(f"need at least two source models to align, got {len(representations)}")
    xs = [_as_matrix(x, f"representations[{m}]") for m, x in enumerate(representations)]
    n = xs[0].shape[0]
    if any(x.shape[0] != n for x in xs):
        raise ValueError(
            f"all models must represent the same items, got item counts {[x.shape[0] for x in xs]}"
        )
    if n < 3:
        raise ValueError(f"need at least 3 items, got {n}")
    max_dim = min(min(x.shape[1] for x in xs), n - 1)
    k = max_dim if dim is None else dim
    if not 1 <= k <= max_dim:
        raise ValueError(f"dim must be in [1, {max_dim}] (smallest width, items - 1), got {dim}")
    means, bases, ys = [], [], []
    for x in xs:
        mean = x.mean(0)
        u, s, vh = torch.linalg.svd(x - mean, full_matrices=False)
        # Deterministic signs (the largest-magnitude loading of each direction positive): only for
        # reproducibility, Procrustes handles any sign.
        signs = torch.sign(vh[:k].gather(1, vh[:k].abs().argmax(1, keepdim=True))).squeeze(1)
        signs[signs == 0] = 1
        basis = vh[:k].T * signs
        if whiten:
            basis = basis / s[:k].clamp_min(1e-12) * math.sqrt(n - 1)
        y = (x - mean) @ basis
        scale = y.norm().clamp_min(1e-12)
        means.append(mean)
        bases.append(basis / scale)
        ys.append(y / scale)
    rotations = [torch.eye(k, dtype=torch.float64) for _ in ys]
    z = ys[0].clone()
    previous = math.inf
    for _ in range(max_iter):
        for m, y in enumerate(ys):
            u, _, vh = torch.linalg.svd(y.T @ z)
            rotations[m] = u @ vh
        z = torch.stack([y @ r for y, r in zip(ys, rotations, strict=True)]).mean(0)
        loss = sum(float((y @ r - z).pow(2).sum()) for y, r in zip(ys, rotations, strict=True))
        if math.isfinite(previous) and previous - loss <= tol * max(previous, 1e-12):
            break
        previous = loss
    projections = [b @ r for b, r in zip(bases, rotations, strict=True)]
    znorm = float(z.norm().clamp_min(1e-12))
    residuals = [
        float(((x - mu) @ w - z).norm()) / znorm for x, mu, w in zip(xs, means, projections, strict=True)
    ]
    return Alignment(consensus=z, projections=projections, means=means, residuals=residuals)


# ------------------------------------------------------------------------------------------------ selection


def _kmeans(points: np.ndarray, k: int, seed: int, n_init: int = 8, iters: int = 100) -> np.ndarray:
    """Lloyd's k-means with k-means++ seeding; returns labels of the best of ``n_init`` runs (lowest inertia)."""
    rng = np.random.default_rng(seed)
    n = len(points)
    best_labels, best_inertia = None, math.inf
    for _ in range(n_init):
        centers = [points[rng.integers(n)]]
        d2 = ((points - centers[0]) ** 2).sum(1)
        for _ in range(1, k):
            total = d2.sum()
            idx = rng.choice(n, p=d2 / total) if total > 0 else rng.integers(n)
            centers.append(points[idx])
            d2 = np.minimum(d2, ((points - points[idx]) ** 2).sum(1))
        c = np.stack(centers)
        labels = np.zeros(n, dtype=np.int64)
        for it in range(iters):
            dist = ((points[:, None, :] - c[None]) ** 2).sum(-1)
            new = dist.argmin(1)
            for j in range(k):  # an empty cluster takes the point farthest from its centre
                if not (new == j).any():
                    far = dist[np.arange(n), new].argmax()
                    new[far] = j
                    dist[far] = 0.0
            if it and (new == labels).all():
                break
            labels = new
            c = np.stack([points[labels == j].mean(0) for j in range(k)])
        inertia = float(((points - c[labels]) ** 2).sum())
        if inertia < best_inertia - 1e-12:
            best_labels, best_inertia = labels.copy(), inertia
    assert best_labels is not None
    return best_labels


def _cluster_anchors(points: np.ndarray, k: int, seed: int) -> tuple[Tensor, Tensor]:
    """Anchors (item nearest each k-means centroid) and weights (cluster share), in ascending item order."""
    labels = _kmeans(points, k, seed)
    anchors, weights = [], []
    for j in range(k):
        members = np.flatnonzero(labels == j)
        centre = points[members].mean(0)
        anchors.append(int(members[((points[members] - centre) ** 2).sum(1).argmin()]))
        weights.append(len(members) / len(points))
    order = np.argsort(anchors)
    return (
        torch.tensor(np.asarray(anchors)[order], dtype=torch.long),
        torch.tensor(np.asarray(weights)[order], dtype=torch.float64),
    )


# ----------------------------------------------------------------------------------------------- extrapolation


class AnchorRidge:
    r"""Ridge regression from anchor correctness to full-benchmark score, shrunk towards prior weights.

    .. math::
        \min_{c,\beta} \sum_m (s_m - c - a_m^\top \beta)^2 + \alpha \lVert \beta - w \rVert^2

    (intercept unpenalised). ``alpha=None`` picks :math:`\alpha` by leave-one-out error over the source models
    from ``alphas``; ``alpha=0`` is least squares (minimum-norm deviation from :math:`w`), exact on a noiseless
    linear population with more source models than anchors; ``alpha=inf`` keeps :math:`\beta = w`.
    """

    def __init__(
        self, alpha: float | None = None, alphas: Sequence[float] = tuple(10.0 ** np.arange(-2, 4.5, 0.5))
    ):
        if alpha is not None and alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        self.alpha = alpha
        self.alphas = (*(float(a) for a in alphas), math.inf)
        self.coef_: Tensor | None = None
        self.intercept_: float = 0.0
        self.alpha_: float | None = None

    @staticmethod
    def _solve(a: Tensor, s: Tensor, prior: Tensor, alpha: float) -> Tensor:
        """The coefficients; the intercept is then ``mean(s) - mean(a) @ beta``."""
        r = s - a @ prior
        a_mean, r_mean = a.mean(0), r.mean()
        ac, rc = a - a_mean, r - r_mean
        if math.isinf(alpha):
            delta = torch.zeros_like(prior)
        elif alpha == 0:
            delta = torch.linalg.lstsq(ac, rc.unsqueeze(1), driver="gelsd").solution.squeeze(1)
        else:
            eye = torch.eye(a.shape[1], dtype=a.dtype)
            delta = torch.linalg.solve(ac.T @ ac + alpha * eye, ac.T @ rc)
        return prior + delta

    def fit(
        self, anchor_correctness: ArrayLike, scores: ArrayLike, prior: ArrayLike | None = None
    ) -> AnchorRidge:
        """Fit on source models: ``anchor_correctness [M, K]``, ``scores [M]``, ``prior`` weights ``[K]``
        (default uniform :math:`1/K`)."""
        a = _as_matrix(anchor_correctness, "anchor_correctness")
        s = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
        if s.shape[0] != a.shape[0]:
            raise ValueError(f"{a.shape[0]} rows of anchor correctness but {s.shape[0]} scores")
        if a.shape[0] < 2:
            raise ValueError("need at least two source models to fit the extrapolation")
        w = (
            torch.full((a.shape[1],), 1.0 / a.shape[1], dtype=torch.float64)
            if prior is None
            else (torch.as_tensor(prior, dtype=torch.float64).reshape(-1))
        )
        if w.shape[0] != a.shape[1]:
            raise ValueError(f"prior has {w.shape[0]} weights for {a.shape[1]} anchors")
        alpha = self.alpha if self.alpha is not None else self._loo_alpha(a, s, w)
        beta = self._solve(a, s, w, alpha)
        self.coef_, self.alpha_ = beta, alpha
        self.intercept_ = float(s.mean() - a.mean(0) @ beta)
        return self

    def _loo_alpha(self, a: Tensor, s: Tensor, w: Tensor) -> float:
        if a.shape[0] < 3:
            return math.inf
        best, best_err = math.inf, math.inf
        keep = torch.ones(a.shape[0], dtype=torch.bool)
        # Largest alpha first, ties kept: prefer the stronger prior when the data cannot tell them apart.
        for alpha in sorted(self.alphas, reverse=True):
            err = 0.0
            for j in range(a.shape[0]):
                keep[:] = True
                keep[j] = False
                beta = self._solve(a[keep], s[keep], w, alpha)
                c = s[keep].mean() - a[keep].mean(0) @ beta
                err += float((c + a[j] @ beta - s[j]) ** 2)
            if err < best_err - 1e-12:
                best, best_err = alpha, err
        return best

    def predict(self, anchor_correctness: ArrayLike) -> Tensor:
        """Estimated full-benchmark scores ``[T]`` from ``[T, K]`` anchor results."""
        if self.coef_ is None:
            raise RuntimeError("call fit() first")
        a = _as_matrix(anchor_correctness, "anchor_correctness")
        if a.shape[1] != self.coef_.shape[0]:
            raise ValueError(f"expected {self.coef_.shape[0]} anchor columns, got {a.shape[1]}")
        return self.intercept_ + a @ self.coef_


# ------------------------------------------------------------------------------------------------ methods


class _Coreset(ABC):
    """Shared API: ``fit`` on source models' correctness (and hidden states), then ``predict`` a new model's
    full score from its results on ``anchors`` (columns in the order of ``anchors``)."""

    def __init__(
        self,
        num_anchors: int,
        *,
        estimator: Literal["ridge", "weighted"] = "ridge",
        alpha: float | None = None,
        seed: int = 0,
    ):
        if num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
        if estimator not in ("ridge", "weighted"):
            raise ValueError(f"estimator must be 'ridge' or 'weighted', got {estimator!r}")
        self.num_anchors = num_anchors
        self.estimator = estimator
        self.alpha = alpha
        self.seed = seed
        self.anchors: Tensor | None = None
        self.weights: Tensor | None = None
        self._ridge: AnchorRidge | None = None

    def _check(self, correctness: ArrayLike, min_models: int = 2) -> Tensor:
        y = _as_matrix(torch.as_tensor(correctness).float(), "correctness")
        if y.shape[0] < min_models:
            raise ValueError(
                f"{type(self).__name__} needs at least {min_models} source models, got {y.shape[0]}"
            )
        if self.num_anchors > y.shape[1]:
            raise ValueError(f"num_anchors={self.num_anchors} exceeds the benchmark's {y.shape[1]} items")
        return y

    @abstractmethod
    def _select(
        self, correctness: Tensor, hidden_states: Sequence[ArrayLike] | None
    ) -> tuple[Tensor, Tensor]:
        """(anchor indices, anchor weights) of the method."""

    def fit(
        self,
        correctness: ArrayLike,
        hidden_states: Sequence[ArrayLike] | None = None,
        scores: ArrayLike | None = None,
    ):
        """Select anchors from source models and fit the extrapolation.

        Args:
            correctness: ``[M, N]`` 0/1 results of ``M`` source models on ``N`` items.
            hidden_states: per source model ``[N, D_m]`` (RepCore only).
            scores: ``[M]`` full-benchmark scores to extrapolate; default the mean correctness.
        """
        y = self._check(correctness)
        s = y.mean(1) if scores is None else torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
        if s.shape[0] != y.shape[0]:
            raise ValueError(f"{y.shape[0]} source models but {s.shape[0]} scores")
        self.anchors, self.weights = self._select(y, hidden_states)
        self._fit_estimator(y, s)
        return self

    def _fit_estimator(self, y: Tensor, s: Tensor) -> None:
        if self.estimator == "ridge":
            self._ridge = AnchorRidge(self.alpha).fit(y[:, self.anchors], s, self.weights)

    def predict(self, anchor_correctness: ArrayLike) -> Tensor:
        """Estimated full-benchmark scores ``[T]`` from ``[T, K]`` results on ``anchors``."""
        if self.anchors is None or self.weights is None:
            raise RuntimeError("call fit() first")
        a = _as_matrix(torch.as_tensor(anchor_correctness).float(), "anchor_correctness")
        if a.shape[1] != len(self.anchors):
            raise ValueError(f"expected results on {len(self.anchors)} anchors, got {a.shape[1]} columns")
        if self.estimator == "ridge":
            assert self._ridge is not None
            return self._ridge.predict(a)
        return a @ self.weights

    def estimate(self, correctness: ArrayLike) -> Tensor:
        """Convenience for evaluation: ``predict`` from full ``[T, N]`` correctness, reading only the anchors."""
        if self.anchors is None:
            raise RuntimeError("call fit() first")
        return self.predict(torch.as_tensor(correctness)[:, self.anchors])


class RepCore(_Coreset):
    """RepCore: anchors from k-means on the aligned (generalized-Procrustes) hidden states of source models.

    Args:
        num_anchors: coreset size :math:`K`.
        dim: shared-space dimension (per-model PCA before alignment).
        whiten: whiten each model's principal directions before aligning (generalized-CCA reading).
        estimator: ``"ridge"`` (:class:`AnchorRidge` shrunk towards the cluster weights) or ``"weighted"``
            (:math:`\\sum_c w_c a_c`, no source scores needed beyond selection).
        alpha: ridge strength; ``None`` = leave-one-out over the source models.
        seed: k-means seed; anchors are a deterministic function of inputs and seed.
    """

    def __init__(
        self,
        num_anchors: int,
        *,
        dim: int = 16,
        whiten: bool = False,
        estimator: Literal["ridge", "weighted"] = "ridge",
        alpha: float | None = None,
        seed: int = 0,
    ):
        super().__init__(num_anchors, estimator=estimator, alpha=alpha, seed=seed)
        self.dim = dim
        self.whiten = whiten
        self.alignment: Alignment | None = None

    def _select(self, correctness, hidden_states):
        if hidden_states is None:
            raise ValueError("RepCore needs the source models' hidden_states (one [N, D_m] matrix per model)")
        if len(hidden_states) != correctness.shape[0]:
            raise ValueError(f"{len(hidden_states)} hidden-state matrices for {correctness.shape[0]} models")
        for m, h in enumerate(hidden_states):
            if h.shape[0] != correctness.shape[1]:
                raise ValueError(
                    f"hidden_states[{m}] has {h.shape[0]} items, correctness has {correctness.shape[1]}"
                )
        dim = min(self.dim, min(h.shape[1] for h in hidden_states), correctness.shape[1] - 1)
        self.alignment = align_representations(hidden_states, dim, whiten=self.whiten)
        return _cluster_anchors(self.alignment.consensus.numpy(), self.num_anchors, self.seed)


class RandomCoreset(_Coreset):
    """Uniformly random anchors (seeded), uniform weights: the baseline every coreset must beat."""

    def _select(self, correctness, hidden_states):
        n = correctness.shape[1]
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))
        anchors = perm[: self.num_anchors].sort().values
        return anchors, torch.full((self.num_anchors,), 1.0 / self.num_anchors, dtype=torch.float64)


class AnchorPoints(_Coreset):
    """Anchor points (Vivek et al., 2023): cluster items by their correctness pattern across source models.

    Each item is the vector of source models' results on it, centred and normalised per item so Euclidean
    k-means follows the correlation distance the paper clusters with (we have 0/1 correctness, not the
    per-model gold-class probabilities the paper can use); anchors are the items nearest the centroids.
    """

    def _select(self, correctness, hidden_states):
        cols = correctness.T.numpy()
        cols = cols - cols.mean(1, keepdims=True)
        norms = np.linalg.norm(cols, axis=1, keepdims=True)
        cols = np.divide(cols, norms, out=np.zeros_like(cols), where=norms > 0)
        return _cluster_anchors(cols, self.num_anchors, self.seed)


class IRTCoreset(_Coreset):
    r"""tinyBenchmarks-style IRT (Polo et al., 2024) with a unidimensional 2PL model and p-IRT extrapolation.

    .. math:: P(y_{mi} = 1) = \sigma\big(a_i(\theta_m - b_i)\big)

    Item parameters come from the source models, by ``backend="torch"`` (joint MAP: Adam on the Bernoulli
    log-likelihood with priors :math:`\theta \sim \mathcal N(0,1)`, :math:`\log a \sim \mathcal N(0, 1)`,
    :math:`b \sim \mathcal N(0, 3^2)`) or ``backend="girth"`` (marginal maximum likelihood, ``girth.twopl_mml``,
    if installed). Anchors: k-means on the standardised item parameters :math:`(a_i, b_i)`. A new model's
    ability :math:`\hat\theta` is the MAP on its anchor results (grid search, exact and batched), and

    .. math:: \hat s = \frac1N\Big(\sum_{i \in \text{anchors}} y_i + \sum_{i \notin \text{anchors}}
       \sigma\big(a_i(\hat\theta - b_i)\big)\Big)

    (p-IRT). tinyBenchmarks fits a multidimensional IRT with py-irt; the 1-D 2PL is the simplest reading and
    what 10-20 source models can support. ``estimator``/``alpha`` are not used: the IRT model is the estimator.
    """

    def __init__(
        self,
        num_anchors: int,
        *,
        backend: Literal["torch", "girth"] = "torch",
        steps: int = 800,
        item_parameters: tuple[Tensor, Tensor] | None = None,
        seed: int = 0,
    ):
        super().__init__(num_anchors, seed=seed)
        if backend not in ("torch", "girth"):
            raise ValueError(f"backend must be 'torch' or 'girth', got {backend!r}")
        self.backend = backend
        self.steps = steps
        # (discrimination, difficulty) fitted before on the same source models: skips the (slow, for girth)
        # IRT fit when only the anchor count changes.
        self.item_parameters = item_parameters
        self.discrimination: Tensor | None = None
        self.difficulty: Tensor | None = None
        self._n_items = 0

    def _fit_irt(self, y: Tensor) -> tuple[Tensor, Tensor]:
        if self.backend == "girth":
            try:
                import girth
            except ImportError as err:  # pragma: no cover - depends on the environment
                raise ImportError("backend='girth' needs `pip install girth`") from err
            out = girth.twopl_mml(y.T.numpy().astype(int))
            a = torch.as_tensor(np.nan_to_num(out["Discrimination"], nan=1.0), dtype=torch.float64)
            b = torch.as_tensor(np.nan_to_num(out["Difficulty"], nan=0.0), dtype=torch.float64)
            return a.clamp(0.05, 10.0), b.clamp(-6.0, 6.0)
        m, n = y.shape
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            theta = torch.zeros(m, dtype=torch.float64, requires_grad=True)
            log_a = torch.zeros(n, dtype=torch.float64, requires_grad=True)
            b = torch.zeros(n, dtype=torch.float64, requires_grad=True)
            opt = torch.optim.Adam([theta, log_a, b], lr=0.05)
            for _ in range(self.steps):
                logits = log_a.exp() * (theta[:, None] - b[None])
                nll = torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="sum")
                prior = 0.5 * (theta.pow(2).sum() + log_a.pow(2).sum() + (b / 3).pow(2).sum())
                loss = (nll + prior) / (m * n)
                opt.zero_grad()
                loss.backward()
                opt.step()
        return log_a.detach().exp(), b.detach()

    def _select(self, correctness, hidden_states):
        if self.item_parameters is None:
            a, b = self._fit_irt(correctness)
        else:
            a, b = (torch.as_tensor(p, dtype=torch.float64).reshape(-1) for p in self.item_parameters)
            if a.shape[0] != correctness.shape[1] or b.shape[0] != correctness.shape[1]:
                raise ValueError(f"item_parameters must have {correctness.shape[1]} entries each")
        self.discrimination, self.difficulty = a, b
        self._n_items = correctness.shape[1]
        points = torch.stack([a, b], 1).numpy()
        points = (points - points.mean(0)) / points.std(0).clip(1e-12)
        return _cluster_anchors(points, self.num_anchors, self.seed)

    def _fit_estimator(self, y, s):
        pass

    def predict(self, anchor_correctness: ArrayLike) -> Tensor:
        if self.anchors is None or self.discrimination is None or self.difficulty is None:
            raise RuntimeError("call fit() first")
        y = _as_matrix(torch.as_tensor(anchor_correctness).float(), "anchor_correctness")
        if y.shape[1] != len(self.anchors):
            raise ValueError(f"expected results on {len(self.anchors)} anchors, got {y.shape[1]} columns")
        a, b = self.discrimination, self.difficulty
        grid = torch.linspace(-6, 6, 1201, dtype=torch.float64)
        logits = a[self.anchors][None] * (grid[:, None] - b[self.anchors][None])  # [G, K]
        loglik = (
            y @ torch.nn.functional.logsigmoid(logits).T + (1 - y) @ torch.nn.functional.logsigmoid(-logits).T
        )
        theta = grid[(loglik - 0.5 * grid.pow(2)).argmax(1)]  # [T]
        p = torch.sigmoid(a[None] * (theta[:, None] - b[None]))  # [T, N]
        mask = torch.ones(self._n_items, dtype=torch.bool)
        mask[self.anchors] = False
        return (y.sum(1) + p[:, mask].sum(1)) / self._n_items


# ----------------------------------------------------------------------------------------------- metrics


def spearman(x: ArrayLike, y: ArrayLike) -> float:
    """Spearman rank correlation of two 1-D sequences (average ranks for ties; NaN if one is constant)."""
    a = np.asarray(torch.as_tensor(x, dtype=torch.float64))
    b = np.asarray(torch.as_tensor(y, dtype=torch.float64))
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise ValueError(f"need two 1-D sequences of equal length >= 2, got {a.shape} and {b.shape}")

    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=np.float64)
        for value in np.unique(v):  # average ranks over ties
            tie = v == value
            r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(a) - (len(a) - 1) / 2, ranks(b) - (len(b) - 1) / 2
    denom = math.sqrt(float((ra**2).sum() * (rb**2).sum()))
    return float((ra * rb).sum() / denom) if denom > 0 else math.nan
