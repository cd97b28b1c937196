"""Scripted agents: fixed strategies with a known character, the reference points of the arena.

- :class:`RushAgent` — one barracks, infantry only, attacks the enemy base as soon as it has a small army.
- :class:`TurtleAgent` — refineries and towers first, a rocket/infantry army that defends; attacks late.
- :class:`BalancedAgent` — expands, builds a factory, trains a mix that counters what it has seen, scouts,
  attacks when its army is worth enough.
- :class:`RandomAgent` — uniform over the valid intents. Not the floor: random orders build towers and
  armies, and beat the rush on some maps.
- :class:`PassiveAgent` — only ``wait()``: the floor.
- :class:`NoisyAgent` — another agent whose every intent is replaced by a random one with probability ε: a
  family whose strength order is known by construction (the Elo recovery test).

Scripted agents follow standard language interventions when ``follow_instructions`` is true (the default):
the instruction's canonical intent is put first in the decision.
"""

from __future__ import annotations

import random
from abc import abstractmethod
from collections.abc import Sequence

from lightning_llm.envs.rts.intents import Intent, all_intents
from lightning_llm.envs.rts.match import STANDARD_INSTRUCTIONS, Agent
from lightning_llm.envs.rts.observation import Observation
from lightning_llm.envs.rts.rules import Rules

__all__ = [
    "BalancedAgent",
    "NoisyAgent",
    "PassiveAgent",
    "RandomAgent",
    "RushAgent",
    "ScriptedAgent",
    "TurtleAgent",
]


def _canonical(name: str, obs: Observation) -> Intent:
    """The intent a cooperative agent answers a standard instruction with."""
    if name == "attack":
        return Intent("attack", (obs.enemy_home,))
    if name == "defend":
        return Intent("defend")
    if name == "expand":
        return Intent("expand")
    if name == "scout":
        return Intent("scout", ("c",))
    if name == "tanks":
        if obs.buildings["factory"] or obs.under_construction["factory"]:
            return Intent("train", ("tank", obs.rules.max_train))
        return Intent("build", ("factory",))
    raise ValueError(f"no canonical intent for instruction {name!r}")


_BY_TEXT = {ins.text: name for name, ins in STANDARD_INSTRUCTIONS.items()}


class ScriptedAgent(Agent):
    """Base of the scripted strategies: :meth:`plan` the decision, then obey instructions first."""

    def __init__(self, follow_instructions: bool = True) -> None:
        self.follow_instructions = follow_instructions

    def act(self, obs: Observation) -> list[Intent]:
        plan = self.plan(obs)
        if self.follow_instructions:
            ordered = [_canonical(_BY_TEXT[t], obs) for t in obs.instructions if t in _BY_TEXT]
            plan = ordered + [i for i in plan if i not in ordered]
        return plan[: obs.rules.intents_per_decision]

    @abstractmethod
    def plan(self, obs: Observation) -> list[Intent]:
        """This decision's intents before instructions are applied."""

    @staticmethod
    def _train(obs: Observation, unit: str, credits: float) -> Intent | None:
        cost = obs.rules.units[unit].cost
        n = min(obs.rules.max_train, int(credits // cost)) if cost else obs.rules.max_train
        return Intent("train", (unit, n)) if n >= 1 else None

    @staticmethod
    def _has(obs: Observation, building: str) -> bool:
        return bool(obs.buildings[building] or obs.under_construction[building])


class RushAgent(ScriptedAgent):
    """Barracks, infantry, attack the enemy base with ``threshold`` units; never expands."""

    name = "rush"

    def __init__(self, threshold: int = 6, follow_instructions: bool = True) -> None:
        super().__init__(follow_instructions)
        self.threshold = threshold

    def plan(self, obs: Observation) -> list[Intent]:
        out: list[Intent] = []
        credits = obs.credits
        if not self._has(obs, "barracks"):
            out.append(Intent("build", ("barracks",)))
            credits -= obs.rules.buildings["barracks"].cost
        elif obs.buildings["barracks"]:
            train = self._train(obs, "infantry", credits)
            if train:
                out.append(train)
        out.append(
            Intent("attack", (obs.enemy_home,)) if obs.army_size >= self.threshold else Intent("defend")
        )
        return out


class TurtleAgent(ScriptedAgent):
    """Refineries and towers, a defensive rocket/infantry army; attacks once it has ``threshold`` units."""

    name = "turtle"

    def __init__(self, towers: int = 3, threshold: int = 30, follow_instructions: bool = True) -> None:
        super().__init__(follow_instructions)
        self.towers, self.threshold = towers, threshold

    def plan(self, obs: Observation) -> list[Intent]:
        out: list[Intent] = []
        credits = obs.credits
        refineries = obs.buildings["refinery"] + obs.under_construction["refinery"]
        towers = obs.buildings["tower"] + obs.under_construction["tower"]
        build = obs.rules.buildings
        if refineries < 2 and obs.free_fields and credits >= build["refinery"].cost:
            out.append(Intent("expand"))
            credits -= build["refinery"].cost
        if not self._has(obs, "barracks") and credits >= build["barracks"].cost:
            out.append(Intent("build", ("barracks",)))
            credits -= build["barracks"].cost
        elif towers < self.towers and credits >= build["tower"].cost:
            out.append(Intent("build", ("tower",)))
            credits -= build["tower"].cost
        if obs.buildings["barracks"]:
            unit = "rocket" if obs.units["rocket"] <= obs.units["infantry"] else "infantry"
            train = self._train(obs, unit, credits)
            if train:
                out.append(train)
        out.append(
            Intent("attack", (obs.enemy_home,)) if obs.army_size >= self.threshold else Intent("defend")
        )
        return out


class BalancedAgent(ScriptedAgent):
    """Two refineries, barracks and factory, a countering mix, one scout; attacks at ``attack_value`` credits of
    army (and falls back home when its army drops below half of that)."""

    name = "balanced"

    def __init__(self, attack_value: float = 1400.0, follow_instructions: bool = True) -> None:
        super().__init__(follow_instructions)
        self.attack_value = attack_value
        self._attacking = False

    def reset(self, player: int, rules: Rules, seed: int) -> None:
        self._attacking = False

    def plan(self, obs: Observation) -> list[Intent]:
        out: list[Intent] = []
        credits = obs.credits
        build = obs.rules.buildings
        refineries = obs.buildings["refinery"] + obs.under_construction["refinery"]
        if refineries < 2 and obs.free_fields and credits >= build["refinery"].cost:
            out.append(Intent("expand"))
            credits -= build["refinery"].cost
        elif not self._has(obs, "barracks") and credits >= build["barracks"].cost:
            out.append(Intent("build", ("barracks",)))
            credits -= build["barracks"].cost
        elif obs.buildings["barracks"] and not self._has(obs, "factory") and credits >= build["factory"].cost:
            out.append(Intent("build", ("factory",)))
            credits -= build["factory"].cost
        if obs.buildings["barracks"] and obs.units["scout"] == 0 and credits >= obs.rules.units["scout"].cost:
            out.append(Intent("train", ("scout", 1)))
            credits -= obs.rules.units["scout"].cost
        elif obs.idle_scouts:
            out.append(Intent("scout", (obs.enemy_home if obs.tick % 200 else "c",)))
        unit = self._counter_unit(obs)
        if unit and obs.buildings[obs.rules.units[unit].producer]:
            train = self._train(obs, unit, credits)
            if train:
                out.append(train)
        value = sum(obs.rules.units[k].cost * n for k, n in obs.units.items() if k != "scout")
        if value >= self.attack_value:
            self._attacking = True
        elif value < self.attack_value / 2:
            self._attacking = False
        out.append(Intent("attack", (obs.enemy_home,)) if self._attacking else Intent("defend"))
        return out

    @staticmethod
    def _counter_unit(obs: Observation) -> str:
        seen = obs.enemy_counts()
        if seen.get("tank", 0) > seen.get("infantry", 0) + seen.get("rocket", 0):
            return "rocket"
        if seen.get("infantry", 0) > 2 * seen.get("tank", 0) and obs.buildings["factory"]:
            return "tank"
        mix = ("infantry", "tank", "infantry", "rocket")
        return (
            mix[(obs.tick // obs.rules.decision_interval) % len(mix)]
            if obs.buildings["factory"]
            else "infantry"
        )


class RandomAgent(Agent):
    """Uniformly random valid intents, as many as the budget allows (seeded per match)."""

    name = "random"

    def __init__(self) -> None:
        self._rng = random.Random(0)
        self._choices: Sequence[Intent] = all_intents()

    def reset(self, player: int, rules: Rules, seed: int) -> None:
        self._rng = random.Random(seed)
        self._choices = all_intents(rules)

    def act(self, obs: Observation) -> list[Intent]:
        return [self._rng.choice(self._choices) for _ in range(obs.rules.intents_per_decision)]


class PassiveAgent(Agent):
    """Does nothing (``wait()`` every decision): the weakest possible player, a sanity floor for ratings."""

    name = "passive"

    def act(self, obs: Observation) -> list[Intent]:
        return [Intent("wait")]


class NoisyAgent(Agent):
    """``base`` with each intent replaced by a uniformly random valid one with probability ``epsilon``."""

    def __init__(self, base: Agent, epsilon: float, name: str | None = None) -> None:
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        self.base, self.epsilon = base, epsilon
        self.name = name or f"{base.name}@eps={epsilon:g}"
        self._random = RandomAgent()

    def reset(self, player: int, rules: Rules, seed: int) -> None:
        self.base.reset(player, rules, seed)
        self._random.reset(player, rules, seed + 7919)

    def act(self, obs: Observation) -> list[Intent]:
        planned = list(self.base.act(obs))
        planned += [Intent("wait")] * (obs.rules.intents_per_decision - len(planned))
        rng = self._random._rng
        return [rng.choice(self._random._choices) if rng.random() < self.epsilon else i for i in planned]
