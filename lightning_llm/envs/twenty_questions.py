r"""Twenty questions with a rule-based oracle: the environment of ΔBelief-RL (bethgelab/delta-belief-rl).

A secret item is drawn from a finite set; every item has boolean attributes. Each model turn is one action::

    <search>attribute</search>   → "<information>yes</information>" or "<information>no</information>"
    <answer>item</answer>        → correct: the episode is won and over (no observation);
                                   wrong: "<information>no</information>" and the game goes on

optionally preceded by ``<think>…</think>``. A turn ends at ``</search>`` or ``</answer>`` (single added tokens
of the tiny tokenizer, reused from the search protocol so that the tokenizer is unchanged). The oracle is a
lookup in the attribute table: exact, deterministic, no judge model.

A turn that does not parse, names an unknown attribute or an unknown item is *invalid* (observation
``<information>invalid</information>``); asking an attribute already asked, or repeating a wrong guess, is
*repeated* (``<information>repeated</information>``). Both cost their turn and are recorded in the state.

Reward of an episode (what GRPO with ``rewards=["env"]`` optimises, the outcome-only baseline)::

    R = r_end + Σ_t penalty_t,   r_end = win_reward · win − turn_cost · turns,
    penalty_t = invalid_penalty (invalid turn) | repeated_penalty (repeated turn) | 0

with docs/methods.md §18's values ``win_reward=2``, ``turn_cost=0.05``, ``invalid_penalty=−5``,
``repeated_penalty=−1``; ``turns`` counts every turn the environment answered, the winning guess included.
(The authors' released code uses other defaults, win 1, invalid −1, repeated −0.05, length −0.05 per turn,
and a +0.1 bonus for an all-valid episode; every value here is a parameter.) :meth:`turn_penalties` and
:meth:`end_reward` expose the two parts, so that per-turn reward shaping
(:class:`~lightning_llm.callbacks.DeltaBeliefReward`) adds up to the same total.

The shipped item table (:data:`ITEMS`) has 16 synthetic items; ``num_items=n`` plays on its first ``n``. Its
first four attributes (``alive``, ``big``, ``red``, ``round``) are a binary code of the item's index (``alive``
is bit 0, ``round`` bit 3), so the first ``2^k`` items are told apart by ``k`` of them and the others answer the
same for all of them (uninformative questions); ``loud`` and ``soft`` are true for a quarter of the items
(less informative than a balanced split).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_llm.envs.base import Environment, EnvReply, cut_at_stop

if TYPE_CHECKING:
    from lightning_llm.types import Example

__all__ = ["ATTRIBUTES", "ITEMS", "TwentyQuestionsEnvironment", "TwentyQuestionsState", "parse_question"]

#: Attributes of the shipped table, in order.
ATTRIBUTES = ("alive", "big", "red", "round", "loud", "soft")
_NAMES = (
    "book", "bee", "car", "cow", "apple", "bird", "boat", "fox",
    "egg", "frog", "ball", "horse", "cup", "fish", "rock", "dog",
)  # fmt: skip
_LOUD = frozenset({"car", "cow", "bird", "dog"})
_SOFT = frozenset({"book", "bee", "ball", "fish"})
#: The shipped items: name → attribute → bool (see the module docstring for how they are built).
ITEMS: dict[str, dict[str, bool]] = {
    name: {
        "alive": bool(i & 1),
        "big": bool(i & 2),
        "red": bool(i & 4),
        "round": bool(i & 8),
        "loud": name in _LOUD,
        "soft": name in _SOFT,
    }
    for i, name in enumerate(_NAMES)
}

_ACTION_RE = re.compile(
    r"\s*(?:<think>[^<>]*</think>\s*)?<(search|answer)>\s*([^<>]*?)\s*</\1>\s*", re.DOTALL
)


def parse_question(turn: str) -> tuple[str, str] | None:
    """``("ask", attribute)`` or ``("guess", item)`` (lower-cased, stripped) for a well-formed turn, else None.

    The turn is read up to its first stop string and must be exactly one action, optionally after one
    ``<think>…</think>``; the content must be non-empty and tag-free. Never raises.
    """
    cut = cut_at_stop(turn, TwentyQuestionsEnvironment.stop_strings)
    match = _ACTION_RE.fullmatch(cut)
    if match is None or not match.group(2):
        return None
    kind = "ask" if match.group(1) == "search" else "guess"
    return kind, " ".join(match.group(2).lower().split())


@dataclass
class TwentyQuestionsState:
    """One episode (plain, picklable).

    Attributes:
        secret: The item to find.
        turns: Turns the environment answered (the winning guess included).
        asked: Normalised valid actions so far (``"ask:<attribute>"``, ``"guess:<item>"``), to detect repeats.
        events: One entry per answered turn: ``"yes"``, ``"no"``, ``"wrong"`` (a wrong guess), ``"win"``,
            ``"invalid"`` or ``"repeated"``.
        actions: The normalised action of each answered turn, aligned with ``events`` (``""`` if invalid).
        invalid: Invalid turns.
        repeated: Repeated turns.
        won: Whether the secret was guessed.
        done: Whether the episode is over.
    """

    secret: str
    turns: int = 0
    asked: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    invalid: int = 0
    repeated: int = 0
    won: bool = False
    done: bool = False


class TwentyQuestionsEnvironment(Environment):
    """Find a secret item by yes/no questions about its attributes, then guess it (see the module docstring).

    Args:
        items: The item table (name → attribute → bool); every item must have the same attributes and no two
            items the same answers. Default: the first ``num_items`` of :data:`ITEMS`.
        num_items: How many of the shipped items to play with (2 to 16), when ``items`` is not given.
        max_turns: Turn budget; the turn that reaches it ends the episode (lost unless it is the right guess).
        win_reward: Reward of a won episode.
        turn_cost: Cost per answered turn (the length penalty of ``r_end``).
        invalid_penalty: Added once per invalid turn (≤ 0).
        repeated_penalty: Added once per repeated turn (≤ 0).
    """

    stop_strings = ("</search>", "</answer>")

    def __init__(
        self,
        items: Mapping[str, Mapping[str, bool]] | None = None,
        *,
        num_items: int = 16,
        max_turns: int = 6,
        win_reward: float = 2.0,
        turn_cost: float = 0.05,
        invalid_penalty: float = -5.0,
        repeated_penalty: float = -1.0,
    ) -> None:
        if items is None:
            if not 2 <= num_items <= len(ITEMS):
                raise ValueError(
                    f"TwentyQuestionsEnvironment: num_items must be in [2, {len(ITEMS)}], got {num_items}"
                )
            items = dict(list(ITEMS.items())[:num_items])
        self.items = _check_items(items)
        self.attributes = tuple(next(iter(self.items.values())))
        if max_turns < 1:
            raise ValueError(f"TwentyQuestionsEnvironment: max_turns must be >= 1, got {max_turns}")
        if invalid_penalty > 0 or repeated_penalty > 0 or turn_cost < 0:
            raise ValueError("penalties must be <= 0 and turn_cost >= 0")
        self.max_turns = max_turns
        self.win_reward = win_reward
        self.turn_cost = turn_cost
        self.invalid_penalty = invalid_penalty
        self.repeated_penalty = repeated_penalty

    def reset(self, example: Example) -> TwentyQuestionsState:
        secret = str(example.metadata.get("secret", example.answer)).strip().lower()
        if secret not in self.items:
            raise ValueError(
                f"secret {secret!r} is not one of this environment's {len(self.items)} items "
                f"({', '.join(self.items)}): build the environment with the task's num_items"
            )
        return TwentyQuestionsState(secret=secret)

    def step(self, state: TwentyQuestionsState, turn: str) -> EnvReply:
        if state.done:
            return EnvReply(None, done=True)
        state.turns += 1
        action = parse_question(turn)
        event = self._event(state, action)
        state.events.append(event)
        state.actions.append(f"{action[0]}:{action[1]}" if event != "invalid" and action else "")
        state.invalid += event == "invalid"
        state.repeated += event == "repeated"
        if event == "win":
            state.won = state.done = True
            return EnvReply(None, done=True)
        if state.turns >= self.max_turns:
            state.done = True
            return EnvReply(None, done=True)
        return EnvReply(f"<information>{'no' if event == 'wrong' else event}</information>", done=False)

    def _event(self, state: TwentyQuestionsState, action: tuple[str, str] | None) -> str:
        if action is None:
            return "invalid"
        kind, value = action
        if (kind == "ask" and value not in self.attributes) or (kind == "guess" and value not in self.items):
            return "invalid"
        key = f"{kind}:{value}"
        if key in state.asked:
            return "repeated"
        state.asked.append(key)
        if kind == "guess":
            return "win" if value == state.secret else "wrong"
        return "yes" if self.items[state.secret][value] else "no"

    def turn_penalties(self, state: TwentyQuestionsState) -> list[float]:
        """``penalty_t`` of each answered turn: ``invalid_penalty``, ``repeated_penalty`` or 0."""
        table = {"invalid": self.invalid_penalty, "repeated": self.repeated_penalty}
        return [table.get(event, 0.0) for event in state.events]

    def end_reward(self, state: TwentyQuestionsState) -> float:
        """``r_end = win_reward · win − turn_cost · turns``."""
        return self.win_reward * float(state.won) - self.turn_cost * state.turns

    def reward(self, state: TwentyQuestionsState, example: Example, completion: str) -> float:
        return self.end_reward(state) + sum(self.turn_penalties(state))

    def candidates(self, state: TwentyQuestionsState) -> list[str]:
        """Items consistent with every answer so far (wrong guesses excluded): what a perfect reasoner knows."""
        answers = {
            a[4:]: e == "yes" for a, e in zip(state.actions, state.events, strict=True) if e in ("yes", "no")
        }
        wrong = {a[6:] for a, e in zip(state.actions, state.events, strict=True) if e == "wrong"}
        return [
            name
            for name, attrs in self.items.items()
            if name not in wrong and all(attrs[a] == v for a, v in answers.items())
        ]

    def informative_questions(self, state: TwentyQuestionsState) -> list[bool]:
        """For each question turn of the episode (valid or repeated ``ask``), whether it shrank :meth:`candidates`.

        A repeated question, or one every remaining item answers the same way (``round`` among the first 8
        shipped items), is uninformative. Guesses and invalid turns are not questions and are skipped. The
        mean over episodes is the *informative-question rate*: what ΔBelief-RL's per-turn credit should raise.
        """
        replay = TwentyQuestionsState(secret=state.secret)
        out = []
        for action, event in zip(state.actions, state.events, strict=True):
            before = len(self.candidates(replay)) if event in ("yes", "no") else 0
            replay.actions.append(action)
            replay.events.append(event)
            if event == "repeated" and action.startswith("ask:"):
                out.append(False)
            elif event in ("yes", "no"):
                out.append(len(self.candidates(replay)) < before)
        return out


def _check_items(items: Mapping[str, Mapping[str, bool]]) -> dict[str, dict[str, bool]]:
    if len(items) < 2:
        raise ValueError("TwentyQuestionsEnvironment needs at least two items")
    table = {str(name).strip().lower(): dict(attrs) for name, attrs in items.items()}
    if len(table) != len(items) or any(not name or "<" in name or ">" in name for name in table):
        raise ValueError("item names must be distinct (case-insensitively), non-empty and free of '<', '>'")
    attributes = set(next(iter(table.values())))
    if not attributes:
        raise ValueError("items need at least one attribute")
    for name, attrs in table.items():
        if set(attrs) != attributes:
            raise ValueError(f"item {name!r} has attributes {sorted(attrs)}, expected {sorted(attributes)}")
        if any("<" in a or ">" in a or a != a.strip().lower() or not a for a in attrs):
            raise ValueError(f"attribute names must be lower-case, stripped and tag-free: {sorted(attrs)}")
    codes = {tuple(bool(attrs[a]) for a in sorted(attributes)) for attrs in table.values()}
    if len(codes) != len(table):
        raise ValueError(
            "two items have the same answers to every attribute: the game could not be won by asking"
        )
    return {name: {a: bool(v) for a, v in attrs.items()} for name, attrs in table.items()}
