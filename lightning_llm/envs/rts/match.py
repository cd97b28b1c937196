"""Matches: the agent interface, the decision loop, language interventions and the steerability score.

Every ``Rules.decision_interval`` ticks each agent receives its
:class:`~lightning_llm.envs.rts.observation.Observation` and answers with intents, as text (one per line, parsed
strictly) or as :class:`Intent` objects (re-validated the same way). Both observations are taken before either
side acts, and the side that executes first alternates between decisions, so neither seat is favoured on
contested resource fields.

**Language interventions.** An :class:`Intervention` injects one of the :data:`STANDARD_INSTRUCTIONS` into a
player's observations for ``duration`` decisions from its tick. Each standard instruction has a compliance test
on the intents of those decisions (e.g. *"Attack the enemy base now."* is followed by an ``attack(<enemy
base>)``). Since a match is deterministic, the effect of an instruction is measured against the counterfactual
match without it, from the same seed:

    steerability = P(comply | instructed) − P(comply | same decisions, not instructed)

so an agent that attacks anyway scores 0 on "attack", and one that does what it is told scores up to 1.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_llm.envs.rts.intents import Intent, IntentError, parse_intent, parse_intents
from lightning_llm.envs.rts.observation import Observation, Outcome
from lightning_llm.envs.rts.rules import Rules
from lightning_llm.envs.rts.world import LOG_FIELDS, World

__all__ = [
    "STANDARD_INSTRUCTIONS",
    "Agent",
    "Instruction",
    "Intervention",
    "MatchResult",
    "Steerability",
    "play_match",
    "steerability",
]


class Agent(ABC):
    """A player. Subclasses set ``name`` and implement :meth:`act`; :meth:`reset` is called before a match."""

    name: str = "agent"

    def reset(self, player: int, rules: Rules, seed: int) -> None:  # noqa: B027 - optional hook
        """Prepare for a match as ``player`` (0 or 1); ``seed`` is this agent's own seed for the match."""

    @abstractmethod
    def act(self, obs: Observation) -> str | Sequence[Intent]:
        """This decision's intents: text, one intent per line, or parsed :class:`Intent` objects."""


@dataclass(frozen=True)
class Instruction:
    """A standard language intervention: the text the agent sees and the test of whether it complied."""

    text: str
    complies: Callable[[list[Intent], str], bool]  # (the decision's intents, the enemy's home region)


def _any(intents: list[Intent], verb: str, *args: Any) -> bool:
    return any(i.verb == verb and i.args[: len(args)] == args for i in intents)


#: The benchmark's standard instructions (name → :class:`Instruction`).
STANDARD_INSTRUCTIONS: dict[str, Instruction] = {
    "attack": Instruction(
        "Attack the enemy base now.", lambda intents, enemy: _any(intents, "attack", enemy)
    ),
    "defend": Instruction(
        "Pull the army back and defend the base.",
        lambda intents, enemy: _any(intents, "defend") or _any(intents, "retreat"),
    ),
    "expand": Instruction(
        "Grow the economy: build a refinery.",
        lambda intents, enemy: _any(intents, "expand") or _any(intents, "build", "refinery"),
    ),
    "scout": Instruction("Scout the centre of the map.", lambda intents, enemy: _any(intents, "scout", "c")),
    "tanks": Instruction(
        "Switch production to tanks.",
        lambda intents, enemy: _any(intents, "train", "tank") or _any(intents, "build", "factory"),
    ),
}


@dataclass(frozen=True)
class Intervention:
    """Show ``instruction`` (a :data:`STANDARD_INSTRUCTIONS` name, or free text — then it is not scored) to
    ``player`` at the decisions from ``tick`` on, for ``duration`` decisions."""

    tick: int
    player: int
    instruction: str
    duration: int = 2

    def __post_init__(self) -> None:
        if self.player not in (0, 1) or self.tick < 0 or self.duration < 1:
            raise ValueError(f"bad intervention {self}: player 0/1, tick >= 0, duration >= 1")

    @property
    def text(self) -> str:
        known = STANDARD_INSTRUCTIONS.get(self.instruction)
        return known.text if known else self.instruction


@dataclass
class MatchResult:
    """Everything about one match: outcome, per-tick log, every decision, replay frames, compliance."""

    names: tuple[str, str]
    seed: int
    rules: Rules
    winner: int | None
    ticks: int
    log: np.ndarray  # [tick, player, LOG_FIELDS]
    decisions: list[dict[str, Any]]
    frames: list[dict[str, Any]]
    compliance: list[dict[str, Any]] = field(default_factory=list)
    interventions: tuple[Intervention, ...] = ()
    fields: tuple[tuple[float, float], ...] = ()
    bases: tuple[tuple[float, float], ...] = ()
    homes: tuple[str, ...] = ()
    produced: tuple[dict[str, int], ...] = ()  # units trained per kind, per player
    remaining: tuple[int, int] = (0, 0)  # living entities per player at the end

    def metric(self, name: str) -> np.ndarray:
        """One column of the log, shape ``[ticks, 2]`` (see :data:`~lightning_llm.envs.rts.world.LOG_FIELDS`)."""
        return self.log[:, :, LOG_FIELDS.index(name)]

    def summary(self) -> dict[str, Any]:
        """Headline numbers per player: spending, income growth, combat loss ratio, vision."""
        out: dict[str, Any] = {"winner": self.winner, "ticks": self.ticks}
        income = self.metric("income")
        q = max(1, len(income) // 4)
        for p in (0, 1):
            lost, killed = float(self.metric("lost")[-1, p]), float(self.metric("killed")[-1, p])
            rejected = sum(
                o[1] == "rejected" for d in self.decisions if d["player"] == p for o in d["outcomes"]
            )
            out[self.names[p] if self.names[0] != self.names[1] else f"p{p}"] = {
                "spent": float(self.metric("spent")[-1, p]),
                "income_growth": float(income[-q:, p].mean() - income[:q, p].mean()),
                "loss_ratio": lost / killed if killed else float("inf") if lost else 0.0,
                "mean_visible": float(self.metric("visible")[:, p].mean()),
                "explored": float(self.metric("explored")[-1, p]),
                "rejected_intents": rejected,
                "produced": dict(self.produced[p]) if self.produced else {},
            }
        return out


def _as_intents(reply: str | Sequence[Intent], rules: Rules) -> tuple[str, list[Intent], list[IntentError]]:
    if isinstance(reply, str):
        return (reply, *parse_intents(reply, rules))
    text = "\n".join(str(i) for i in reply)
    intents, errors = [], []
    for item in reply:  # scripted agents go through the same validation as text
        try:
            intents.append(parse_intent(str(item), rules))
        except IntentError as err:
            errors.append(err)
    return text, intents, errors


def play_match(
    agents: Sequence[Agent],
    rules: Rules | None = None,
    seed: int = 0,
    *,
    interventions: Sequence[Intervention] = (),
    frame_every: int = 20,
) -> MatchResult:
    """Play one match to its end (victory or ``rules.max_ticks``).

    Args:
        agents: Player 0 and player 1 (the same object may not play both sides).
        rules: The rules (default :class:`Rules`).
        seed: Draws the map; agents are reset with ``2 * seed + player``.
        interventions: Language interventions (see :class:`Intervention`).
        frame_every: Record a replay frame every this many ticks (0: none).
    """
    if len(agents) != 2 or agents[0] is agents[1]:
        raise ValueError("play_match needs two distinct agent objects")
    rules = rules or Rules()
    world = World(rules, seed)
    for p, agent in enumerate(agents):
        agent.reset(p, rules, 2 * seed + p)
    decisions: list[dict[str, Any]] = []
    frames: list[dict[str, Any]] = []
    compliance: list[dict[str, Any]] = []
    last: list[tuple[Outcome, ...]] = [(), ()]
    shown = [0] * len(interventions)
    decision_index = 0
    while not world.over:
        if world.tick % rules.decision_interval == 0:
            observations = [world.observe(p) for p in (0, 1)]
            plans = []
            for p in (0, 1):
                obs = observations[p]
                active = [
                    i
                    for i, iv in enumerate(interventions)
                    if iv.player == p and iv.tick <= world.tick and shown[i] < iv.duration
                ]
                obs.instructions = tuple(interventions[i].text for i in active)
                obs.last_outcomes = last[p]
                text, intents, errors = _as_intents(agents[p].act(obs), rules)
                for i in active:
                    shown[i] += 1
                    known = STANDARD_INSTRUCTIONS.get(interventions[i].instruction)
                    if known is not None:
                        compliance.append(
                            {"tick": world.tick, "player": p, "instruction": interventions[i].instruction,
                             "complied": bool(known.complies(intents, obs.enemy_home))}
                        )  # fmt: skip
                plans.append((text, intents, errors))
            for p in (0, 1) if decision_index % 2 == 0 else (1, 0):
                text, intents, errors = plans[p]
                outcomes = [Outcome(e.line.strip(), "rejected", e.reason) for e in errors]
                outcomes += world.execute(p, intents)
                last[p] = tuple(outcomes)
                decisions.append(
                    {"tick": world.tick, "player": p, "reply": text,
                     "outcomes": [[o.intent, o.status, o.reason] for o in outcomes]}
                )  # fmt: skip
            decision_index += 1
        if frame_every and world.tick % frame_every == 0:
            frames.append({"tick": world.tick, "entities": world.snapshot()})
        world.step()
    frames.append({"tick": world.tick, "entities": world.snapshot()})
    return MatchResult(
        names=(agents[0].name, agents[1].name),
        seed=seed,
        rules=rules,
        winner=world.winner,
        ticks=world.tick,
        log=world.log_array(),
        decisions=decisions,
        frames=frames,
        compliance=compliance,
        interventions=tuple(interventions),
        fields=world.map.fields,
        bases=world.map.bases,
        homes=world.home_regions,
        produced=tuple(dict(side.produced) for side in world.sides),
        remaining=(len(world.entities(0)), len(world.entities(1))),
    )


@dataclass(frozen=True)
class Steerability:
    """Compliance with and without each instruction (paired by seed and decision), and their difference."""

    instructed: dict[str, float]
    baseline: dict[str, float]

    @property
    def per_instruction(self) -> dict[str, float]:
        return {k: self.instructed[k] - self.baseline[k] for k in self.instructed}

    @property
    def score(self) -> float:
        """Mean over instructions of P(comply | instructed) − P(comply | not instructed)."""
        return float(np.mean(list(self.per_instruction.values())))


def steerability(
    make_agent: Callable[[], Agent],
    make_opponent: Callable[[], Agent],
    *,
    rules: Rules | None = None,
    seeds: Sequence[int] = (0, 1),
    instructions: Sequence[str] = tuple(STANDARD_INSTRUCTIONS),
    at_tick: int | None = None,
    duration: int = 2,
) -> Steerability:
    """Steerability of the agent made by ``make_agent`` (as player 0) against ``make_opponent``.

    For every seed and instruction, the match is played twice from the same seed: with the instruction shown
    from ``at_tick`` (default: a third into the match) for ``duration`` decisions, and without it; compliance is
    tested on the same decisions in both. Fresh agents are made for every match.
    """
    rules = rules or Rules()
    unknown = [i for i in instructions if i not in STANDARD_INSTRUCTIONS]
    if unknown:
        raise ValueError(f"unknown instructions {unknown}; standard: {sorted(STANDARD_INSTRUCTIONS)}")
    tick = (
        at_tick
        if at_tick is not None
        else (rules.max_ticks // 3) // rules.decision_interval * rules.decision_interval
    )
    with_rates: dict[str, list[float]] = {i: [] for i in instructions}
    base_rates: dict[str, list[float]] = {i: [] for i in instructions}
    for seed in seeds:
        base = play_match([make_agent(), make_opponent()], rules, seed, frame_every=0)
        for name in instructions:
            iv = Intervention(tick, 0, name, duration)
            steered = play_match(
                [make_agent(), make_opponent()], rules, seed, interventions=[iv], frame_every=0
            )
            with_rates[name] += [c["complied"] for c in steered.compliance]
            base_rates[name] += _counterfactual_compliance(base, iv)
    return Steerability(
        instructed={k: float(np.mean(v)) if v else 0.0 for k, v in with_rates.items()},
        baseline={k: float(np.mean(v)) if v else 0.0 for k, v in base_rates.items()},
    )


def _counterfactual_compliance(match: MatchResult, iv: Intervention) -> list[bool]:
    """Would the decisions an intervention covers have complied anyway? Tested on the uninstructed match."""
    rule = STANDARD_INSTRUCTIONS[iv.instruction]
    mine = [d for d in match.decisions if d["player"] == iv.player and d["tick"] >= iv.tick][: iv.duration]
    enemy_home = match.homes[1 - iv.player]
    return [bool(rule.complies(parse_intents(d["reply"], match.rules)[0], enemy_home)) for d in mine]
