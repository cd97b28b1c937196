r"""Round-robin arena with Elo and Bradley–Terry ratings and bootstrap confidence intervals.

**Elo** (docs/methods.md §5): after a game between A and B with score :math:`S_A \in \{1, ½, 0\}`,

.. math::  R_A' = R_A + K\,(S_A - E_A), \qquad E_A = \frac{1}{1 + 10^{(R_B - R_A)/400}}.

Sequential Elo depends on the order of the games, so :meth:`ArenaResult.elo` averages it over
``permutations`` random orders of the same games (and the confidence interval resamples the games with
replacement: a percentile bootstrap).

**Bradley–Terry**: :math:`P(A \text{ beats } B) = \pi_A / (\pi_A + \pi_B)`, fitted by Hunter's (2004) MM
iterations with a draw counted as half a win each way, and a prior of ``prior`` virtual draws between every
pair (so an unbeaten agent has a finite rating). Reported on the Elo scale, :math:`400 \log_{10} \pi` shifted
to a mean of 1000, which makes the two ratings directly comparable.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lightning_llm.envs.rts.match import Agent, MatchResult, play_match
from lightning_llm.envs.rts.replay import save_replay
from lightning_llm.envs.rts.rules import Rules

__all__ = ["ArenaResult", "Game", "RTSArena", "Rating", "bradley_terry", "elo"]


@dataclass(frozen=True)
class Game:
    """One game's record: the agent names by seat, the winner's name (``None`` for a draw), seed and length."""

    first: str
    second: str
    winner: str | None
    seed: int
    ticks: int

    def score(self, name: str) -> float:
        """``name``'s score in this game: 1 win, ½ draw, 0 loss."""
        return 0.5 if self.winner is None else float(self.winner == name)


@dataclass(frozen=True)
class Rating:
    """A rating with a 95 % bootstrap interval."""

    value: float
    low: float
    high: float


def elo(
    games: Sequence[Game], names: Sequence[str], *, k: float = 16.0, start: float = 1000.0
) -> dict[str, float]:
    """Sequential Elo over ``games`` in the given order."""
    ratings = dict.fromkeys(names, start)
    for g in games:
        ra, rb = ratings[g.first], ratings[g.second]
        expected = 1.0 / (1.0 + 10 ** ((rb - ra) / 400))
        delta = k * (g.score(g.first) - expected)
        ratings[g.first], ratings[g.second] = ra + delta, rb - delta
    return ratings


def bradley_terry(
    games: Sequence[Game],
    names: Sequence[str],
    *,
    prior: float = 0.5,
    iterations: int = 1000,
    tol: float = 1e-9,
) -> dict[str, float]:
    """Bradley–Terry strengths on the Elo scale (mean 1000), by MM iterations (see the module docstring)."""
    index = {n: i for i, n in enumerate(names)}
    m = len(names)
    wins = np.full((m, m), prior / 2)  # wins[i, j]: (fractional) wins of i over j
    np.fill_diagonal(wins, 0.0)
    for g in games:
        i, j = index[g.first], index[g.second]
        wins[i, j] += g.score(g.first)
        wins[j, i] += g.score(g.second)
    played = wins + wins.T
    strength = np.ones(m)
    for _ in range(iterations):
        denom = (played / (strength[:, None] + strength[None, :])).sum(1)
        new = wins.sum(1) / np.maximum(denom, 1e-12)
        new /= np.exp(np.log(np.maximum(new, 1e-300)).mean())
        if np.abs(np.log(np.maximum(new, 1e-300) / np.maximum(strength, 1e-300))).max() < tol:
            strength = new
            break
        strength = new
    scale = 400 * np.log10(np.maximum(strength, 1e-300))
    scale += 1000 - scale.mean()
    return {n: float(scale[i]) for n, i in index.items()}


@dataclass
class ArenaResult:
    """The games of an arena run and the ratings computed from them."""

    names: list[str]
    games: list[Game]
    matches: list[MatchResult] = field(default_factory=list, repr=False)

    def elo(
        self, *, k: float = 16.0, permutations: int = 50, bootstrap: int = 200, seed: int = 0
    ) -> dict[str, Rating]:
        """Elo averaged over ``permutations`` game orders, with a percentile-bootstrap 95 % interval."""
        rng = np.random.default_rng(seed)

        def averaged(games: Sequence[Game]) -> np.ndarray:
            runs = [
                [elo([games[i] for i in rng.permutation(len(games))], self.names, k=k)[n] for n in self.names]
                for _ in range(permutations)
            ]
            return np.mean(runs, 0)

        point = averaged(self.games)
        samples = np.array(
            [
                averaged([self.games[i] for i in rng.integers(0, len(self.games), len(self.games))])
                for _ in range(bootstrap)
            ]
        )
        return self._ratings(point, samples)

    def bradley_terry(self, *, prior: float = 0.5, bootstrap: int = 200, seed: int = 0) -> dict[str, Rating]:
        """Bradley–Terry ratings (Elo scale) with a percentile-bootstrap 95 % interval."""
        rng = np.random.default_rng(seed)

        def fit(games: Sequence[Game]) -> np.ndarray:
            ratings = bradley_terry(games, self.names, prior=prior)
            return np.array([ratings[n] for n in self.names])

        point = fit(self.games)
        samples = np.array(
            [
                fit([self.games[i] for i in rng.integers(0, len(self.games), len(self.games))])
                for _ in range(bootstrap)
            ]
        )
        return self._ratings(point, samples)

    def _ratings(self, point: np.ndarray, samples: np.ndarray) -> dict[str, Rating]:
        low, high = np.percentile(samples, [2.5, 97.5], axis=0)
        return {n: Rating(float(point[i]), float(low[i]), float(high[i])) for i, n in enumerate(self.names)}

    def win_rates(self) -> dict[str, float]:
        """Each agent's mean score over its games."""
        return {
            n: float(np.mean([g.score(n) for g in self.games if n in (g.first, g.second)]))
            for n in self.names
        }

    def table(self) -> list[dict[str, float | str]]:
        """One row per agent, best Elo first: Elo and its interval, Bradley–Terry, win rate."""
        e, bt, wr = self.elo(), self.bradley_terry(), self.win_rates()
        rows = [
            {"agent": n, "elo": e[n].value, "elo_low": e[n].low, "elo_high": e[n].high, "bt": bt[n].value,
             "win_rate": wr[n]}
            for n in self.names
        ]  # fmt: skip
        return sorted(rows, key=lambda r: -float(r["elo"]))


class RTSArena:
    """Every pair of agents plays ``games_per_pair`` games, alternating seats, each on a different map seed.

    Args:
        agents: name → a factory making a fresh agent (agents keep per-match state).
        rules: The rules of every game.
        games_per_pair: Games per pair (even numbers give each agent both seats equally often).
        seed: Map seeds are ``seed, seed + 1, ...`` over the pair's games.
        keep_matches: Keep every :class:`MatchResult` (logs and frames: memory grows with the games).
        replay_dir: Write every game's replay there as ``<index>_<first>_vs_<second>_seed<seed>.json``.
    """

    def __init__(
        self,
        agents: Mapping[str, Callable[[], Agent]],
        rules: Rules | None = None,
        *,
        games_per_pair: int = 4,
        seed: int = 0,
        keep_matches: bool = False,
        replay_dir: str | Path | None = None,
    ) -> None:
        if len(agents) < 2:
            raise ValueError("an arena needs at least two agents")
        if games_per_pair < 1:
            raise ValueError(f"games_per_pair must be >= 1, got {games_per_pair}")
        self.agents = dict(agents)
        self.rules = rules or Rules()
        self.games_per_pair = games_per_pair
        self.seed = seed
        self.keep_matches = keep_matches
        self.replay_dir = Path(replay_dir) if replay_dir is not None else None

    def run(self) -> ArenaResult:
        names = list(self.agents)
        games, matches = [], []
        for a in range(len(names)):
            for b in range(a + 1, len(names)):
                for g in range(self.games_per_pair):
                    first, second = (names[a], names[b]) if g % 2 == 0 else (names[b], names[a])
                    seed = self.seed + g
                    match = play_match(
                        [self.agents[first](), self.agents[second]()],
                        self.rules,
                        seed,
                        frame_every=20 if self.replay_dir else 0,
                    )
                    if self.replay_dir is not None:
                        slug = re.sub(
                            r"[^A-Za-z0-9_.-]+", "-", f"{len(games):03d}_{first}_vs_{second}_seed{seed}"
                        )
                        save_replay(match, self.replay_dir / f"{slug}.json")
                    winner = None if match.winner is None else (first, second)[match.winner]
                    games.append(Game(first, second, winner, seed, match.ticks))
                    if self.keep_matches:
                        matches.append(match)
        return ArenaResult(names, games, matches)
