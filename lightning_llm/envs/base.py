"""The environment contract: what a multi-turn RL loop needs from a tool, a game or a simulator.

An environment is four things: the strings that end a model turn, a turn budget, a transition function from
the model's turn to an observation, and a reward on the finished episode. It sees and returns *text* only, so
it works with any tokenizer and any generation engine; the loop owns tokens, masks and batching.

The loop every module runs (token-level, batched, in :mod:`lightning_llm.rl`; :func:`run_episode` is the
same loop on text, for one episode)::

    state = env.reset(example)
    completion = ""
    for _ in range(env.max_turns):
        turn = generate(prompt + completion, stop=env.stop_strings)  # ends at a stop string (kept) or EOS
        completion += turn                                           # trained on
        reply = env.step(state, turn)
        if reply.observation is not None:
            completion += reply.observation                          # never trained on (loss-masked)
        if reply.done:
            break
    reward = env.reward(state, example, completion)

Rules every implementation follows:

- **Never raise on model output.** Whatever text a turn holds (unclosed tags, nonsense, megabytes), ``step``
  answers it, with a fixed message for malformed actions, so one bad sample cannot kill a training run.
  Exceptions are for the *caller's* mistakes (an example from another environment's data, bad settings).
- **State is plain data**, created by ``reset`` and updated in place by ``step``: it must pickle, so rollouts
  can be sent to other processes (DDP, a serving engine) and checkpointed.
- **Deterministic given its inputs** (seed any randomness from the example), so a rollout can be replayed.
- ``max_turns`` bounds the loop on both sides: the loop stops after it, and ``step`` reports ``done`` on the
  turn that reaches it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_llm.types import Example

__all__ = ["EnvReply", "Environment", "Episode", "cut_at_stop", "run_episode"]


@dataclass(frozen=True)
class EnvReply:
    """The environment's answer to one model turn.

    Attributes:
        observation: Text appended after the model's turn and shown to the model in its next turn (a tool
            result, an error message, the opponent's move). It is context, never a training target. None
            appends nothing.
        done: Whether the episode is over (a final answer was given, the turn budget is spent, or the game
            ended). The loop stops generating for this episode and asks for the reward.
    """

    observation: str | None
    done: bool


class Environment(ABC):
    """A multi-turn environment: the loop in the module docstring drives it, one instance for all episodes.

    Subclasses set :attr:`stop_strings` and :attr:`max_turns` (class or instance attributes) and implement
    :meth:`reset`, :meth:`step` and :meth:`reward`. An instance holds only what all episodes share (a corpus,
    a rule book); everything about one episode lives in the state returned by :meth:`reset`, so a batch of
    episodes runs on one instance.

    Attributes:
        stop_strings: A model turn ends at the first of these (kept in the turn) or at EOS. Empty means turns
            end at EOS only.
        max_turns: The most model turns an episode may have, at least 1.
    """

    stop_strings: tuple[str, ...]
    max_turns: int

    @abstractmethod
    def reset(self, example: Example) -> Any:
        """Start an episode on ``example`` and return its state: plain, picklable data that :meth:`step`
        updates in place. Raise here (not in :meth:`step`) if ``example`` cannot be played in this
        environment."""

    @abstractmethod
    def step(self, state: Any, turn: str) -> EnvReply:
        """React to one model turn: ``turn`` is the text the model generated this turn, ending with the stop
        string that ended it (or not, if it ended at EOS or a length limit). Must not raise on any ``turn``;
        called again after ``done`` it answers ``EnvReply(None, done=True)``."""

    @abstractmethod
    def reward(self, state: Any, example: Example, completion: str) -> float:
        """The episode's scalar reward. ``completion`` is everything after the prompt: all model turns with
        the observations between them, as the model saw it. Must not raise on any ``completion``."""


@dataclass(frozen=True)
class Episode:
    """One finished episode of :func:`run_episode`.

    Attributes:
        completion: Model turns and observations, concatenated (what :meth:`Environment.reward` scored).
        reward: The episode's reward.
        turns: The model's turns, each cut after its first stop string.
        observations: The observation after each turn (None where the environment appended nothing).
    """

    completion: str
    reward: float
    turns: list[str] = field(default_factory=list)
    observations: list[str | None] = field(default_factory=list)


def run_episode(env: Environment, example: Example, policy: Callable[[str], str]) -> Episode:
    """Play one episode on text: the reference loop of the module docstring, for tests, scripted baselines
    and debugging an environment without a model.

    Args:
        env: The environment.
        example: The episode's example (its ``prompt`` is the first context).
        policy: Maps the context so far (``example.prompt`` followed by the completion so far) to the next
            turn. Text after the turn's first stop string is discarded, as a generation engine stopping there
            would never have produced it.
    """
    state = env.reset(example)
    completion = ""
    turns: list[str] = []
    observations: list[str | None] = []
    for _ in range(env.max_turns):
        turn = cut_at_stop(policy(example.prompt + completion), env.stop_strings)
        completion += turn
        reply = env.step(state, turn)
        turns.append(turn)
        observations.append(reply.observation)
        if reply.observation is not None:
            completion += reply.observation
        if reply.done:
            break
    return Episode(completion, env.reward(state, example, completion), turns, observations)


def cut_at_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    """``text`` up to and including the stop string that completes first (all of it if none occurs): where
    a generation engine given ``stop=stop_strings`` would have stopped."""
    ends = [index + len(stop) for stop in stop_strings if stop and (index := text.find(stop)) >= 0]
    return text[: min(ends)] if ends else text
