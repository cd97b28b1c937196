"""Synthetic reasoning traces for tests and tutorial 11: :func:`focused_trace` (a single-step deduction) and
:func:`meandering_trace` (the same deduction at the same length, with dead ends)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_llm.datamodules.tasks.puzzles import Cell, Puzzle
from lightning_llm.evaluation.reasoning_graph.parse import Claim, format_trace

__all__ = ["focused_trace", "meandering_trace"]


@dataclass
class _Step:
    """One deduction: ``cell = value`` because each other value ``u`` is excluded (naked single) or because
    ``value`` is excluded from every other open cell ``y`` of a unit (hidden single). ``reasons`` maps each
    excluded (cell, value) pair to the cells whose values exclude it."""

    cell: Cell
    value: int
    rule: str
    reasons: list[tuple[Cell, int, list[Cell]]]


def _excluders(puzzle: Puzzle, grid: list[list[int]], cell: Cell, value: int) -> list[Cell] | None:
    """The filled cells that rule ``value`` out at ``cell``: one peer holding it, else the filled inequality
    neighbours (empty list: the inequality alone rules it out); None if nothing does."""
    holders = [p for p in sorted(puzzle.peers(cell)) if grid[p[0]][p[1]] == value]
    if holders:
        givens = [p for p in holders if puzzle.givens[p[0]][p[1]]]
        return [givens[0] if givens else holders[0]]  # cite a clue when one will do: the shorter derivation
    frozen = tuple(tuple(row) for row in grid)
    if value in puzzle.candidates(frozen, cell):
        return None
    return sorted({b if a == cell else a for a, b in puzzle.inequalities if cell in (a, b)} & _filled(grid))


def _filled(grid: list[list[int]]) -> set[Cell]:
    return {(r, c) for r, row in enumerate(grid) for c, v in enumerate(row) if v}


def _units(puzzle: Puzzle) -> list[list[Cell]]:
    n = puzzle.size
    units = [[(r, c) for c in range(n)] for r in range(n)] + [[(r, c) for r in range(n)] for c in range(n)]
    if puzzle.box is not None:
        br, bc = puzzle.box
        for r0 in range(0, n, br):
            for c0 in range(0, n, bc):
                units.append([(r, c) for r in range(r0, r0 + br) for c in range(c0, c0 + bc)])
    return units


def _deduce(puzzle: Puzzle, rng: random.Random) -> list[_Step]:
    """A single-step deduction of the solution: at each step a random naked single, else a random hidden
    single, else (puzzles that need lookahead) the most constrained cell with its solution value, justified by
    excluding its other candidates through its filled peers. Every step's claim is true."""
    n = puzzle.size
    grid = [list(row) for row in puzzle.givens]
    steps: list[_Step] = []
    while any(0 in row for row in grid):
        frozen = tuple(tuple(row) for row in grid)
        empty = [(r, c) for r in range(n) for c in range(n) if grid[r][c] == 0]
        options = {cell: puzzle.candidates(frozen, cell) for cell in empty}
        naked = [cell for cell in empty if len(options[cell]) == 1]
        step: _Step | None = None
        if naked:
            cell = rng.choice(naked)
            value = options[cell][0]
            reasons = [
                (cell, u, _excluders(puzzle, grid, cell, u) or []) for u in range(1, n + 1) if u != value
            ]
            step = _Step(cell, value, "naked single", reasons)
        else:
            hidden = []
            for unit in _units(puzzle):
                for value in range(1, n + 1):
                    spots = [c for c in unit if grid[c[0]][c[1]] == 0 and value in options[c]]
                    if len(spots) == 1 and value not in (grid[r][c] for r, c in unit):
                        hidden.append((spots[0], value, unit))
            if hidden:
                cell, value, unit = rng.choice(hidden)
                others = [y for y in unit if y != cell and grid[y[0]][y[1]] == 0]
                reasons = [(y, value, _excluders(puzzle, grid, y, value) or []) for y in others]
                step = _Step(cell, value, "hidden single", reasons)
        if step is None:
            cell = min(empty, key=lambda c: (len(options[c]), c))
            value = puzzle.solution[cell[0]][cell[1]]
            support = sorted(puzzle.peers(cell) & _filled(grid))
            reasons = [(cell, u, support) for u in range(1, n + 1) if u != value]
            step = _Step(cell, value, "lookahead", reasons)
        steps.append(step)
        grid[step.cell[0]][step.cell[1]] = step.value
    return steps


def _cellname(cell: Cell) -> str:
    return f"r{cell[0] + 1}c{cell[1] + 1}"


def _write(
    puzzle: Puzzle,
    steps: Sequence[_Step],
    keep: Sequence[bool],
    detours: dict[int, list[tuple[str, Cell, int]]] | None = None,
) -> list[Claim]:
    """Claims for ``steps``: for each step, its detours (dead ends inserted before it), the eliminations whose
    flag in ``keep`` is set, then the assignment, which depends on its kept eliminations and directly on the
    claims behind the dropped ones."""
    claims: list[Claim] = []
    owner: dict[Cell, int] = {}  # cell -> id of the claim that assigned it
    flags = iter(keep)
    for i, step in enumerate(steps):
        for kind, cell, value in (detours or {}).get(i, []):
            if kind == "guess":
                # A guess is not derived from anything, so it hangs off the root (the question).
                claims.append(Claim(len(claims) + 1, "assign", cell, value, (), "guess"))
                guess_id = len(claims)
            else:  # "consequence" of the guess just made, later abandoned
                claims.append(
                    Claim(len(claims) + 1, "eliminate", cell, value, (guess_id,), "if the guess holds")
                )
        deps: list[int] = []
        for target, value, excl in step.reasons:
            behind = tuple(dict.fromkeys(owner[x] for x in excl if x in owner))
            if next(flags):
                why = "held by " + ", ".join(_cellname(x) for x in excl) if excl else "inequality"
                claims.append(Claim(len(claims) + 1, "eliminate", target, value, behind, why))
                deps.append(len(claims))
            else:
                deps.extend(d for d in behind if d not in deps)
        claims.append(Claim(len(claims) + 1, "assign", step.cell, step.value, tuple(deps), step.rule))
        owner[step.cell] = len(claims)
    return claims


def focused_trace(puzzle: Puzzle, seed: int = 0, *, eliminations: bool = True) -> str:
    """A focused (single-step) deduction of ``puzzle`` in the trace format, with its answer.

    Each step fills one cell by a naked or hidden single (lookahead only where the puzzle needs it). With
    ``eliminations`` the trace states every elimination the step uses (``r1c2!=3 <- [claim that put 3 in a
    peer]``) and the assignment depends on them; without, the assignment depends directly on the claims that
    filled the cells it uses. Every claim is true and every claim is an ancestor of an answer claim, so under
    ``c_min="ancestors"`` its η is at least 1. ``seed`` breaks ties between available deductions.
    """
    steps = _deduce(puzzle, random.Random(seed))
    keep = [eliminations] * sum(len(s.reasons) for s in steps)
    return format_trace(_write(puzzle, steps, keep), puzzle.solution)


def meandering_trace(puzzle: Puzzle, seed: int = 0, *, dead_ends: int = 3, length: int | None = None) -> str:
    """The deduction of :func:`focused_trace` (same ``seed``, same answer) with ``dead_ends`` claims that lead
    nowhere, at a fixed total length.

    Dead ends are wrong guesses (``r2c3=1 : guess``: a value the givens leave open at the cell the next step
    fills, a false claim later overwritten by the deduced value; a guess hangs off the root), each followed
    where there is room by one consequence drawn from it (``r2c1!=1 <- guess`` at an empty peer: unsupported,
    and false when it rules out the true value). To keep the length, the trace then states
    fewer eliminations: a dropped elimination's assignment depends directly on the claims behind it.

    Args:
        puzzle: The puzzle.
        seed: Same seed as the focused trace to compare with; also places the dead ends.
        dead_ends: Number of dead-end claims (guesses and their consequences).
        length: Total number of claims; default the length of ``focused_trace(puzzle, seed)``.

    Raises:
        ValueError: If ``length`` cannot be met: it must lie between the number of deduction steps plus
            ``dead_ends`` and the focused length plus ``dead_ends``.
    """
    if dead_ends < 0:
        raise ValueError(f"dead_ends must be non-negative, got {dead_ends}")
    rng = random.Random(seed)
    steps = _deduce(puzzle, rng)
    n_elims = sum(len(s.reasons) for s in steps)
    length = len(steps) + n_elims if length is None else length
    keep_count = length - len(steps) - dead_ends
    if not 0 <= keep_count <= n_elims:
        raise ValueError(
            f"cannot write {length} claims with {dead_ends} dead ends: {len(steps)} assignments and 0..{n_elims} "
            f"eliminations fit lengths {len(steps) + dead_ends}..{len(steps) + n_elims + dead_ends}"
        )
    keep = [True] * keep_count + [False] * (n_elims - keep_count)
    rng.shuffle(keep)
    # Dead ends go before randomly chosen steps: a guess at the cell the step is about to fill (the
    # deduction then overwrites it), plus a consequence ruling the guessed value out of one of its peers.
    detours: dict[int, list[tuple[str, Cell, int]]] = {}
    left = dead_ends
    n = puzzle.size
    while left > 0:
        i = rng.randrange(len(steps))
        step = steps[i]
        # A plausible guess: a value the givens leave open at the cell (any wrong value if none is left).
        open_values = [v for v in puzzle.candidates(puzzle.givens, step.cell) if v != step.value]
        wrong = rng.choice(open_values or [v for v in range(1, n + 1) if v != step.value])
        branch = [("guess", step.cell, wrong)]
        if left >= 2:
            peers = sorted(puzzle.peers(step.cell))
            open_peers = [p for p in peers if puzzle.givens[p[0]][p[1]] == 0]
            branch.append(("consequence", rng.choice(open_peers or peers), wrong))
        detours.setdefault(i, []).extend(branch)
        left -= len(branch)
    return format_trace(_write(puzzle, steps, keep, detours), puzzle.solution)
