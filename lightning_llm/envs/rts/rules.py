"""The rules of the RTS game as data: unit and building stats, the counter table, economy, victory, budgets.

Every number the simulation uses lives in :class:`Rules`, so a rule shift (the benchmark's robustness axis,
docs/methods.md §5) is a new ``Rules`` value, never a code change. :data:`PRESETS` names the perturbations the
benchmark ships; :func:`rules_preset` builds one. ``Rules`` is a frozen dataclass of plain values: it goes into
every replay file as JSON and comes back out identical (:meth:`Rules.to_dict` / :meth:`Rules.from_dict`).

Time is in ticks, distance in map cells. Combat: an attacker of kind ``a`` hits a target of kind ``b`` for
``attack[a] · counter[a][class(b)]`` every ``cooldown[a]`` ticks while the target is within ``range[a]``.
The default counter triangle is *infantry > rocket > tank > infantry* (tanks shred infantry, rockets kill
tanks, infantry overruns slow rockets), with scouts cheap, fast, far-seeing and weak.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

__all__ = [
    "BUILDING_KINDS",
    "PRESETS",
    "UNIT_KINDS",
    "BuildingSpec",
    "Rules",
    "UnitSpec",
    "rules_preset",
]

#: Unit kinds, in the order of every per-kind table.
UNIT_KINDS = ("infantry", "rocket", "tank", "scout")
#: Building kinds; ``hq`` is given at the start and cannot be built.
BUILDING_KINDS = ("hq", "refinery", "barracks", "factory", "tower")
#: Target classes of the counter table: the unit kinds and one class for all buildings.
TARGET_CLASSES = (*UNIT_KINDS, "building")


@dataclass(frozen=True)
class UnitSpec:
    """A unit kind. ``producer`` is the building kind that trains it."""

    cost: int
    hp: float
    attack: float
    range: float
    cooldown: int
    speed: float
    vision: float
    train_ticks: int
    producer: str


@dataclass(frozen=True)
class BuildingSpec:
    """A building kind. Towers are the only buildings that attack; ``requires`` must be standing to build."""

    cost: int
    hp: float
    build_ticks: int
    vision: float
    attack: float = 0.0
    range: float = 0.0
    cooldown: int = 1
    requires: str | None = None


def _units() -> dict[str, UnitSpec]:
    return {
        "infantry": UnitSpec(50, 60.0, 6.0, 2.0, 5, 0.25, 5.0, 40, "barracks"),
        "rocket": UnitSpec(80, 45.0, 10.0, 3.5, 8, 0.20, 5.0, 50, "barracks"),
        "tank": UnitSpec(150, 200.0, 18.0, 3.0, 10, 0.30, 6.0, 80, "factory"),
        "scout": UnitSpec(40, 30.0, 2.0, 1.5, 6, 0.60, 9.0, 25, "barracks"),
    }


def _buildings() -> dict[str, BuildingSpec]:
    return {
        "hq": BuildingSpec(0, 1500.0, 0, 8.0),
        "refinery": BuildingSpec(150, 400.0, 60, 4.0),
        "barracks": BuildingSpec(150, 500.0, 60, 4.0),
        "factory": BuildingSpec(250, 600.0, 90, 4.0, requires="barracks"),
        "tower": BuildingSpec(120, 500.0, 50, 7.0, attack=12.0, range=5.0, cooldown=8),
    }


def _counters() -> dict[str, dict[str, float]]:
    # attacker -> target class -> damage multiplier
    return {
        "infantry": {"infantry": 1.0, "rocket": 1.6, "tank": 0.3, "scout": 1.2, "building": 0.5},
        "rocket": {"infantry": 0.5, "rocket": 0.8, "tank": 2.0, "scout": 0.6, "building": 1.0},
        "tank": {"infantry": 1.8, "rocket": 1.0, "tank": 1.0, "scout": 1.5, "building": 1.2},
        "scout": {"infantry": 1.0, "rocket": 1.0, "tank": 0.2, "scout": 1.0, "building": 0.2},
        "tower": {"infantry": 1.0, "rocket": 1.0, "tank": 1.0, "scout": 1.0, "building": 0.0},
    }


@dataclass(frozen=True)
class Rules:
    """Everything the simulation and the executor read. All fields are parameters of the benchmark.

    Args:
        width, height: Map size in cells (the map is split into a 3 × 3 grid of named regions).
        max_ticks: Hard end of a match.
        decision_interval: Ticks between two decisions of an agent (its "low frequency").
        intents_per_decision: The intent budget: at most this many intents are executed per decision; the
            rest are rejected with the reason ``"over budget"``.
        max_train: Largest ``count`` of one ``train`` intent.
        start_credits: Credits at tick 0.
        base_income: Credits per tick from the HQ alone.
        refinery_income: Credits per tick from each finished refinery while its field is not empty.
        field_amount: Credits in each resource field.
        fields_per_side: Resource fields near each base; ``center_fields`` more are contested in the middle.
        max_units: Population cap per player (alive plus queued units).
        victory: ``"hq"``: a player who loses the HQ loses; ``"annihilation"``: only losing every unit and
            building loses.
        timeout: At ``max_ticks``: ``"score"`` (the higher score wins: cost of living units and buildings
            plus the value destroyed; unspent credits do not count) or ``"draw"``.
        fog_of_war: ``False`` makes the whole map visible to both players.
        units, buildings, counters: The stat tables (see the module docstring).
    """

    width: int = 32
    height: int = 32
    max_ticks: int = 2000
    decision_interval: int = 50
    intents_per_decision: int = 3
    max_train: int = 5
    start_credits: int = 400
    base_income: float = 1.0
    refinery_income: float = 1.5
    field_amount: float = 1500.0
    fields_per_side: int = 2
    center_fields: int = 2
    max_units: int = 40
    victory: Literal["hq", "annihilation"] = "hq"
    timeout: Literal["score", "draw"] = "score"
    fog_of_war: bool = True
    units: dict[str, UnitSpec] = field(default_factory=_units)
    buildings: dict[str, BuildingSpec] = field(default_factory=_buildings)
    counters: dict[str, dict[str, float]] = field(default_factory=_counters)

    def __post_init__(self) -> None:
        problems = []
        if self.width < 12 or self.height < 12:
            problems.append(f"map must be at least 12 x 12, got {self.width} x {self.height}")
        for name in ("max_ticks", "decision_interval", "intents_per_decision", "max_train", "max_units"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.victory not in ("hq", "annihilation"):
            problems.append(f"victory must be 'hq' or 'annihilation', got {self.victory!r}")
        if self.timeout not in ("score", "draw"):
            problems.append(f"timeout must be 'score' or 'draw', got {self.timeout!r}")
        if set(self.units) != set(UNIT_KINDS):
            problems.append(f"units must define exactly {UNIT_KINDS}, got {tuple(self.units)}")
        if set(self.buildings) != set(BUILDING_KINDS):
            problems.append(f"buildings must define exactly {BUILDING_KINDS}, got {tuple(self.buildings)}")
        for kind, spec in self.units.items():
            if spec.producer not in self.buildings or spec.producer == "hq":
                problems.append(f"unit {kind!r} has producer {spec.producer!r}, not a buildable building")
            if spec.hp <= 0 or spec.cooldown < 1 or spec.speed <= 0 or spec.cost < 0:
                problems.append(f"unit {kind!r} needs hp > 0, cooldown >= 1, speed > 0, cost >= 0")
        for attacker in (*UNIT_KINDS, "tower"):
            row = self.counters.get(attacker)
            if row is None or set(row) != set(TARGET_CLASSES):
                problems.append(f"counters[{attacker!r}] must map exactly {TARGET_CLASSES}")
        if 2 * self.fields_per_side + self.center_fields > 12:
            problems.append("at most 12 resource fields fit the map layout")
        if problems:
            raise ValueError("invalid RTS rules: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (for replays)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rules:
        """Inverse of :meth:`to_dict`; unknown keys are an error (a replay from another version)."""
        data = dict(data)
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown rule fields {sorted(unknown)}")
        if "units" in data:
            data["units"] = {k: UnitSpec(**v) for k, v in data["units"].items()}
        if "buildings" in data:
            data["buildings"] = {k: BuildingSpec(**v) for k, v in data["buildings"].items()}
        return cls(**data)

    def with_unit(self, kind: str, **changes: Any) -> Rules:
        """A copy with one unit's stats changed, e.g. ``rules.with_unit("tank", cost=300)``."""
        if kind not in self.units:
            raise ValueError(f"unknown unit kind {kind!r}; known: {UNIT_KINDS}")
        return replace(self, units={**self.units, kind: replace(self.units[kind], **changes)})

    def with_building(self, kind: str, **changes: Any) -> Rules:
        """A copy with one building's stats changed."""
        if kind not in self.buildings:
            raise ValueError(f"unknown building kind {kind!r}; known: {BUILDING_KINDS}")
        return replace(self, buildings={**self.buildings, kind: replace(self.buildings[kind], **changes)})


def _scaled_attacks(rules: Rules, factor: float) -> Rules:
    units = {k: replace(v, attack=v.attack * factor) for k, v in rules.units.items()}
    tower = rules.buildings["tower"]
    return replace(
        rules,
        units=units,
        buildings={**rules.buildings, "tower": replace(tower, attack=tower.attack * factor)},
    )


#: Named rule shifts and what each one changes (each is checked by a test against ``"standard"``).
PRESETS: dict[str, str] = {
    "standard": "the default rules",
    "rich": "double resource income (HQ and refineries): more is spent and more units are fielded",
    "scarce": "half resource income: less is spent",
    "expensive_tanks": "tanks cost twice as much: tank-heavy strategies field fewer tanks",
    "glass_cannon": "every attack does double damage: fights are shorter and bloodier",
    "fortress": "HQ hit points tripled: HQ rushes take longer",
    "no_fog": "no fog of war: the whole map is visible",
    "annihilation": "victory only by destroying every enemy unit and building",
    "blitz": "matches end at tick 600",
}


def rules_preset(name: str, base: Rules | None = None) -> Rules:
    """The rules of preset ``name`` (see :data:`PRESETS`), applied on top of ``base`` (default rules)."""
    rules = base or Rules()
    if name == "standard":
        return rules
    if name in ("rich", "scarce"):
        factor = 2.0 if name == "rich" else 0.5
        return replace(
            rules, base_income=rules.base_income * factor, refinery_income=rules.refinery_income * factor
        )
    if name == "expensive_tanks":
        return rules.with_unit("tank", cost=rules.units["tank"].cost * 2)
    if name == "glass_cannon":
        return _scaled_attacks(rules, 2.0)
    if name == "fortress":
        return rules.with_building("hq", hp=rules.buildings["hq"].hp * 3)
    if name == "no_fog":
        return replace(rules, fog_of_war=False)
    if name == "annihilation":
        return replace(rules, victory="annihilation")
    if name == "blitz":
        return replace(rules, max_ticks=600)
    raise ValueError(f"unknown rules preset {name!r}; known: {sorted(PRESETS)}")
