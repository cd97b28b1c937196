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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_llm.datamodules.tasks import Example

__all__ = [
    "RewardFn",
    "answer_format_reward",
    "available_rewards",
    "get_reward",
    "length_reward",
    "length_score",
    "register_reward",
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


def get_reward(name: str) -> RewardFn:
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


_THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)
_TAG = re.compile(r"</?[A-Za-z_][\w-]*>")


def word_count(text: str) -> int:
    """Words of a response as LARFT counts them: whitespace-separated, after removing ``<think>…</think>``.

    Reasoning does not count towards the length (an unclosed ``<think>`` runs to the end of the text), and
    markup tags such as ``<answer>`` are separators, not words.
    """
    visible = _TAG.sub(" ", _THINK_BLOCK.sub(" ", text))
    return len(visible.split())


def length_score(text: str, target: int) -> float:
    r"""LARFT's length reward (arXiv 2603.19255) for one response: :math:`R = \max(0,\ 1 - |L - c| / c)`.

    ``L`` is :func:`word_count` and ``c`` the requested number of words. ``c = 0`` (an empty answer requested)
    has no relative error: 1.0 for an empty response, 0.0 otherwise.

    Raises:
        ValueError: for a negative target.
    """
    if target < 0:
        raise ValueError(f"target word count must be >= 0, got {target}")
    words = word_count(text)
    if target == 0:
        return 1.0 if words == 0 else 0.0
    return max(0.0, 1.0 - abs(words - target) / target)


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
