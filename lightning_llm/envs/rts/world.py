"""The deterministic simulation: entities, economy, production, movement, combat, fog of war, executor.

The map is :class:`~lightning_llm.envs.rts.map.GameMap`; what a player sees of the world and hears back from the
executor are :class:`~lightning_llm.envs.rts.observation.Observation` and
:class:`~lightning_llm.envs.rts.observation.Outcome`.

Entities (units and buildings) are stored as a struct of numpy arrays so that one tick is a handful of
vectorised operations; a 2,000-tick match of two agents runs in well under two seconds on one core
(``benchmarks/rts_speed.py``).

One tick, in order:

1. **Income**: the HQ pays ``base_income``, each finished refinery ``refinery_income`` out of its field.
2. **Production**: construction advances; the head of each production queue advances, and a finished unit
   appears at its building and joins its side's standing army order.
3. **Combat and movement**, simultaneous for both sides (damage is summed, then applied, so nothing depends on
   which side is processed first). Every armed, finished entity picks the nearest enemy (units before
   buildings: a building counts as :data:`BUILDING_PENALTY` cells farther), fires when it is in range and its
   cooldown is over, and holds position while engaged. Otherwise a unit moves ``speed`` cells toward its goal:
   *attack* chases any enemy it sees and else walks to its destination; *defend* and *idle* chase what they see
   within :data:`LEASH` cells of their post and else return to it; *retreat* and *scout* walk to their
   destination without fighting and turn idle there. Units do not collide.
4. **Deaths**: the value (cost) of what died is booked as lost for its owner and killed for the other side.
5. **Vision**: a cell is visible to a side when within ``vision`` of one of its entities (whole map without
   fog of war); seen enemy buildings are remembered at their last seen place.
6. **Victory** (``Rules.victory``), then the per-tick log.

Nothing is random after the map is drawn from the seed: a match is a function of the seed, the rules and
the agents' intents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lightning_llm.envs.rts.intents import Intent
from lightning_llm.envs.rts.map import GameMap
from lightning_llm.envs.rts.observation import Observation, Outcome
from lightning_llm.envs.rts.rules import BUILDING_KINDS, TARGET_CLASSES, UNIT_KINDS, Rules

__all__ = ["KINDS", "LOG_FIELDS", "World"]

#: Entity kinds, units first; an entity's ``kind`` is an index into this tuple.
KINDS = (*UNIT_KINDS, *BUILDING_KINDS)
#: Columns of the per-tick log (one row per tick and player).
LOG_FIELDS = ("credits", "income", "spent", "army_value", "units", "lost", "killed", "visible", "explored")
#: Extra distance (cells) added to buildings when choosing a target, so that units are fought first.
BUILDING_PENALTY = 3.0
#: How far (cells) idle and defending units chase an enemy away from their post.
LEASH = 6.0

_IDLE, _ATTACK, _DEFEND, _RETREAT, _SCOUT = range(5)
_ORDER_NAMES = ("idle", "attack", "defend", "retreat", "scout")
_N_UNIT = len(UNIT_KINDS)
_HQ = KINDS.index("hq")
_REFINERY = KINDS.index("refinery")
_SCOUT_KIND = KINDS.index("scout")


@dataclass
class _Tables:
    """Per-kind stat arrays indexed by entity kind (see :data:`KINDS`)."""

    is_unit: np.ndarray
    speed: np.ndarray
    attack: np.ndarray
    range: np.ndarray
    cooldown: np.ndarray
    vision: np.ndarray
    hp: np.ndarray
    cost: np.ndarray
    counter: np.ndarray  # [attacker kind, target kind] -> multiplier
    penalty: np.ndarray  # target-selection distance penalty per target kind

    @classmethod
    def from_rules(cls, rules: Rules) -> _Tables:
        n = len(KINDS)
        t = cls(
            is_unit=np.arange(n) < _N_UNIT,
            speed=np.zeros(n),
            attack=np.zeros(n),
            range=np.zeros(n),
            cooldown=np.ones(n, dtype=np.int64),
            vision=np.zeros(n),
            hp=np.zeros(n),
            cost=np.zeros(n),
            counter=np.zeros((n, n)),
            penalty=np.where(np.arange(n) < _N_UNIT, 0.0, BUILDING_PENALTY),
        )
        for k, name in enumerate(KINDS):
            spec = rules.units.get(name) or rules.buildings[name]
            t.attack[k], t.range[k], t.cooldown[k] = spec.attack, spec.range, spec.cooldown
            t.vision[k], t.hp[k], t.cost[k] = spec.vision, spec.hp, spec.cost
            if name in rules.units:
                t.speed[k] = rules.units[name].speed
        for a, attacker in enumerate(KINDS):
            row = rules.counters.get(attacker)
            if row is None:
                continue  # unarmed buildings
            for b, target in enumerate(KINDS):
                t.counter[a, b] = row[target if target in TARGET_CLASSES else "building"]
        return t


@dataclass
class _Side:
    credits: float
    income: float = 0.0
    spent: float = 0.0
    lost: float = 0.0
    killed: float = 0.0
    order: int = _IDLE
    dest: tuple[float, float] = (0.0, 0.0)
    explored: np.ndarray | None = None
    visible: np.ndarray | None = None
    seen_buildings: dict[int, tuple[int, float, float]] = field(default_factory=dict)
    vision_keys: np.ndarray | None = None
    produced: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UNIT_KINDS, 0))

    @property
    def visible_fraction(self) -> float:
        return float(self.visible.mean())

    @property
    def explored_fraction(self) -> float:
        return float(self.explored.mean())


class World:
    """The state of one match, advanced by :meth:`step` and steered by :meth:`execute`.

    Args:
        rules: The rules (see :class:`~lightning_llm.envs.rts.rules.Rules`).
        seed: Draws the map; nothing else is random.
    """

    def __init__(self, rules: Rules, seed: int = 0) -> None:
        self.rules = rules
        self.seed = seed
        self.map = GameMap.generate(rules, seed)
        self.tick = 0
        self.winner: int | None = None
        self.over = False
        self._t = _Tables.from_rules(rules)
        cap = 2 * (rules.max_units + 64)
        self._cap = cap
        self.owner = np.zeros(cap, dtype=np.int64)
        self.kind = np.zeros(cap, dtype=np.int64)
        self.x = np.zeros(cap)
        self.y = np.zeros(cap)
        self.hp = np.zeros(cap)
        self.cool = np.zeros(cap, dtype=np.int64)
        self.order = np.zeros(cap, dtype=np.int64)
        self.dest_x = np.zeros(cap)
        self.dest_y = np.zeros(cap)
        self.ready = np.zeros(cap, dtype=np.int64)  # tick from which the entity acts (construction)
        self.field = np.full(cap, -1, dtype=np.int64)  # resource field a refinery sits on
        self.eid = np.full(cap, -1, dtype=np.int64)
        self.alive = np.zeros(cap, dtype=bool)
        self._next_eid = 0
        self.queues: dict[int, list[list[int]]] = {}  # producer slot -> [[unit kind, ticks left], ...]
        self.field_left = np.full(len(self.map.fields), float(rules.field_amount))
        self.sides = [_Side(float(rules.start_credits)) for _ in range(2)]
        for p in (0, 1):
            self.sides[p].dest = self.map.bases[p]
            self.sides[p].explored = np.zeros((rules.height, rules.width), dtype=bool)
            self._spawn(p, _HQ, *self.map.bases[p])
        gx, gy = np.meshgrid(np.arange(rules.width) + 0.5, np.arange(rules.height) + 0.5)
        self._cells = np.stack([gx.ravel(), gy.ravel()], 1)
        vision = self._t.vision
        self._vision_radii = np.unique(vision)
        self._vision_id = np.searchsorted(self._vision_radii, vision)
        self._discs: dict[int, np.ndarray] = {}
        self._build_spots = [self._spots_around(self.map.bases[p]) for p in (0, 1)]
        self.log: list[list[tuple[float, ...]]] = []
        self._vision()

    # ------------------------------------------------------------------------------------------- queries

    @property
    def home_regions(self) -> tuple[str, str]:
        return tuple(self.map.region_of(*b) for b in self.map.bases)  # type: ignore[return-value]

    def entities(self, player: int | None = None) -> np.ndarray:
        """Slots of living entities (of ``player`` when given), in slot order."""
        mask = self.alive.copy()
        if player is not None:
            mask &= self.owner == player
        return np.flatnonzero(mask)

    def score(self, player: int) -> float:
        """The timeout score: cost of the player's living units and buildings plus the value it destroyed.

        Unspent credits do not count, so hoarding does not win a timeout.
        """
        slots = self.entities(player)
        return float(self._t.cost[self.kind[slots]].sum() + self.sides[player].killed)

    def observe(self, player: int) -> Observation:
        """The player's fog-of-war view of the present state."""
        side = self.sides[player]
        mine = self.entities(player)
        units = dict.fromkeys(UNIT_KINDS, 0)
        buildings = {k: 0 for k in BUILDING_KINDS}
        building_up = {k: 0 for k in BUILDING_KINDS}
        army_regions: dict[str, int] = {}
        idle_scouts = 0
        for s in mine:
            name = KINDS[self.kind[s]]
            if self._t.is_unit[self.kind[s]]:
                units[name] += 1
                if self.kind[s] == _SCOUT_KIND:
                    idle_scouts += int(self.order[s] == _IDLE)
                else:
                    region = self.map.region_of(self.x[s], self.y[s])
                    army_regions[region] = army_regions.get(region, 0) + 1
            elif self.ready[s] <= self.tick:
                buildings[name] += 1
            else:
                building_up[name] += 1
        visible = []
        for s in self.entities(1 - player):
            if self._sees(player, self.x[s], self.y[s]):
                visible.append((KINDS[self.kind[s]], self.map.region_of(self.x[s], self.y[s])))
        known: dict[str, list[str]] = {}
        for kind, x, y in side.seen_buildings.values():
            known.setdefault(self.map.region_of(x, y), []).append(KINDS[kind])
        home, enemy_home = self.home_regions[player], self.home_regions[1 - player]
        return Observation(
            tick=self.tick,
            player=player,
            rules=self.rules,
            credits=side.credits,
            income=side.income,
            home=home,
            enemy_home=enemy_home,
            units=units,
            army_regions=army_regions,
            buildings=buildings,
            under_construction=building_up,
            queued=sum(len(q) for s, q in self.queues.items() if self.owner[s] == player),
            free_fields=len(self._free_fields()),
            idle_scouts=idle_scouts,
            visible_enemies=visible,
            known_enemy_buildings={r: sorted(k) for r, k in known.items()},
            visible_fraction=float(side.visible.mean()),
        )

    # ------------------------------------------------------------------------------------------- executor

    def execute(self, player: int, intents: list[Intent]) -> list[Outcome]:
        """Carry out one decision's intents in order; beyond ``Rules.intents_per_decision`` they are rejected.

        Returns one :class:`Outcome` per intent. Nothing here raises on a bad intent: a game must not crash on
        what an agent says.
        """
        outcomes = []
        budget = self.rules.intents_per_decision
        for i, intent in enumerate(intents):
            if i >= budget:
                outcomes.append(Outcome(str(intent), "rejected", f"over budget ({budget} per decision)"))
                continue
            status, reason = self._execute_one(player, intent)
            outcomes.append(Outcome(str(intent), status, reason))
        return outcomes

    def _execute_one(self, player: int, intent: Intent) -> tuple[str, str]:
        verb, args = intent.verb, intent.args
        side = self.sides[player]
        if verb == "wait":
            return "ok", ""
        if verb in ("expand", "build"):
            kind = "refinery" if verb == "expand" else str(args[0])
            spec = self.rules.buildings[kind]
            if spec.requires and not self._has_ready(player, spec.requires):
                return "rejected", f"{kind} requires a finished {spec.requires}"
            if side.credits < spec.cost:
                return "rejected", f"{kind} costs {spec.cost}, have {side.credits:.0f}"
            if kind == "refinery":
                free = self._free_fields()
                if not free:
                    return "rejected", "no free resource field"
                home = self.map.bases[player]
                f = min(free, key=lambda i: (math.dist(self.map.fields[i], home), i))
                pos = self.map.fields[f]
            else:
                f, pos = -1, self._free_spot(player)
                if pos is None:
                    return "rejected", "no room to build near the base"
            side.credits -= spec.cost
            side.spent += spec.cost
            slot = self._spawn(player, KINDS.index(kind), *pos, ready=self.tick + spec.build_ticks)
            self.field[slot] = f
            return "ok", ""
        if verb == "train":
            unit, count = str(args[0]), int(args[1])
            spec = self.rules.units[unit]
            producers = [
                s
                for s in self.entities(player)
                if KINDS[self.kind[s]] == spec.producer and self.ready[s] <= self.tick
            ]
            if not producers:
                return "rejected", f"{unit} needs a finished {spec.producer}"
            room = self.rules.max_units - self._population(player)
            affordable = int(side.credits // spec.cost) if spec.cost else count
            n = min(count, room, affordable)
            if n <= 0:
                why = (
                    "population cap reached"
                    if room <= 0
                    else f"{unit} costs {spec.cost}, have {side.credits:.0f}"
                )
                return "rejected", why
            k = KINDS.index(unit)
            for _ in range(n):
                slot = min(producers, key=lambda s: (sum(q[1] for q in self.queues.get(s, [])), s))
                self.queues.setdefault(slot, []).append([k, spec.train_ticks])
            side.credits -= n * spec.cost
            side.spent += n * spec.cost
            if n < count:
                why = "population cap" if n == room else "credits"
                return "partial", f"trained {n} of {count} ({why})"
            return "ok", ""
        if verb in ("attack", "defend", "retreat"):
            army = [
                s
                for s in self.entities(player)
                if self._t.is_unit[self.kind[s]] and self.kind[s] != _SCOUT_KIND
            ]
            order = {"attack": _ATTACK, "defend": _DEFEND, "retreat": _RETREAT}[verb]
            dest = self.map.region_center(str(args[0])) if verb == "attack" else self._post(player)
            side.order, side.dest = (order if order != _RETREAT else _DEFEND), dest
            if not army:
                return "ok", "no army yet: the order applies to units trained later"
            for s in army:
                self._order(s, order, dest)
            return "ok", ""
        if verb == "scout":
            scouts = [s for s in self.entities(player) if self.kind[s] == _SCOUT_KIND]
            if not scouts:
                return "rejected", "no scout"
            scouts.sort(key=lambda s: (self.order[s] != _IDLE, s))
            self._order(scouts[0], _SCOUT, self.map.region_center(str(args[0])))
            return "ok", ""
        return "rejected", f"unknown verb {verb!r}"  # unreachable for parsed intents

    # ------------------------------------------------------------------------------------------- ticking

    def step(self) -> None:
        """Advance one tick (no-op once the match is over)."""
        if self.over:
            return
        self._income()
        self._production()
        self._combat_and_movement()
        self._vision()
        self._check_victory()
        self._record()
        self.tick += 1
        if not self.over and self.tick >= self.rules.max_ticks:
            self._timeout()

    def _income(self) -> None:
        refineries = np.flatnonzero(self.alive & (self.kind == _REFINERY) & (self.ready <= self.tick))
        hq = np.bincount(self.owner[self.alive & (self.kind == _HQ) & (self.ready <= self.tick)], minlength=2)
        for p, side in enumerate(self.sides):
            income = self.rules.base_income if hq[p] else 0.0
            for s in refineries[self.owner[refineries] == p]:
                f = self.field[s]
                take = min(self.rules.refinery_income, self.field_left[f])
                self.field_left[f] -= take
                income += take
            side.income = income
            side.credits += income

    def _production(self) -> None:
        for slot in sorted(self.queues):
            queue = self.queues[slot]
            if not self.alive[slot] or self.ready[slot] > self.tick or not queue:
                continue
            queue[0][1] -= 1
            if queue[0][1] <= 0:
                kind, _ = queue.pop(0)
                p = int(self.owner[slot])
                new = self._spawn(p, kind, self.x[slot], self.y[slot] - 1.0 + 2.0 * p)
                self.sides[p].produced[KINDS[kind]] += 1
                if kind == _SCOUT_KIND:
                    self._order(new, _IDLE, (self.x[new], self.y[new]))
                else:
                    self._order(new, self.sides[p].order, self.sides[p].dest)
        self.queues = {s: q for s, q in self.queues.items() if q and self.alive[s]}

    def _combat_and_movement(self) -> None:
        ids = np.flatnonzero(self.alive)
        t = self._t
        kind, own = self.kind[ids], self.owner[ids]
        x, y = self.x[ids], self.y[ids]
        dist = np.hypot(x[:, None] - x[None, :], y[:, None] - y[None, :])
        enemy_dist = np.where(own[:, None] != own[None, :], dist, np.inf)
        target = (enemy_dist + t.penalty[kind][None, :]).argmin(1)
        rows = np.arange(len(ids))
        d_target = enemy_dist[rows, target]
        order = self.order[ids]
        active = self.ready[ids] <= self.tick
        fighting = (order != _RETREAT) & (order != _SCOUT)
        engaged = active & (t.attack[kind] > 0) & (d_target <= t.range[kind]) & fighting
        cool = self.cool[ids]
        fire = engaged & (cool == 0)
        damage = np.zeros(len(ids))
        np.add.at(damage, target[fire], t.attack[kind[fire]] * t.counter[kind[fire], kind[target[fire]]])
        self.cool[ids] = np.where(fire, t.cooldown[kind], np.maximum(cool - 1, 0))

        mobile = t.is_unit[kind] & ~engaged
        dx, dy = self.dest_x[ids], self.dest_y[ids]
        tx, ty = x[target], y[target]
        sees = d_target <= t.vision[kind]
        leashed = np.hypot(tx - dx, ty - dy) <= LEASH
        chase = mobile & sees & ((order == _ATTACK) | (((order == _DEFEND) | (order == _IDLE)) & leashed))
        gx, gy = np.where(chase, tx, dx), np.where(chase, ty, dy)
        vx, vy = gx - x, gy - y
        length = np.hypot(vx, vy)
        speed = t.speed[kind]
        step = np.where(mobile & (length > 1e-9), np.minimum(speed, length) / np.maximum(length, 1e-9), 0.0)
        self.x[ids] = x + vx * step
        self.y[ids] = y + vy * step
        arrived = mobile & ~chase & (length <= speed) & ((order == _RETREAT) | (order == _SCOUT))
        self.order[ids[arrived]] = _IDLE

        hp = self.hp[ids] - damage
        self.hp[ids] = hp
        for i in np.flatnonzero(hp <= 0):
            s = ids[i]
            value = float(t.cost[kind[i]])
            self.sides[own[i]].lost += value
            self.sides[1 - own[i]].killed += value
            self.alive[s] = False
            self.queues.pop(int(s), None)
            for side in self.sides:
                side.seen_buildings.pop(int(self.eid[s]), None)

    def _vision(self) -> None:
        rules = self.rules
        w, h = rules.width, rules.height
        buildings = self.alive & ~self._t.is_unit[self.kind]
        for p, side in enumerate(self.sides):
            if not rules.fog_of_war:
                side.visible = np.ones((h, w), dtype=bool)
            else:
                slots = np.flatnonzero(self.alive & (self.owner == p))
                # one disc per distinct (cell, vision radius): armies stack, so there are few of them, and the
                # visible set only changes when one of them does
                cells = np.minimum(self.y[slots].astype(np.int64), h - 1) * w + np.minimum(
                    self.x[slots].astype(np.int64), w - 1
                )
                keys = np.unique(cells * len(KINDS) + self._vision_id[self.kind[slots]])
                if side.vision_keys is None or not np.array_equal(keys, side.vision_keys):
                    visible = np.zeros(h * w, dtype=bool)
                    for key in keys.tolist():
                        visible[self._disc(key)] = True
                    side.visible = visible.reshape(h, w)
                    side.vision_keys = keys
            side.explored |= side.visible
            enemy = np.flatnonzero(buildings & (self.owner != p))
            seen = side.visible[
                np.minimum(self.y[enemy].astype(np.int64), h - 1),
                np.minimum(self.x[enemy].astype(np.int64), w - 1),
            ]
            for s in enemy[seen].tolist():
                side.seen_buildings[int(self.eid[s])] = (
                    int(self.kind[s]),
                    float(self.x[s]),
                    float(self.y[s]),
                )

    def _disc(self, key: int) -> np.ndarray:
        """Flat indices of the cells within the radius of vision id ``key % len(KINDS)`` of cell ``key // ...``."""
        disc = self._discs.get(key)
        if disc is None:
            cell, vid = divmod(key, len(KINDS))
            cx, cy = cell % self.rules.width + 0.5, cell // self.rules.width + 0.5
            radius = self._vision_radii[vid]
            d2 = (self._cells[:, 0] - cx) ** 2 + (self._cells[:, 1] - cy) ** 2
            disc = self._discs[key] = np.flatnonzero(d2 <= radius**2)
        return disc

    def _check_victory(self) -> None:
        if self.rules.victory == "hq":
            standing = np.bincount(self.owner[self.alive & (self.kind == _HQ)], minlength=2)
        else:
            standing = np.bincount(self.owner[self.alive], minlength=2)
        lost = standing == 0
        if lost.any():
            self.over = True
            self.winner = None if lost.all() else (1 if lost[0] else 0)

    def _timeout(self) -> None:
        self.over = True
        if self.rules.timeout == "score":
            a, b = self.score(0), self.score(1)
            self.winner = None if a == b else (0 if a > b else 1)

    def _record(self) -> None:
        units = self.alive & self._t.is_unit[self.kind]
        value = np.bincount(self.owner[units], weights=self._t.cost[self.kind[units]], minlength=2)
        count = np.bincount(self.owner[units], minlength=2)
        self.log.append(
            [
                (side.credits, side.income, side.spent, float(value[p]), float(count[p]), side.lost, side.killed,
                 side.visible_fraction, side.explored_fraction)
                for p, side in enumerate(self.sides)
            ]
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------- helpers

    def _spawn(self, player: int, kind: int, x: float, y: float, ready: int = 0) -> int:
        free = np.flatnonzero(~self.alive & (self.eid < 0))
        if not len(free):
            free = np.flatnonzero(~self.alive)
        slot = int(free[0])
        self.owner[slot], self.kind[slot] = player, kind
        self.x[slot], self.y[slot] = x, y
        self.hp[slot] = self._t.hp[kind]
        self.cool[slot] = 0
        self.ready[slot] = ready
        self.field[slot] = -1
        self.eid[slot] = self._next_eid
        self._next_eid += 1
        self.alive[slot] = True
        self._order(slot, _IDLE, (x, y))
        return slot

    def _order(self, slot: int, order: int, dest: tuple[float, float]) -> None:
        self.order[slot] = order
        self.dest_x[slot], self.dest_y[slot] = dest

    def _population(self, player: int) -> int:
        alive = sum(1 for s in self.entities(player) if self._t.is_unit[self.kind[s]])
        return alive + sum(len(q) for s, q in self.queues.items() if self.owner[s] == player)

    def _has_ready(self, player: int, kind: str) -> bool:
        k = KINDS.index(kind)
        return any(self.kind[s] == k and self.ready[s] <= self.tick for s in self.entities(player))

    def _free_fields(self) -> list[int]:
        occupied = {int(self.field[s]) for s in self.entities() if self.kind[s] == _REFINERY}
        return [f for f in range(len(self.map.fields)) if f not in occupied and self.field_left[f] > 0]

    def _post(self, player: int) -> tuple[float, float]:
        """Where a defending army stands: two cells from the HQ toward the map centre."""
        bx, by = self.map.bases[player]
        cx, cy = self.map.width / 2, self.map.height / 2
        d = math.dist((bx, by), (cx, cy))
        return (bx + 3.0 * (cx - bx) / d, by + 3.0 * (cy - by) / d)

    def _spots_around(self, base: tuple[float, float]) -> list[tuple[float, float]]:
        spots = []
        for dy in range(-5, 6):
            for dx in range(-5, 6):
                p = (base[0] + dx, base[1] + dy)
                if 0.5 <= p[0] <= self.map.width - 0.5 and 0.5 <= p[1] <= self.map.height - 0.5:
                    if 2.0 <= math.hypot(dx, dy) and all(math.dist(p, f) >= 1.5 for f in self.map.fields):
                        spots.append(p)
        spots.sort(key=lambda p: (round(math.dist(p, base), 6), p))
        return spots

    def _free_spot(self, player: int) -> tuple[float, float] | None:
        others = [(self.x[s], self.y[s]) for s in self.entities() if not self._t.is_unit[self.kind[s]]]
        for p in self._build_spots[player]:
            if all(math.dist(p, q) >= 2.0 for q in others):
                return p
        return None

    def _sees(self, player: int, x: float, y: float) -> bool:
        vis = self.sides[player].visible
        return bool(vis[min(int(y), self.rules.height - 1), min(int(x), self.rules.width - 1)])

    def log_array(self) -> np.ndarray:
        """The per-tick log as an array ``[tick, player, field]`` (fields: :data:`LOG_FIELDS`)."""
        return np.asarray(self.log, dtype=np.float64).reshape(len(self.log), 2, len(LOG_FIELDS))

    def snapshot(self) -> list[list[float]]:
        """Living entities as ``[id, owner, kind, x, y, hp]`` rows (for replay frames), in id order."""
        slots = sorted(self.entities(), key=lambda s: self.eid[s])
        return [
            [int(self.eid[s]), int(self.owner[s]), int(self.kind[s]), round(float(self.x[s]), 2),
             round(float(self.y[s]), 2), round(float(self.hp[s]), 1)]
            for s in slots
        ]  # fmt: skip

    def order_name(self, slot: int) -> str:
        return _ORDER_NAMES[int(self.order[slot])]
