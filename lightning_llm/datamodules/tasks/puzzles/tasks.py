"""The puzzle tasks (Latin square, Futoshiki, mini-Sudoku): prompts, examples and the exact scorer."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Literal

from lightning_llm.datamodules.tasks import Example, Task, extract_answer, register_task
from lightning_llm.datamodules.tasks.puzzles.generate import HOLES_PERCENT, generate_puzzle
from lightning_llm.datamodules.tasks.puzzles.grid import Puzzle, format_grid, parse_grid

Difficulty = Literal["easy", "medium", "hard"]

__all__ = ["DIFFICULTIES", "Difficulty", "FutoshikiTask", "LatinSquareTask", "MiniSudokuTask"]

#: The difficulty levels, easiest first.
DIFFICULTIES: tuple[str, ...] = ("easy", "medium", "hard")


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
        return generate_puzzle(self.name, self.size, self.box, self.target_holes, random.Random(seed))

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

    Generation (see :func:`generate_puzzle`): a random Latin square (every square possible, not uniformly), then
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

    Generation (see :func:`generate_puzzle`): a random Latin square; ``n`` random inequalities of it to start
    with; then clues are removed in random order, and whenever a removal admits a second solution, inequalities of
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

    Generation (see :func:`generate_puzzle`): a random valid grid (every grid possible, not uniformly), then clues
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
