"""What an agent sees and gets back: the fog-of-war :class:`Observation` of one player at a decision, and the
executor's :class:`Outcome` for each intent it sent."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_llm.envs.rts.rules import Rules

__all__ = ["Observation", "Outcome"]


@dataclass(frozen=True)
class Outcome:
    """What the executor did with one intent: ``status`` is ``"ok"``, ``"partial"`` or ``"rejected"``."""

    intent: str
    status: str
    reason: str = ""


@dataclass
class Observation:
    """What one player knows at a decision: its own side fully, the enemy only where it sees (fog of war).

    ``visible_enemies`` lists ``(kind, region)`` of enemy entities in sight now; ``known_enemy_buildings``
    maps region to the enemy building kinds last seen there. ``instructions`` are the language interventions
    in force; ``last_outcomes`` the executor's answers to this player's previous decision.
    """

    tick: int
    player: int
    rules: Rules
    credits: float
    income: float
    home: str
    enemy_home: str
    units: dict[str, int]
    army_regions: dict[str, int]
    buildings: dict[str, int]
    under_construction: dict[str, int]
    queued: int
    free_fields: int
    idle_scouts: int
    visible_enemies: list[tuple[str, str]]
    known_enemy_buildings: dict[str, list[str]]
    visible_fraction: float
    instructions: tuple[str, ...] = ()
    last_outcomes: tuple[Outcome, ...] = ()

    @property
    def army_size(self) -> int:
        return sum(n for k, n in self.units.items() if k != "scout")

    def enemy_counts(self) -> dict[str, int]:
        """Visible enemy entities per kind."""
        counts: dict[str, int] = {}
        for kind, _ in self.visible_enemies:
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def summary(self) -> str:
        """A compact text description (what an LLM agent is prompted with)."""

        def fmt(d: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in d.items() if v) or "none"

        seen: dict[str, int] = {}
        for kind, region in self.visible_enemies:
            seen[f"{kind}@{region}"] = seen.get(f"{kind}@{region}", 0) + 1
        lines = [
            f"Tick {self.tick}/{self.rules.max_ticks}. You are player {self.player}, base {self.home}, "
            f"enemy base {self.enemy_home}.",
            f"Credits {self.credits:.0f} (+{self.income:.1f}/tick). Free resource fields: {self.free_fields}.",
            f"Your units: {fmt(self.units)}. Army by region: {fmt(self.army_regions)}. Queued: {self.queued}.",
            f"Your buildings: {fmt(self.buildings)}. Under construction: {fmt(self.under_construction)}.",
            f"Enemies in sight: {fmt(seen)}. Map visible: {100 * self.visible_fraction:.0f}%.",
        ]
        if self.known_enemy_buildings:
            known = "; ".join(f"{r}: {', '.join(k)}" for r, k in sorted(self.known_enemy_buildings.items()))
            lines.append(f"Enemy buildings seen: {known}.")
        rejected = [f"{o.intent} ({o.reason})" for o in self.last_outcomes if o.status != "ok"]
        if rejected:
            lines.append(f"Last decision problems: {'; '.join(rejected)}.")
        for text in self.instructions:
            lines.append(f"Commander's instruction: {text}")
        return "\n".join(lines)
