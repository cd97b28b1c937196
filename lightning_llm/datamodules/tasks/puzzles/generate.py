"""Generation of uniquely solvable puzzles: a random solution, then clues removed while it stays unique."""

from __future__ import annotations

import random
from collections.abc import Sequence

from lightning_llm.datamodules.tasks.puzzles.grid import Cell, Grid, Puzzle
from lightning_llm.datamodules.tasks.puzzles.solver import GridSolver

__all__ = ["HOLES_PERCENT", "generate_puzzle"]


#: Percent of the ``n²`` cells a difficulty leaves empty (the target, rounded down; see :func:`generate_puzzle`).
#: Futoshiki empties more cells at every level: its inequalities carry the information the givens no longer do.
HOLES_PERCENT: dict[str, dict[str, int]] = {
    "latin_square": {"easy": 35, "medium": 50, "hard": 65},
    "mini_sudoku": {"easy": 35, "medium": 50, "hard": 65},
    "futoshiki": {"easy": 50, "medium": 70, "hard": 85},
}


def generate_puzzle(
    family: str, n: int, box: tuple[int, int] | None, holes: int, rng: random.Random
) -> Puzzle:
    """One uniquely solvable puzzle with (up to) ``holes`` empty cells, a pure function of the arguments.

    1. A random solution: row-major backtracking with random candidate order
       (:meth:`~lightning_llm.datamodules.tasks.puzzles.solver.GridSolver.random_solution`).
       Every Latin square (mini-Sudoku grid) of the size has a positive probability, but the distribution is
       **not uniform** over them (grids with fewer dead ends on the way are likelier).
    2. The cells in a random order; each is emptied if the puzzle stays uniquely solvable, else kept as a
       given, until ``holes`` cells are empty or every cell has been tried. Greedy removal can get stuck above
       the target (a hard 6x6 Latin square rarely reaches it): the puzzle then has fewer holes than asked.
    3. Futoshiki starts from ``n`` random inequalities of the solution (adjacent cells, oriented as the
       solution orders them). When emptying a cell admits a second completion, inequalities of the solution
       that this completion breaks are added (first in a random order of all adjacent pairs) until the puzzle
       is unique again; if no inequality separates them, the cell is kept and that step's additions dropped.

    The random draws up to any point do not depend on ``holes``, so for one ``rng`` seed an easier puzzle's
    empty cells are a subset of a harder one's (same solution): difficulty never lowers the hole count.
    """
    solver = GridSolver(n, box, ())
    solution = solver.random_solution(rng)
    order = list(range(n * n))
    rng.shuffle(order)
    futoshiki = family == "futoshiki"
    pairs: list[tuple[int, int]] = []
    used: list[tuple[int, int]] = []
    if futoshiki:
        across = [(i, i + 1) for i in range(n * n) if i % n < n - 1]
        adjacent = across + [(i, i + n) for i in range(n * n - n)]
        pairs = [(a, b) if solution[a] < solution[b] else (b, a) for a, b in adjacent]  # (smaller, larger)
        rng.shuffle(pairs)
        used = pairs[:n]
        solver = GridSolver(n, None, _cells(used, n))
    givens = list(solution)
    empty = 0
    for cell in order:
        if empty >= holes:
            break
        givens[cell] = 0
        added: list[tuple[int, int]] = []
        while (other := solver.other_solution(givens, cell, solution[cell])) is not None:
            breaking = next((p for p in pairs if p not in used and other[p[0]] > other[p[1]]), None)
            if breaking is None:  # Latin / mini-Sudoku, or Futoshiki with nothing left to separate them
                break
            added.append(breaking)
            used.append(breaking)
            solver = GridSolver(n, None, _cells(used, n))
        if other is None:
            empty += 1
            continue
        givens[cell] = solution[cell]
        if added:
            used = used[: len(used) - len(added)]
            solver = GridSolver(n, None, _cells(used, n))
    return Puzzle(
        family=family,
        givens=_unflatten(givens, n),
        solution=_unflatten(solution, n),
        inequalities=tuple(sorted(_cells(used, n))),
        box=box,
    )


def _cells(pairs: Sequence[tuple[int, int]], n: int) -> list[tuple[Cell, Cell]]:
    return [((a // n, a % n), (b // n, b % n)) for a, b in pairs]


def _unflatten(values: Sequence[int], n: int) -> Grid:
    return tuple(tuple(values[r * n : (r + 1) * n]) for r in range(n))
