"""A puzzle instance and its constraints: the exact verifier, the solver entry point and the grid text formats.

Cells are ``(row, col)``, 0-based; the text formats write them 1-based as ``r{row+1}c{col+1}``
(:func:`cell_name`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

from lightning_llm.datamodules.tasks.puzzles.solver import GridSolver

Grid = tuple[tuple[int, ...], ...]
Cell = tuple[int, int]

__all__ = ["Cell", "Grid", "Puzzle", "cell_name", "format_grid", "parse_grid"]


@dataclass(frozen=True)
class Puzzle:
    """One puzzle instance: its givens, its (unique) solution and its family's constraints.

    Cells are ``(row, col)``, 0-based internally; the text formats (prompts, traces) write them 1-based as
    ``r{row+1}c{col+1}``.

    Attributes:
        family: ``"latin_square"``, ``"futoshiki"`` or ``"mini_sudoku"``.
        givens: The clues, row by row; 0 marks an empty cell.
        solution: The unique completion of ``givens``.
        inequalities: Futoshiki constraints ``(a, b)``, each meaning value(a) < value(b), between orthogonally
            adjacent cells.
        box: ``(box_rows, box_cols)`` for mini-Sudoku (each box holds every value once), else None.
    """

    family: str
    givens: Grid
    solution: Grid
    inequalities: tuple[tuple[Cell, Cell], ...] = ()
    box: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        n = len(self.solution)
        if n < 2 or any(len(row) != n for row in self.solution) or len(self.givens) != n:
            raise ValueError(f"puzzle: solution must be an n x n grid with n >= 2, got {self.solution!r}")
        if any(len(row) != n for row in self.givens):
            raise ValueError(f"puzzle: givens must be {n} x {n}, got {self.givens!r}")
        if self.box is not None and self.box[0] * self.box[1] != n:
            raise ValueError(f"puzzle: box {self.box} does not tile a {n} x {n} grid")
        for pair in self.inequalities:
            # A negative or out-of-range index would silently wrap around (or raise IndexError deep inside
            # the checks); a non-adjacent pair is not a Futoshiki constraint.
            if not (
                len(pair) == 2
                and all(len(cell) == 2 and all(0 <= x < n for x in cell) for cell in pair)
                and abs(pair[0][0] - pair[1][0]) + abs(pair[0][1] - pair[1][1]) == 1
            ):
                raise ValueError(
                    f"puzzle: inequality {pair!r} must join two orthogonally adjacent cells of the {n} x {n} grid"
                )
        if not self.is_complete(self.solution):
            raise ValueError("puzzle: the solution breaks the puzzle's own constraints")
        for r, c in self.cells():
            if self.givens[r][c] not in (0, self.solution[r][c]):
                raise ValueError(
                    f"puzzle: given r{r + 1}c{c + 1}={self.givens[r][c]} contradicts the solution"
                )

    @property
    def size(self) -> int:
        """The side ``n`` of the grid (values are ``1..n``)."""
        return len(self.solution)

    def cells(self) -> Iterator[Cell]:
        """All cells, row-major."""
        n = self.size
        return ((r, c) for r in range(n) for c in range(n))

    def empty_cells(self) -> list[Cell]:
        """The cells the solver has to fill."""
        return [(r, c) for r, c in self.cells() if self.givens[r][c] == 0]

    def check_cell(self, row: int, col: int, value: int) -> bool:
        """Whether ``value`` is the solution's value at ``(row, col)`` (0-based): the ground truth of a claim."""
        n = self.size
        return 0 <= row < n and 0 <= col < n and self.solution[row][col] == value

    def peers(self, cell: Cell) -> set[Cell]:
        """The cells that must differ from ``cell``: its row, its column and (mini-Sudoku) its box."""
        r, c = cell
        n = self.size
        out = {(r, j) for j in range(n)} | {(i, c) for i in range(n)}
        if self.box is not None:
            br, bc = self.box
            r0, c0 = r - r % br, c - c % bc
            out |= {(i, j) for i in range(r0, r0 + br) for j in range(c0, c0 + bc)}
        out.discard(cell)
        return out

    def is_consistent(self, grid: Grid) -> bool:
        """Whether a partial grid (0 = empty) breaks none of the constraints among its filled cells.

        Values outside ``1..n`` (other than 0) are inconsistent. This does not ask whether the grid can still be
        completed, only whether what is filled is pairwise legal.
        """
        n = self.size
        if len(grid) != n or any(len(row) != n for row in grid):
            return False
        for r, c in self.cells():
            v = grid[r][c]
            if v == 0:
                continue
            if not 1 <= v <= n:
                return False
            if any(grid[i][j] == v for i, j in self.peers((r, c))):
                return False
        for (ra, ca), (rb, cb) in self.inequalities:
            a, b = grid[ra][ca], grid[rb][cb]
            if a and b and not a < b:
                return False
        return True

    def is_complete(self, grid: Grid) -> bool:
        """Whether ``grid`` is filled and satisfies every constraint."""
        return all(v != 0 for row in grid for v in row) and self.is_consistent(grid)

    def is_solution(self, grid: Grid) -> bool:
        """Whether ``grid`` is a complete legal grid that agrees with every given (the exact verifier)."""
        if not self.is_complete(grid):
            return False
        return all(self.givens[r][c] in (0, grid[r][c]) for r, c in self.cells())

    def candidates(self, grid: Grid, cell: Cell) -> list[int]:
        """Values that ``cell`` (empty in ``grid``) could take without breaking a constraint right now."""
        r, c = cell
        taken = {grid[i][j] for i, j in self.peers(cell)}
        out = []
        for v in range(1, self.size + 1):
            if v in taken:
                continue
            trial = [list(row) for row in grid]
            trial[r][c] = v
            if self._inequalities_ok(trial, cell):
                out.append(v)
        return out

    def solve(self, grid: Grid | None = None, limit: int = 2) -> list[Grid]:
        """Up to ``limit`` completions of ``grid`` (default: the givens), by backtracking on the most
        constrained cell. ``len(puzzle.solve()) == 1`` is the uniqueness check.

        The cell tried next is the first (row-major) empty cell with the fewest candidates, its candidates in
        increasing order, so the completions come in a fixed order. An inconsistent ``grid`` has none.
        """
        if limit < 1:
            raise ValueError(f"puzzle: solve needs limit >= 1, got {limit}")
        grid = self.givens if grid is None else grid
        if not self.is_consistent(grid):
            return []
        n = self.size
        return [
            tuple(tuple(flat[r * n : (r + 1) * n]) for r in range(n))
            for flat in self._solver.solutions([v for row in grid for v in row], limit)
        ]

    def render(self) -> str:
        """The puzzle as prompt text: the grid, then (Futoshiki) its inequalities.

        One line per row, top to bottom, values separated by spaces and ``.`` for an empty cell. Mini-Sudoku
        boxes are drawn with ``|`` between them and a ``-+-`` line between bands. Inequalities follow under
        ``Inequalities:``, one per line as ``r1c2 < r1c3`` (1-based row and column, the cell notation of the
        reasoning-graph traces), in the order stored.
        """
        br, bc = self.box if self.box is not None else (self.size, self.size)
        lines = []
        for r, row in enumerate(self.givens):
            if r and r % br == 0:
                lines.append("-+-".join("-" * (2 * bc - 1) for _ in range(self.size // bc)))
            stacks = [row[c : c + bc] for c in range(0, self.size, bc)]
            lines.append(" | ".join(" ".join(str(v) if v else "." for v in stack) for stack in stacks))
        if self.inequalities:
            lines += ["", "Inequalities:"]
            lines += [f"{cell_name(a)} < {cell_name(b)}" for a, b in self.inequalities]
        return "\n".join(lines)

    @cached_property
    def _solver(self) -> GridSolver:
        # Built once per puzzle (the dataclass is frozen; cached_property writes the instance dict directly).
        return GridSolver(self.size, self.box, self.inequalities)

    def _inequalities_ok(self, grid: list[list[int]], cell: Cell) -> bool:
        for a, b in self.inequalities:
            if cell not in (a, b):
                continue
            va, vb = grid[a[0]][a[1]], grid[b[0]][b[1]]
            if va and vb and not va < vb:
                return False
        return True


def cell_name(cell: Cell) -> str:
    """``r{row}c{col}``, 1-based: the cell notation shared by prompts and reasoning-graph traces."""
    return f"r{cell[0] + 1}c{cell[1] + 1}"


def format_grid(grid: Sequence[Sequence[int]]) -> str:
    """The answer format: each row's digits left to right, rows top to bottom joined by ``/`` (``12/21``).

    Raises ValueError for a value that is not a single digit 0-9 (0, an empty cell, is written ``0``).
    """
    if any(not (isinstance(v, int) and 0 <= v <= 9) for row in grid for v in row):
        raise ValueError(f"format_grid: values must be single digits 0-9, got {grid!r}")
    return "/".join("".join(str(v) for v in row) for row in grid)


def parse_grid(text: str, size: int) -> Grid | None:
    """The grid that ``text`` writes in :func:`format_grid`'s format, or None if it is not exactly that.

    Exactly ``size`` rows of ``size`` ASCII digits ``1``-``size`` separated by ``/``; whitespace is allowed
    only around the whole. Nothing else is tolerated (no spaces inside, no other separators, no zeros): a
    malformed answer is a wrong answer.
    """
    if not 1 <= size <= 9:
        raise ValueError(f"parse_grid: size must be 1..9 (one digit per cell), got {size}")
    row = f"[1-{size}]{{{size}}}"
    match = re.fullmatch(rf"\s*({row}(?:/{row}){{{size - 1}}})\s*", text)
    if match is None:
        return None
    return tuple(tuple(int(ch) for ch in line) for line in match.group(1).split("/"))
