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
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Literal

from lightning_llm.datamodules.tasks import Example, Task, extract_answer, register_task

Grid = tuple[tuple[int, ...], ...]
Cell = tuple[int, int]
Difficulty = Literal["easy", "medium", "hard"]

__all__ = [
    "DIFFICULTIES",
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

#: The difficulty levels, easiest first.
DIFFICULTIES: tuple[str, ...] = ("easy", "medium", "hard")


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
            lines += [f"{_cell_name(a)} < {_cell_name(b)}" for a, b in self.inequalities]
        return "\n".join(lines)

    @cached_property
    def _solver(self) -> _Solver:
        # Built once per puzzle (the dataclass is frozen; cached_property writes the instance dict directly).
        return _Solver(self.size, self.box, self.inequalities)

    def _inequalities_ok(self, grid: list[list[int]], cell: Cell) -> bool:
        for a, b in self.inequalities:
            if cell not in (a, b):
                continue
            va, vb = grid[a[0]][a[1]], grid[b[0]][b[1]]
            if va and vb and not va < vb:
                return False
        return True


def _cell_name(cell: Cell) -> str:
    """``r{row}c{col}``, 1-based: the cell notation shared by prompts and reasoning-graph traces."""
    return f"r{cell[0] + 1}c{cell[1] + 1}"


# ------------------------------------------------------------------------------------------------ solver


class _Solver:
    """Backtracking over one family's constraints, with bitmasks: the engine of :meth:`Puzzle.solve` and of
    the generators, which call it once per clue they try to remove.

    Cells are flat indices ``r * n + c``; a set of values is an int with bit ``v`` for value ``v``. Masks of the
    values used per row, column and box make a cell's candidates a few AND operations instead of the set
    building of :meth:`Puzzle.candidates`: the same candidates, in the same order, so the same completions
    come out in the same order, at a fraction of the cost (4x4 generation must stay in the millisecond range).
    """

    def __init__(
        self, n: int, box: tuple[int, int] | None, inequalities: Sequence[tuple[Cell, Cell]]
    ) -> None:
        self.n = n
        self.full = ((1 << n) - 1) << 1
        cells = range(n * n)
        self.row = [i // n for i in cells]
        self.col = [i % n for i in cells]
        # Without boxes every cell gets a box of its own (index n + i), whose mask then only ever holds the
        # cell's own value: no constraint, and no branch in the hot loop.
        if box is None:
            self.box = [n + i for i in cells]
        else:
            br, bc = box
            self.box = [(i // n // br) * (n // bc) + (i % n) // bc for i in cells]
        below: list[list[int]] = [[] for _ in cells]  # cells this cell must be smaller than
        above: list[list[int]] = [[] for _ in cells]  # cells this cell must be larger than
        for (ra, ca), (rb, cb) in inequalities:
            a, b = ra * n + ca, rb * n + cb
            below[a].append(b)
            above[b].append(a)
        self.below = [tuple(cells_) for cells_ in below]
        self.above = [tuple(cells_) for cells_ in above]

    def _masks(self, values: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        n = self.n
        rows, cols, boxes = [0] * n, [0] * n, [0] * (n + n * n)
        for i, v in enumerate(values):
            if v:
                bit = 1 << v
                rows[self.row[i]] |= bit
                cols[self.col[i]] |= bit
                boxes[self.box[i]] |= bit
        return rows, cols, boxes

    def _candidates(
        self, values: list[int], rows: list[int], cols: list[int], boxes: list[int], i: int
    ) -> int:
        mask = self.full & ~(rows[self.row[i]] | cols[self.col[i]] | boxes[self.box[i]])
        for j in self.below[i]:
            v = values[j]
            if v:
                mask &= (1 << v) - 1  # only values < v
        for j in self.above[i]:
            v = values[j]
            if v:
                mask &= ~((2 << v) - 1)  # only values > v
        return mask

    def solutions(self, values: list[int], limit: int) -> list[tuple[int, ...]]:
        """Up to ``limit`` completions (flat) of the consistent flat grid ``values`` (not modified)."""
        values = list(values)
        found: list[tuple[int, ...]] = []
        empty = [i for i, v in enumerate(values) if not v]
        self._search(values, *self._masks(values), empty, found, limit)
        return found

    def other_solution(self, values: list[int], cell: int, avoid: int) -> tuple[int, ...] | None:
        """A completion of ``values`` (``cell`` empty) whose ``cell`` is not ``avoid``, or None.

        The generators' uniqueness test: when the puzzle was uniquely solvable before ``cell`` was emptied,
        every other completion must differ from the solution at ``cell``, so searching only those branches is
        equivalent to ``len(solve(limit=2)) == 1`` and skips re-deriving the known solution.
        """
        values = list(values)
        rows, cols, boxes = self._masks(values)
        mask = self._candidates(values, rows, cols, boxes, cell) & ~(1 << avoid)
        empty = [i for i, v in enumerate(values) if not v]
        found: list[tuple[int, ...]] = []
        r, c, b = self.row[cell], self.col[cell], self.box[cell]
        while mask and not found:
            bit = mask & -mask
            mask ^= bit
            values[cell] = bit.bit_length() - 1
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            self._search(values, rows, cols, boxes, empty, found, 1)
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[b] ^= bit
        return found[0] if found else None

    def _search(
        self,
        values: list[int],
        rows: list[int],
        cols: list[int],
        boxes: list[int],
        empty: list[int],
        found: list[tuple[int, ...]],
        limit: int,
    ) -> None:
        best, best_mask, best_count = -1, 0, self.n + 1
        for i in empty:
            if values[i]:
                continue
            mask = self._candidates(values, rows, cols, boxes, i)
            if not mask:
                return
            count = mask.bit_count()
            if count < best_count:
                best, best_mask, best_count = i, mask, count
                # Nothing later can beat a forced cell; a later dead cell (0 candidates) stays dead below, so
                # stopping here finds exactly what the full scan would, in the same order.
                if count == 1:
                    break
        if best < 0:
            found.append(tuple(values))
            return
        r, c, b = self.row[best], self.col[best], self.box[best]
        while best_mask:
            bit = best_mask & -best_mask  # increasing values
            best_mask ^= bit
            values[best] = bit.bit_length() - 1
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            self._search(values, rows, cols, boxes, empty, found, limit)
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[b] ^= bit
            values[best] = 0
            if len(found) >= limit:
                return

    def random_solution(self, rng: random.Random) -> list[int]:
        """A random complete grid (flat): row-major backtracking with the candidates tried in random order."""
        values = [0] * (self.n * self.n)
        if not self._fill(0, values, *self._masks(values), rng):  # pragma: no cover - every size has a grid
            raise RuntimeError(f"no {self.n} x {self.n} grid satisfies the constraints")
        return values

    def _fill(
        self,
        i: int,
        values: list[int],
        rows: list[int],
        cols: list[int],
        boxes: list[int],
        rng: random.Random,
    ) -> bool:
        if i == len(values):
            return True
        mask = self._candidates(values, rows, cols, boxes, i)
        options = [v for v in range(1, self.n + 1) if mask >> v & 1]
        rng.shuffle(options)
        r, c, b = self.row[i], self.col[i], self.box[i]
        for v in options:
            bit = 1 << v
            values[i] = v
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            if self._fill(i + 1, values, rows, cols, boxes, rng):
                return True
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[b] ^= bit
        values[i] = 0
        return False


# ------------------------------------------------------------------------------------------------ generation

#: Percent of the ``n²`` cells a difficulty leaves empty (the target, rounded down; see :func:`_generate`).
#: Futoshiki empties more cells at every level: its inequalities carry the information the givens no longer do.
HOLES_PERCENT: dict[str, dict[str, int]] = {
    "latin_square": {"easy": 35, "medium": 50, "hard": 65},
    "mini_sudoku": {"easy": 35, "medium": 50, "hard": 65},
    "futoshiki": {"easy": 50, "medium": 70, "hard": 85},
}


def _generate(family: str, n: int, box: tuple[int, int] | None, holes: int, rng: random.Random) -> Puzzle:
    """One uniquely solvable puzzle with (up to) ``holes`` empty cells, a pure function of the arguments.

    1. A random solution: row-major backtracking with random candidate order (:meth:`_Solver.random_solution`).
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
    solver = _Solver(n, box, ())
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
        solver = _Solver(n, None, _cells(used, n))
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
            solver = _Solver(n, None, _cells(used, n))
        if other is None:
            empty += 1
            continue
        givens[cell] = solution[cell]
        if added:
            used = used[: len(used) - len(added)]
            solver = _Solver(n, None, _cells(used, n))
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


# ------------------------------------------------------------------------------------------------ text


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


_TITLES = {"latin_square": "Latin square", "futoshiki": "Futoshiki", "mini_sudoku": "mini-Sudoku"}


def _prompt(puzzle: Puzzle) -> str:
    """The user message: the rules, the rendered puzzle and the answer format."""
    n = puzzle.size
    rules = "each number appears exactly once in every row and every column"
    if puzzle.box is not None:
        br, bc = puzzle.box
        rules = (
            f"each number appears exactly once in every row, every column and every {br}x{bc} box "
            "(boxes are separated by | and -)"
        )
    extra = ""
    if puzzle.family == "futoshiki":
        rules += ", and every inequality holds"
        extra = (
            f" Rows are numbered 1 to {n} from the top and columns 1 to {n} from the left; rXcY is the cell in "
            "row X, column Y, so r1c2 < r1c3 means the number in row 1, column 2 is smaller than the number in "
            "row 1, column 3."
        )
    return (
        f"Solve this {n}x{n} {_TITLES[puzzle.family]} puzzle. Fill every empty cell (.) with a number from 1 to "
        f"{n} so that {rules}.{extra}\n\n{puzzle.render()}\n\n"
        "Give the completed grid as <answer>...</answer>: the rows from top to bottom separated by /, each row "
        f"its {n} digits from left to right with no spaces (a 2x2 grid with rows 1 2 and 2 1 would be "
        "<answer>12/21</answer>)."
    )


# ------------------------------------------------------------------------------------------------ tasks


@dataclass(frozen=True)
class _PuzzleTask(Task):
    """Shared parameters, generation and verifier of the puzzle families (see the subclasses)."""

    #: The sizes the family supports.
    sizes: ClassVar[tuple[int, ...]]

    size: int = 4
    difficulty: Difficulty = "easy"
    holes: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or self.size not in self.sizes:
            raise ValueError(f"{self.name}: size must be one of {self.sizes}, got {self.size!r}")
        if self.difficulty not in DIFFICULTIES:
            raise ValueError(
                f"{self.name}: difficulty must be one of {DIFFICULTIES}, got {self.difficulty!r}"
            )
        cells = self.size * self.size
        if self.holes is not None and (
            isinstance(self.holes, bool) or not isinstance(self.holes, int) or not 0 <= self.holes <= cells
        ):
            raise ValueError(f"{self.name}: holes must be an int in 0..{cells} (or None), got {self.holes!r}")

    @property
    def box(self) -> tuple[int, int] | None:
        """Box shape ``(rows, cols)`` (mini-Sudoku), else None."""
        return None

    @property
    def target_holes(self) -> int:
        """Empty cells asked for: ``holes`` if given, else the difficulty's :data:`HOLES_PERCENT` of the cells."""
        if self.holes is not None:
            return self.holes
        return self.size * self.size * HOLES_PERCENT[self.name][self.difficulty] // 100

    def puzzle(self, seed: int) -> Puzzle:
        """One uniquely solvable puzzle, a pure function of the parameters and ``seed``."""
        return _generate(self.name, self.size, self.box, self.target_holes, random.Random(seed))

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        examples = []
        for _ in range(n):
            # A seed per puzzle, not one shared stream: puzzle i then depends on (seed, i) only, not on how many
            # draws the earlier puzzles took, so difficulties stay comparable puzzle by puzzle.
            puzzle = self.puzzle(rng.getrandbits(64))
            answer = format_grid(puzzle.solution)
            examples.append(
                Example(
                    prompt=_prompt(puzzle),
                    completion=f"<answer>{answer}</answer>",
                    answer=answer,
                    metadata={
                        "task": self.name,
                        "puzzle": puzzle,
                        "difficulty": self.difficulty,
                        "size": self.size,
                        "holes": len(puzzle.empty_cells()),
                    },
                )
            )
        return examples

    def score(self, completion: str, example: Example) -> float:
        """1.0 iff the last ``<answer>`` is a grid (:func:`parse_grid`) that solves the example's puzzle.

        Without a :class:`Puzzle` in the metadata (an example rebuilt from text) the grid is compared with
        ``example.answer``, which is the same test: the solution is unique.
        """
        content = extract_answer(completion)
        if content is None:
            return 0.0
        puzzle = example.metadata.get("puzzle")
        size = puzzle.size if isinstance(puzzle, Puzzle) else self.size
        grid = parse_grid(content, size)
        if grid is None:
            return 0.0
        if isinstance(puzzle, Puzzle):
            return float(puzzle.is_solution(grid))
        return float(format_grid(grid) == example.answer)


@register_task
@dataclass(frozen=True)
class LatinSquareTask(_PuzzleTask):
    """Latin square completion: fill an ``n × n`` grid so that each of ``1..n`` is once per row and column.

    Generation (see :func:`_generate`): a random Latin square (every square possible, not uniformly), then
    clues removed in random order while the puzzle stays uniquely solvable, up to the difficulty's number of
    empty cells. A family of arXiv 2606.03883's scalable puzzle generators with exact verifiers.

    Args:
        size: The side ``n``, 3 to 6.
        difficulty: ``"easy"``, ``"medium"`` or ``"hard"``: 35 %, 50 % or 65 % of the cells empty (rounded
            down; 4x4: 5, 8, 10 holes; 6x6: 12, 18, 23). Greedy removal may stop short of the target.
        holes: Overrides the difficulty's number of empty cells (0 to ``n²``; still only as many as keep the
            solution unique).
    """

    name = "latin_square"
    sizes = (3, 4, 5, 6)


@register_task
@dataclass(frozen=True)
class FutoshikiTask(_PuzzleTask):
    """Futoshiki: a Latin square puzzle with inequalities (``r1c2 < r1c3``) between adjacent cells.

    Generation (see :func:`_generate`): a random Latin square; ``n`` random inequalities of it to start with;
    then clues are removed in random order, and whenever a removal admits a second solution, inequalities of
    the solution that rule it out are added until it is unique again. Harder levels empty more cells and so
    lean more on the inequalities. A family of arXiv 2606.03883's puzzle generators with exact verifiers.

    Args:
        size: The side ``n``, 3 to 6.
        difficulty: ``"easy"``, ``"medium"`` or ``"hard"``: 50 %, 70 % or 85 % of the cells empty (rounded
            down; 4x4: 8, 11, 13 holes; 6x6: 18, 25, 30).
        holes: Overrides the difficulty's number of empty cells (0 to ``n²``).
    """

    name = "futoshiki"
    sizes = (3, 4, 5, 6)


@register_task
@dataclass(frozen=True)
class MiniSudokuTask(_PuzzleTask):
    """Mini-Sudoku: a Latin square whose boxes also hold every value once (4x4 with 2x2 boxes, 6x6 with 2x3).

    Generation (see :func:`_generate`): a random valid grid (every grid possible, not uniformly), then clues
    removed in random order while the puzzle stays uniquely solvable. A Sudoku-like family of arXiv
    2606.03883's puzzle generators with exact verifiers.

    Args:
        size: 4 (2x2 boxes) or 6 (2 rows x 3 columns boxes).
        difficulty: ``"easy"``, ``"medium"`` or ``"hard"``: 35 %, 50 % or 65 % of the cells empty (rounded
            down; 4x4: 5, 8, 10 holes; 6x6: 12, 18, 23).
        holes: Overrides the difficulty's number of empty cells (0 to ``n²``).
    """

    name = "mini_sudoku"
    sizes = (4, 6)

    @property
    def box(self) -> tuple[int, int] | None:
        return (2, 2) if self.size == 4 else (2, 3)
