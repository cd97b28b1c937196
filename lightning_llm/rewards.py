"""Reward functions: pure, batched, documented.

A reward function maps ``(completions, examples) -> scores``: ``completions[i]`` is the decoded text of row
``i``, ``examples[i]`` its :class:`~lightning_llm.datamodules.tasks.Example` (answer and metadata). It must be
pure (no model calls, no ``eval`` of text) and must not raise on malformed model output: score it instead.

``GRPOModule(rewards=[...])`` takes registered names or callables. Two names are bound at fit time rather than
registered here: ``"task"`` (the DataModule's synthetic-task verifier) and ``"env"`` (the environment's
reward of each episode).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lightning_llm.text import extract_answer, length_score, normalize_answer, parse_forecast, word_count

if TYPE_CHECKING:
    from lightning_llm.types import Example

__all__ = [
    "RewardFn",
    "answer_format_reward",
    "available_rewards",
    "forecasting_brier_reward",
    "forecasting_reward",
    "forecasting_score",
    "gameable_reward",
    "get_reward",
    "hack_reward",
    "length_reward",
    "length_score",
    "parse_forecast",
    "register_reward",
    "resolve_rewards",
    "reward_names",
    "word_count",
]

RewardFn = Callable[[Sequence[str], Sequence["Example"]], Sequence[float]]

_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make a reward function available to ``GRPOModule(rewards=[name])``."""

    def decorate(fn: RewardFn) -> RewardFn:
        if name in _REWARDS or name in ("task", "env"):
            raise ValueError(f"reward name {name!r} is already taken")
        _REWARDS[name] = fn
        return fn

    return decorate


#: Prefix of the saved name of a reward callable that is not registered (it cannot be rebuilt from a name).
UNREGISTERED = "unregistered:"


def reward_names(rewards: Sequence[str | RewardFn]) -> list[str]:
    """Names that rebuild ``rewards`` with :func:`get_reward` (what a checkpoint stores): registered names as
    they are, ``"unregistered:<qualname>"`` for a callable that was never registered."""
    by_fn = {id(fn): name for name, fn in _REWARDS.items()}
    return [
        r if isinstance(r, str) else by_fn.get(id(r), UNREGISTERED + getattr(r, "__qualname__", repr(r)))
        for r in rewards
    ]


def get_reward(name: str) -> RewardFn:
    if name.startswith(UNREGISTERED):
        raise ValueError(
            f"reward {name!r} was a callable that is not registered, so it cannot be rebuilt from the "
            "checkpoint: register it with @register_reward(name), or pass rewards=[...] to load_from_checkpoint"
        )
    try:
        return _REWARDS[name]
    except KeyError:
        raise ValueError(
            f"unknown reward {name!r}; registered: {available_rewards()} (plus 'task' and 'env', bound at fit time)"
        ) from None


def available_rewards() -> list[str]:
    return sorted(_REWARDS)


_ANSWER = re.compile(r"<answer>[^<>]*</answer>")


@register_reward("format")
def answer_format_reward(completions: Sequence[str], examples: Sequence[Example]) -> list[float]:
    """1.0 if the completion contains exactly one well-formed ``<answer>…</answer>`` (no nested tags), else 0.0."""
    return [1.0 if len(_ANSWER.findall(c)) == 1 and c.count("<answer>") == 1 else 0.0 for c in completions]


@register_reward("length")
def length_reward(completions: Sequence[str], examples: Sequence[Example]) -> list[float]:
    """:func:`length_score` of each completion against ``example.metadata["target_words"]`` (the ``length`` task)."""
    scores = []
    for completion, example in zip(completions, examples, strict=True):
        if "target_words" not in example.metadata:
            raise ValueError(
                "length reward needs example.metadata['target_words'] (use the 'length' task or add it)"
            )
        scores.append(length_score(completion, int(example.metadata["target_words"])))
    return scores


def _is_shortcut(completion: str, example: Example) -> bool:
    if "shortcut" not in example.metadata:
        raise ValueError("gameable/hack rewards need example.metadata['shortcut'] (use the 'gameable' task)")
    content = extract_answer(completion)
    return content is not None and content.strip() == str(example.metadata["shortcut"])


@register_reward("hack")
def hack_reward(completions: Sequence[str], examples: Sequence[Example]) -> list[float]:
    """1.0 where the last ``<answer>…</answer>`` is the example's shortcut (``metadata["shortcut"]``), else 0.0.

    The *hack* indicator of the ``gameable`` task: log it with weight 0 to watch the hack rate.
    """
    return [float(_is_shortcut(c, e)) for c, e in zip(completions, examples, strict=True)]


@register_reward("gameable")
def gameable_reward(completions: Sequence[str], examples: Sequence[Example]) -> list[float]:
    r"""The misspecified reward of the ``gameable`` task: :math:`R = \max(\text{verifier}, \text{hack})`.

    1.0 for the shortcut answer, else the wrapped task's verifier (``metadata["base_task"]`` with
    ``metadata["base_kwargs"]``): the specification gap recontextualization (arXiv 2512.19027) is about.
    """
    from lightning_llm.datamodules.tasks import get_task

    scores = []
    for completion, example in zip(completions, examples, strict=True):
        if _is_shortcut(completion, example):
            scores.append(1.0)
            continue
        if "base_task" not in example.metadata:
            raise ValueError("gameable reward needs example.metadata['base_task'] (use the 'gameable' task)")
        base = get_task(example.metadata["base_task"], **example.metadata.get("base_kwargs", {}))
        scores.append(float(base.score(completion, example)))
    return scores


# ------------------------------------------------------------------------------------------- forecasting


def forecasting_score(
    completion: str,
    answer: str,
    *,
    outcome: float | None = None,
    accuracy: bool = True,
) -> float:
    r"""OpenForecaster's reward (arXiv 2512.25070) for one forecast ``(a, q) = parse_forecast(completion)``.

    Free-form questions: :math:`R = c + S'(q)` with :math:`c = [a = a^*]` (exact match after SQuAD
    normalisation, :func:`~lightning_llm.envs.search.normalize_answer`) and the Brier-style score of the
    stated confidence

    .. math::  S'(q) = 1 - (1 - q)^2 \text{ if } c = 1, \qquad S'(q) = -q^2 \text{ if } c = 0,

    which is proper: for a fixed answer right with probability :math:`p`, :math:`E[S'] = 2pq - q^2` peaks at
    :math:`q = p` (the accuracy term does not depend on :math:`q`, so :math:`c + S'` is proper too).
    ``accuracy=False`` drops :math:`c` (the paper's "Brier alone" ablation, which collapses to answering
    "Unknown" with confidence 0: a sure :math:`S' = 0`).

    Binary questions (``outcome`` :math:`o \in \{0, 1\}` given): the answer must be "yes" or "no" and ``q`` is
    the confidence in it, so :math:`p_{yes} = q` or :math:`1 - q`, and :math:`R = -(p_{yes} - o)^2` (the
    negative Brier score; how the paper reads the answer of a binary question is not stated: unverified).

    Unparsable output (and a binary answer other than yes/no) scores :math:`-1`, below every forecast.
    """
    parsed = parse_forecast(completion)
    if parsed is None:
        return -1.0
    predicted, q = parsed
    if outcome is not None:
        said = normalize_answer(predicted)
        if said not in ("yes", "no"):
            return -1.0
        p_yes = q if said == "yes" else 1.0 - q
        return -((p_yes - float(outcome)) ** 2)
    correct = normalize_answer(predicted) == normalize_answer(answer)
    brier = 1.0 - (1.0 - q) ** 2 if correct else -(q**2)
    return float(correct) * float(accuracy) + brier


def _forecast_outcome(example: Example) -> float | None:
    """The binary outcome of ``example`` (``metadata["outcome"]``, 0 or 1), or None for a free-form question."""
    outcome = example.metadata.get("outcome")
    if outcome is None:
        return None
    if outcome not in (0, 1, True, False):
        raise ValueError(f"forecasting reward: metadata['outcome'] must be 0 or 1 (or None), got {outcome!r}")
    return float(outcome)


@register_reward("forecasting")
def forecasting_reward(completions: Sequence[str], examples: Sequence[Example]) -> list[float]:
    """:func:`forecasting_score` with the accuracy term, :math:`c + S'`: OpenForecaster's reward.

    The gold answer is ``example.answer``; ``example.metadata["outcome"]`` (0/1) marks a binary question.
    """
    return [
        forecasting_score(c, e.answer, outcome=_forecast_outcome(e))
        for c, e in zip(completions, examples, strict=True)
    ]


@register_reward("forecasting_brier")
def forecasting_brier_reward(completions: Sequence[str], examples: Sequence[Example]) -> list[float]:
    """:func:`forecasting_score` without the accuracy term, :math:`S'` alone: the paper's ablation baseline."""
    return [
        forecasting_score(c, e.answer, outcome=_forecast_outcome(e), accuracy=False)
        for c, e in zip(completions, examples, strict=True)
    ]


def resolve_rewards(specs: Sequence[str | RewardFn], task: Any = None) -> list[tuple[str, Any]]:
    """``(name, function)`` for each reward spec: a callable as is, ``"task"`` the synthetic ``task``'s verifier,
    ``"env"`` the marker ``"env"`` (the environment scores its own episodes), any other name the registered
    reward."""
    resolved: list[tuple[str, Any]] = []
    for spec in specs:
        if callable(spec):
            resolved.append((getattr(spec, "__name__", "reward"), spec))
        elif spec == "task":
            if task is None:
                raise ValueError("reward 'task' needs a DataModule with a synthetic task (data.task)")
            resolved.append(("task", _task_reward(task)))
        elif spec == "env":
            resolved.append(("env", "env"))
        else:
            resolved.append((spec, get_reward(spec)))
    return resolved


def _task_reward(task: Any) -> RewardFn:
    def task_reward(completions: Sequence[str], examples: Sequence[Any]) -> list[float]:
        return [task.score(c, e) for c, e in zip(completions, examples, strict=True)]

    return task_reward
