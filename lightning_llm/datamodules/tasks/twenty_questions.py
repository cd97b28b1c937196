"""Twenty questions: find a secret item by yes/no questions, the toy task of ΔBelief-RL (bethgelab/delta-belief-rl).

The prompt names a game, not the item ("Game 4711: find the secret item."): the secret is drawn independently of
the game number, so only asking reveals it. The game number only makes prompts distinct, so that validation
games are held out of training as :func:`~lightning_llm.datamodules.tasks.split_train_val` requires.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from lightning_llm.datamodules.tasks import Example, Task, register_task
from lightning_llm.envs.twenty_questions import ITEMS, TwentyQuestionsEnvironment, parse_question

_GUESS_RE = re.compile(r"<answer>[^<>]*</answer>")


@register_task
@dataclass(frozen=True)
class TwentyQuestionsTask(Task):
    """Games of :class:`~lightning_llm.envs.TwentyQuestionsEnvironment` on the first ``num_items`` shipped items.

    The reference completion plays a good strategy through the real environment: while more than one item is
    consistent with the answers, ask the attribute that splits the remaining items most evenly (ties broken at
    random, seeded by the example, so the warm-up data shows several question orders), then guess the one
    left: ``<search>red</search><information>no</information>…<answer>fox</answer>``. On ``2^k`` items that is
    ``k`` questions and one guess; keep the environment's ``max_turns`` at least that (checked here).

    With ``guess_rate > 0`` the reference also makes, at most once per game and only where the budget leaves
    room for it, an *early guess*: with probability ``guess_rate`` before a question it guesses one of the
    remaining items at random (a wrong guess is answered "no" and the game goes on). Early guesses cost at most
    one turn, and they put guesses from every stage of a game into the warm-up data, so that the warmed-up
    policy's probability of guessing the secret (the belief that ΔBelief-RL's probe reads) is calibrated at
    every turn. Without them, a model trained from scratch only ever guesses after the last question, and its
    belief at earlier turns measures how soon it would guess rather than which item: on the tiny backbone after
    150 warm-up steps an uninformative first question raised it by 1.2 nats, an informative one by 0.9.

    With ``strategy="random"`` the reference asks a random attribute not yet asked (informative or not) until
    one item is left, then guesses it: the warm-up then teaches the protocol and how to read the answers (the
    belief ΔBelief-RL's probe reads) but not *which* questions to ask, the part the RL reward has to teach.
    Such games take up to ``len(attributes) + 1`` turns, so ``max_turns`` must allow that (checked); the
    environment of the RL phase may have a smaller budget.

    Use many training games for a warm-up (thousands): each prompt's game number is paired with one secret, and
    with a few hundred games a small model learns game number → secret by heart instead of reading the answers
    (seen on the tiny backbone with 128 games: its belief ignored the oracle's answers, log b ≈ −7 after three
    informative ones).

    The verifier is 1.0 if the model guessed the secret (``<answer>secret</answer>`` among its turns: the game
    ends at the right guess, and the rollout loop at the turn budget), else 0.0: the success rate.

    Args:
        num_items: Items in play (the first ``num_items`` of :data:`~lightning_llm.envs.twenty_questions.ITEMS`).
        max_turns: The turn budget the reference strategy must fit in (match the environment's).
        guess_rate: Probability of an early guess before each question (see above), in [0, 1].
        strategy: ``"halving"`` (the question that splits the remaining items most evenly) or ``"random"``.
    """

    name = "twenty_questions"

    num_items: int = 16
    max_turns: int = 6
    guess_rate: float = 0.0
    strategy: str = "halving"

    def __post_init__(self) -> None:
        if self.strategy not in ("halving", "random"):
            raise ValueError(
                f"twenty_questions: strategy must be 'halving' or 'random', got {self.strategy!r}"
            )
        if not 0.0 <= self.guess_rate <= 1.0:
            raise ValueError(f"twenty_questions: guess_rate must be in [0, 1], got {self.guess_rate}")
        if not 2 <= self.num_items <= len(ITEMS):
            raise ValueError(
                f"twenty_questions: num_items must be in [2, {len(ITEMS)}], got {self.num_items}"
            )
        needed = (self.num_items - 1).bit_length() + 1
        if self.strategy == "random":  # may ask every attribute before one item is left
            needed = len(self.env.attributes) + 1
        if self.max_turns < needed:
            raise ValueError(
                f"twenty_questions: {self.num_items} items take up to {needed} turns by the reference strategy "
                f"(questions and the guess); max_turns={self.max_turns} is too few"
            )

    @cached_property
    def env(self) -> TwentyQuestionsEnvironment:
        """The environment the reference completions are played in (default rewards)."""
        return self.make_env()

    def make_env(self, **kwargs: Any) -> TwentyQuestionsEnvironment:
        """A :class:`~lightning_llm.envs.TwentyQuestionsEnvironment` on this task's items and turn budget
        (``kwargs``: its reward settings)."""
        return TwentyQuestionsEnvironment(num_items=self.num_items, max_turns=self.max_turns, **kwargs)

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        names = list(self.env.items)
        examples = []
        for _ in range(n):
            game, secret = rng.randrange(10**6), rng.choice(names)
            examples.append(self._example(game, secret, random.Random(f"{seed}/{game}/{secret}")))
        return examples

    def score(self, completion: str, example: Example) -> float:
        secret = str(example.metadata.get("secret", example.answer)).lower()
        return float(any(parse_question(g) == ("guess", secret) for g in _GUESS_RE.findall(completion)))

    def _example(self, game: int, secret: str, rng: random.Random) -> Example:
        env = self.env
        state = env.reset(Example("", "", secret))
        completion, guessed = "", False
        while True:
            left = env.candidates(state)
            unasked = [a for a in env.attributes if f"ask:{a}" not in state.asked]
            worst = len(unasked) if self.strategy == "random" else (len(left) - 1).bit_length()
            room = self.max_turns - state.turns - worst - 1  # turns to spare
            if len(left) == 1:
                turn = f"<answer>{left[0]}</answer>"
            elif not guessed and room >= 1 and rng.random() < self.guess_rate:
                guessed, turn = True, f"<answer>{rng.choice(left)}</answer>"
            elif self.strategy == "random":
                turn = f"<search>{rng.choice(unasked)}</search>"
            else:
                balance = {a: abs(2 * sum(env.items[n][a] for n in left) - len(left)) for a in unasked}
                best = min(balance.values())
                turn = f"<search>{rng.choice([a for a in unasked if balance[a] == best])}</search>"
            reply = env.step(state, turn)
            completion += turn + (reply.observation or "")
            if reply.done:
                break
        if not state.won:  # guaranteed by __post_init__; a bug otherwise
            raise RuntimeError(f"reference strategy lost game {game} ({secret})")
        return Example(
            prompt=f"Game {game}: find the secret item.",
            completion=completion,
            answer=secret,
            metadata={"task": self.name, "secret": secret, "num_items": self.num_items, "turns": state.turns},
        )
