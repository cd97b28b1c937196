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

__all__ = ["RewardFn", "answer_format_reward", "available_rewards", "get_reward", "register_reward"]

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
