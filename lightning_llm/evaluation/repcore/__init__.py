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

Modules:

- :mod:`~lightning_llm.evaluation.repcore.extract`: per-item hidden states and multiple-choice correctness of a
  causal LM, cached on disk;
- :mod:`~lightning_llm.evaluation.repcore.align`: the generalized Procrustes alignment;
- :mod:`~lightning_llm.evaluation.repcore.clustering`: k-means anchors and their weights;
- :mod:`~lightning_llm.evaluation.repcore.ridge`: the anchor-to-score extrapolation;
- :mod:`~lightning_llm.evaluation.repcore.coreset`: the coreset API, RepCore and the correctness-based baselines;
- :mod:`~lightning_llm.evaluation.repcore.irt`: the IRT baseline;
- :mod:`~lightning_llm.evaluation.repcore.metrics`: rank agreement of estimated and true scores.
"""

from lightning_llm.evaluation.repcore.align import Alignment, align_representations
from lightning_llm.evaluation.repcore.coreset import AnchorPoints, RandomCoreset, RepCore
from lightning_llm.evaluation.repcore.extract import extract_hidden_states, score_multiple_choice
from lightning_llm.evaluation.repcore.irt import IRTCoreset
from lightning_llm.evaluation.repcore.metrics import spearman
from lightning_llm.evaluation.repcore.ridge import AnchorRidge

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
