"""Logic puzzles with unique solutions and exact verifiers: Latin square, Futoshiki, mini-Sudoku.

A :class:`Puzzle` is an ``n × n`` grid over the values ``1..n`` with some cells given (0 = empty) and a family's
constraints: every family has the Latin constraint (each value once per row and column); Futoshiki adds
inequalities between orthogonally adjacent cells; mini-Sudoku adds boxes. The reasoning-graph evaluation
(:mod:`lightning_llm.evaluation.reasoning_graph`) verifies a trace's claims against it with
:meth:`Puzzle.check_cell` and :meth:`Puzzle.is_consistent`.

The tasks (:class:`LatinSquareTask`, :class:`FutoshikiTask`, :class:`MiniSudokuTask`) are the scalable
generators with exact verifiers that arXiv 2606.03883 studies the reasoning structure of large reasoning models
on: every generated puzzle has exactly one solution (checked by the solver while clues are removed), so a
completion is right iff it is *the* solution, and difficulty is a dial (how many cells are empty).

One file per job: :mod:`.grid` (the :class:`Puzzle`, its verifier and the grid text formats), :mod:`.solver`
(bitmask backtracking), :mod:`.generate` (unique-solution generation, difficulty as holes) and :mod:`.tasks` (the
registered tasks).
"""

from lightning_llm.datamodules.tasks.puzzles.generate import HOLES_PERCENT
from lightning_llm.datamodules.tasks.puzzles.grid import Cell, Grid, Puzzle, format_grid, parse_grid
from lightning_llm.datamodules.tasks.puzzles.tasks import (
    DIFFICULTIES,
    Difficulty,
    FutoshikiTask,
    LatinSquareTask,
    MiniSudokuTask,
)

__all__ = [
    "DIFFICULTIES",
    "HOLES_PERCENT",
    "Cell",
    "Difficulty",
    "FutoshikiTask",
    "Grid",
    "LatinSquareTask",
    "MiniSudokuTask",
    "Puzzle",
    "format_grid",
    "parse_grid",
]
