"""The map of an RTS match: start positions and resource fields drawn from the seed, and the 3 x 3 regions that
intents and observations name."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lightning_llm.envs.rts.intents import REGIONS
from lightning_llm.envs.rts.rules import Rules

__all__ = ["GameMap"]


@dataclass(frozen=True)
class GameMap:
    """Map geometry: start positions (player 0 in the south-west, player 1 mirrored in the north-east) and
    resource fields, drawn from the seed with point symmetry so that neither side is favoured."""

    width: int
    height: int
    bases: tuple[tuple[float, float], tuple[float, float]]
    fields: tuple[tuple[float, float], ...]

    @classmethod
    def generate(cls, rules: Rules, seed: int) -> GameMap:
        rng = np.random.default_rng(seed)
        w, h = rules.width, rules.height
        base = (4.5, h - 4.5)
        mirror = lambda p: (w - p[0], h - p[1])  # noqa: E731
        fields: list[tuple[float, float]] = []
        taken = [base, mirror(base)]

        def draw(center: tuple[float, float], r_min: float, r_max: float) -> tuple[float, float]:
            for _ in range(1000):
                angle, radius = rng.uniform(0, 2 * math.pi), rng.uniform(r_min, r_max)
                p = (
                    round(center[0] + radius * math.cos(angle)) + 0.5,
                    round(center[1] + radius * math.sin(angle)) + 0.5,
                )
                inside = 1.5 <= p[0] <= w - 1.5 and 1.5 <= p[1] <= h - 1.5
                if inside and all(math.dist(p, q) >= 3.0 for q in [*taken, mirror(p)]):
                    return p
            raise RuntimeError("could not place a resource field; use a larger map")

        side = []
        for _ in range(rules.fields_per_side):
            p = draw(base, 4.0, 8.0)
            taken += [p, mirror(p)]
            side.append(p)
        fields += side + [mirror(p) for p in side]
        for _ in range(rules.center_fields // 2):
            p = draw((w / 2, h / 2), 1.5, min(w, h) / 6)
            taken += [p, mirror(p)]
            fields += [p, mirror(p)]
        if rules.center_fields % 2:
            fields.append((w / 2, h / 2))
        return cls(w, h, (base, mirror(base)), tuple(fields))

    def region_of(self, x: float, y: float) -> str:
        col = min(int(3 * x / self.width), 2)
        row = min(int(3 * y / self.height), 2)
        return REGIONS[3 * row + col]

    def region_center(self, region: str) -> tuple[float, float]:
        i = REGIONS.index(region)
        return ((i % 3 + 0.5) * self.width / 3, (i // 3 + 0.5) * self.height / 3)
