r"""What the features of a sparse autoencoder (SAE) on an LM's residual stream mean, and steering along them.

FAST (arXiv 2506.07691) judges SAE features by their top-activating contexts and steers the LM along decoder
directions. For an SAE (:class:`~lightning_llm.metrics.sae.SAELike`) on the output :math:`h_\ell` of decoder
layer :math:`\ell` (:mod:`lightning_llm.callbacks.steering`'s convention), with inputs scaled by a constant
:math:`c` (``scale``), feature :math:`k`'s activation at token :math:`t` is :math:`f_k(c\,h_{\ell,t})`.

* :func:`top_activating_contexts` keeps, per feature, the ``k`` real tokens of a corpus with the highest
  activation, each with a decoded window of text around it (:class:`FeatureContext`).
* Judges (:class:`FeatureJudge`) score how monosemantic those contexts are, in :math:`[0, 1]`:
  :class:`HeuristicFeatureJudge` (deterministic: the share of contexts whose activating token is the most
  common one) and :class:`LLMFeatureJudge` (asks a model for a 1–5 rating on a strict ``SCORE: s`` line,
  mapped to :math:`(s-1)/4`). :func:`feature_quality` reports the share of features judged high-quality.
* :class:`SAESteering` adds :math:`\sum_k \alpha_k\, d_k / c` to :math:`h_\ell` (:math:`d_k` = ``W_dec[k]``,
  unit norm): FAST's :math:`z' = z + \alpha\, d_k` in the SAE's (scaled) space, mapped back to the residual
  stream. It is an :class:`~lightning_llm.callbacks.ActivationSteering` with that vector, so it is a context
  manager and a Lightning callback alike.
"""

from __future__ import annotations

import operator
import re
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from lightning_llm.backbones.inspect import layer_output_reader
from lightning_llm.callbacks.steering import ActivationSteering

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lightning_llm.metrics.sae import SAELike

__all__ = [
    "FeatureContext",
    "FeatureJudge",
    "HeuristicFeatureJudge",
    "LLMFeatureJudge",
    "SAESteering",
    "feature_quality",
    "sae_steering_vector",
    "top_activating_contexts",
]

#: Put around the activating token in :attr:`FeatureContext.context_text`.
TOKEN_MARKERS = ("[[", "]]")


@dataclass(frozen=True)
class FeatureContext:
    """One top activation of a feature.

    Attributes:
        activation: The feature's activation at the token.
        token: The activating token, decoded.
        context_text: Up to ``window`` real tokens on each side and the token itself, decoded, the token
            between :data:`TOKEN_MARKERS` (``"… the [[cat]] sat …"``).
        sequence_index: Row of ``input_ids`` the token is in.
        position: Its column in that row (padded coordinates).
        token_id: The activating token's id.
    """

    activation: float
    token: str
    context_text: str
    sequence_index: int
    position: int
    token_id: int


def _context(
    tokenizer: PreTrainedTokenizerBase, ids: Tensor, real: Tensor, position: int, window: int
) -> tuple[str, str]:
    """``(token, context_text)`` of ``ids[position]`` with up to ``window`` real tokens on each side."""
    columns = real.nonzero().flatten().tolist()
    where = columns.index(position)
    left = [int(ids[c]) for c in columns[max(0, where - window) : where]]
    right = [int(ids[c]) for c in columns[where + 1 : where + 1 + window]]
    token = tokenizer.decode([int(ids[position])])
    open_, close = TOKEN_MARKERS
    return token, f"{tokenizer.decode(left)}{open_}{token}{close}{tokenizer.decode(right)}"


@torch.no_grad()
def top_activating_contexts(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    sae: SAELike,
    layer: int,
    input_ids: Tensor,
    attention_mask: Tensor,
    features: Sequence[int] | None = None,
    k: int = 10,
    window: int = 8,
    scale: float = 1.0,
    batch_size: int = 16,
) -> dict[int, list[FeatureContext]]:
    r"""The ``k`` highest activations of each feature over all real tokens of a corpus, with their contexts.

    Runs ``model`` on ``input_ids [N, T]`` (``attention_mask`` marks real tokens; position ids count real
    tokens only, so left and right padding agree) ``batch_size`` rows at a time, reads :math:`h_\ell` with a
    read-only hook (the forward stops after layer ``layer``), and encodes :math:`f = \mathrm{enc}(c\,h_\ell)`
    at the real tokens. A running top-``k`` per feature (values and token coordinates only) keeps memory at
    :math:`O(|\text{features}|\cdot k)` plus one batch; contexts are decoded at the end.

    Returns ``{feature: contexts}`` for every requested feature (all ``d_sae`` when ``features`` is None),
    highest activation first; only activations ``> 0`` count, so a feature firing on fewer than ``k`` tokens
    has fewer contexts (none if it never fired). Equal activations keep the earlier token (row-major order),
    except possibly at the ``k``-th place within a batch (``torch.topk`` breaks those ties). Eval mode is
    restored.
    """
    if k < 1 or window < 0 or batch_size < 1:
        raise ValueError(f"need k >= 1, window >= 0, batch_size >= 1; got {k}, {window}, {batch_size}")
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [N, T], got {tuple(input_ids.shape)}, "
            f"{tuple(attention_mask.shape)}"
        )
    wanted = list(range(sae.d_sae)) if features is None else [int(i) for i in features]
    if any(not 0 <= i < sae.d_sae for i in wanted):
        raise ValueError(f"features must be in [0, {sae.d_sae}), got {wanted}")
    device = next(model.parameters()).device
    reference = sae.W_dec
    columns = torch.tensor(wanted, dtype=torch.long, device=reference.device)
    length = input_ids.shape[1]
    top_values = torch.empty(len(wanted), 0)
    top_tokens = torch.empty(len(wanted), 0, dtype=torch.long)  # flat index row * T + column
    with layer_output_reader(model, layer) as read:
        for start in range(0, input_ids.shape[0], batch_size):
            ids = input_ids[start : start + batch_size].to(device)
            mask = attention_mask[start : start + batch_size].to(device)
            hidden = read(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
            real = mask.bool()
            if not real.any():
                continue
            hidden = hidden[real].to(device=reference.device, dtype=reference.dtype)
            acts = sae.encode(hidden * scale).index_select(-1, columns).float()  # [n, F], SAE's device
            values, which = acts.T.topk(min(k, acts.shape[0]), dim=1)  # [F, k']: only these leave it
            rows, cols = real.nonzero(as_tuple=True)
            flat = ((rows + start) * length + cols).cpu()
            merged_values = torch.cat([top_values, values.cpu()], 1)
            merged_tokens = torch.cat([top_tokens, flat[which.cpu()]], 1)
            # stable: on ties the running entries (earlier tokens) stay ahead of this batch's
            order = merged_values.sort(dim=1, descending=True, stable=True).indices[:, :k]
            top_values = merged_values.gather(1, order)
            top_tokens = merged_tokens.gather(1, order)

    out: dict[int, list[FeatureContext]] = {}
    for row, feature in enumerate(wanted):
        contexts = []
        for value, token_index in zip(top_values[row].tolist(), top_tokens[row].tolist(), strict=True):
            if not value > 0:
                continue
            sequence, position = divmod(token_index, length)
            token, text = _context(
                tokenizer, input_ids[sequence], attention_mask[sequence].bool(), position, window
            )
            contexts.append(
                FeatureContext(
                    activation=value,
                    token=token,
                    context_text=text,
                    sequence_index=sequence,
                    position=position,
                    token_id=int(input_ids[sequence, position]),
                )
            )
        out[feature] = contexts
    return out


# ------------------------------------------------------------------------------------------------ judges


class FeatureJudge(ABC):
    """Scores a feature from its top-activating contexts: 1 for one clear concept, 0 for none.

    The shape of :class:`~lightning_llm.metrics.SafetyJudge`: a deterministic judge for tests and baselines
    (:class:`HeuristicFeatureJudge`) and a model-backed one (:class:`LLMFeatureJudge`) behind one method.
    """

    @abstractmethod
    def score(self, feature: int, contexts: Sequence[FeatureContext]) -> float:
        """A score in ``[0, 1]`` for ``feature`` from its contexts (highest activation first)."""


class HeuristicFeatureJudge(FeatureJudge):
    """Deterministic monosemanticity proxy: the share of contexts whose activating token id is the modal one.

    A token-level feature (fires on one token) scores 1; a feature spread over many tokens scores about
    ``1 / #distinct tokens``. Blind to features that are monosemantic over several tokens (a concept, a
    syntactic role): a baseline and a test double, not a replacement for :class:`LLMFeatureJudge`. No contexts
    score 0.
    """

    def score(self, feature: int, contexts: Sequence[FeatureContext]) -> float:
        if not contexts:
            return 0.0
        _, modal = Counter(c.token_id for c in contexts).most_common(1)[0]
        return modal / len(contexts)


_FEATURE_JUDGE_TEMPLATE = (
    "Below are the text excerpts on which one feature of a language model activates most strongly. The "
    "activating token of each is marked [[like this]].\n\n{contexts}\n\n"
    "How well does one single, specific concept explain the activations in all excerpts? Rate from 1 (no "
    "common concept) to 5 (one clear concept explains every excerpt). You may reason first; end with one "
    "line of the form SCORE: <1-5>."
)
_SCORE_LINE = re.compile(r"\s*SCORE:\s*([1-5])\s*", re.IGNORECASE)


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


class LLMFeatureJudge(FeatureJudge):
    """Asks a model (``generate(prompt) -> reply``: an API client, a local LM) to rate the contexts 1–5.

    The prompt lists the contexts (activation and text, newlines shown as ``\\n``); the reply is only
    *parsed*, never executed: it must contain exactly one line that is ``SCORE: s`` with ``s`` in 1..5 (case
    and spaces around aside; other lines, e.g. reasoning, are ignored), and the score is :math:`(s - 1) / 4`.
    A reply with no such line, several, or that is not a string is unparseable: it counts in :attr:`unparsed`
    and scores ``unparsed_score`` (0 by default: a judge that cannot decide must not make an SAE look better,
    as the safety judges' unparsed verdict is "flagged"), or raises ``ValueError`` when ``unparsed_score`` is
    None.

    Args:
        generate: Completes one prompt.
        template: The prompt, with ``{contexts}`` (and optionally ``{feature}``).
        unparsed_score: Score of an unparseable reply, or None to raise.
    """

    def __init__(
        self,
        generate: Callable[[str], str],
        template: str = _FEATURE_JUDGE_TEMPLATE,
        *,
        unparsed_score: float | None = 0.0,
    ) -> None:
        if "{contexts}" not in template:
            raise ValueError("the judge template needs {contexts}")
        if unparsed_score is not None and not 0.0 <= unparsed_score <= 1.0:
            raise ValueError(f"unparsed_score must be in [0, 1] or None, got {unparsed_score}")
        self.generate = generate
        self.template = template
        self.unparsed_score = unparsed_score
        self.unparsed = 0  # running count of unparseable replies

    def prompt(self, feature: int, contexts: Sequence[FeatureContext]) -> str:
        lines = "\n".join(
            f"{i}. (activation {c.activation:.3g}) {_one_line(c.context_text)}"
            for i, c in enumerate(contexts, 1)
        )
        # replace, not str.format: the contexts are arbitrary text and may hold braces
        return self.template.replace("{feature}", str(feature)).replace("{contexts}", lines)

    @staticmethod
    def parse(reply: str) -> int | None:
        """The 1–5 rating of a reply, or None if it has not exactly one ``SCORE: s`` line."""
        if not isinstance(reply, str):
            return None
        found = [m for line in reply.splitlines() if (m := _SCORE_LINE.fullmatch(line))]
        return int(found[0].group(1)) if len(found) == 1 else None

    def score(self, feature: int, contexts: Sequence[FeatureContext]) -> float:
        reply = self.generate(self.prompt(feature, contexts))
        rating = self.parse(reply)
        if rating is None:
            if self.unparsed_score is None:
                raise ValueError(f"judge reply has no single 'SCORE: <1-5>' line: {reply!r}")
            self.unparsed += 1
            return self.unparsed_score
        return (rating - 1) / 4


def feature_quality(
    judge: FeatureJudge,
    contexts: Mapping[int, Sequence[FeatureContext]],
    threshold: float = 0.75,
    min_contexts: int = 1,
) -> dict[str, Any]:
    """Judge every feature with at least ``min_contexts`` contexts; the share scoring ``>= threshold``.

    ``threshold = 0.75`` is a rating of 4 or 5 on :class:`LLMFeatureJudge`'s 1–5 scale (our choice). Features
    with fewer contexts (dead or rare) are not judged and are counted in ``skipped``. Returns ``scores``
    (``{feature: score}``), ``high_quality_share`` (over judged features; NaN if none), ``mean_score``,
    ``judged`` and ``skipped``.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    scores = {
        int(f): float(judge.score(int(f), list(c))) for f, c in contexts.items() if len(c) >= min_contexts
    }
    judged = len(scores)
    nan = float("nan")
    return {
        "scores": scores,
        "high_quality_share": sum(s >= threshold for s in scores.values()) / judged if judged else nan,
        "mean_score": sum(scores.values()) / judged if judged else nan,
        "judged": judged,
        "skipped": len(contexts) - judged,
    }


# ---------------------------------------------------------------------------------------------- steering


def _feature_weights(features: int | Mapping[int, float], d_sae: int) -> dict[int, float]:
    if isinstance(features, Mapping):
        weights = {operator.index(i): float(w) for i, w in features.items()}
    elif isinstance(features, bool):
        raise TypeError("features must be an int or a {feature: weight} dict, got a bool")
    else:
        weights = {operator.index(features): 1.0}
    if not weights:
        raise ValueError("no features to steer along")
    bad = [i for i in weights if not 0 <= i < d_sae]
    if bad:
        raise ValueError(f"features {bad} out of range for an SAE with d_sae={d_sae}")
    return weights


def sae_steering_vector(sae: SAELike, features: int | Mapping[int, float], scale: float = 1.0) -> Tensor:
    r"""``[d_in]`` fp32 :math:`\sum_k w_k W_{dec}[k] / c`, ``w_k = 1`` for an int, else the dict's values."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    weights = _feature_weights(features, sae.d_sae)
    rows = sae.W_dec.detach()[list(weights)].float()
    coefficients = torch.tensor(list(weights.values()), dtype=torch.float32, device=rows.device)
    return (coefficients[:, None] * rows).sum(0) / scale


class SAESteering(ActivationSteering):
    r"""Steer along SAE decoder directions: add :math:`\alpha \sum_k w_k\, W_{dec}[k] / c` to :math:`h_\ell`.

    FAST's :math:`z' = z + \alpha\, d_k` happens in the SAE's input space, :math:`z = c\,h`; in the residual
    stream that is :math:`h' = h + \alpha\, d_k / c`. With ``features`` an int this adds
    :math:`\alpha\, W_{dec}[k] / c`; with a dict ``{k: α_k}`` it adds
    :math:`\alpha \sum_k \alpha_k W_{dec}[k] / c` (leave ``alpha = 1`` to use the dict's values as they are).

    It *is* an :class:`~lightning_llm.callbacks.ActivationSteering` with vector
    :func:`sae_steering_vector` and multiplier ``alpha``: ``with SAESteering(...).attach(model): ...`` or as a
    Lightning callback (steers validation / test / predict), ``positions`` as there. :attr:`alpha` may be
    changed between calls. Decoder rows have unit norm, so a useful :math:`\alpha` is on the scale of the
    (scaled) residual norm: sweep it.

    Args:
        sae: The SAE (its ``W_dec`` is read once, here).
        features: A feature index, or ``{feature: weight}``.
        layer: The decoder layer the SAE reads (:mod:`lightning_llm.callbacks.steering`'s convention).
        alpha: :math:`\alpha`.
        scale: :math:`c`, the constant the SAE's inputs are scaled by.
        positions: ``"all"`` or ``"prompt"`` (see :class:`ActivationSteering`).
    """

    def __init__(
        self,
        sae: SAELike,
        features: int | Mapping[int, float],
        layer: int,
        alpha: float = 1.0,
        scale: float = 1.0,
        positions: Literal["prompt", "all"] = "all",
    ) -> None:
        self.features = _feature_weights(features, sae.d_sae)
        self.scale = float(scale)
        super().__init__(
            sae_steering_vector(sae, self.features, scale), layer=layer, multiplier=alpha, positions=positions
        )

    @property
    def alpha(self) -> float:
        return self.multiplier

    @alpha.setter
    def alpha(self, value: float) -> None:
        self.multiplier = float(value)
