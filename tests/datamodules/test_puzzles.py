"""Logic puzzles (arXiv 2606.03883's generators): unique solutions, exact solver and verifier, PuzzleDataModule."""

from __future__ import annotations

import builtins
import itertools
import random
import time
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_llm.datamodules import PuzzleDataModule
from lightning_llm.datamodules.tasks import (
    Example,
    FutoshikiTask,
    LatinSquareTask,
    MiniSudokuTask,
    Puzzle,
    available_tasks,
    format_grid,
    get_task,
    parse_grid,
    split_train_val,
)
from lightning_llm.types import IGNORE_INDEX

END = "<|im_end|>"
FAMILIES = {"latin_square": (3, 4, 5, 6), "futoshiki": (3, 4, 5, 6), "mini_sudoku": (4, 6)}
_CONFIGS = [(family, size) for family, sizes in FAMILIES.items() for size in sizes]


def _latin_squares(n: int) -> list[tuple[tuple[int, ...], ...]]:
    """Every n x n Latin square, by brute force over rows (576 for n = 4)."""
    rows = list(itertools.permutations(range(1, n + 1)))
    out: list[tuple[tuple[int, ...], ...]] = [()]
    for _ in range(n):
        out = [(*sq, row) for sq in out for row in rows if all(row[c] != r[c] for r in sq for c in range(n))]
    return out


SQUARES = _latin_squares(4)


def _latin_4() -> Puzzle:
    return Puzzle("latin_square", ((0,) * 4,) * 4, SQUARES[0])


@pytest.fixture
def no_eval(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the verifier must never evaluate model output")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)


def _one(task, seed: int = 0) -> tuple[Example, Puzzle]:
    example = task.generate(1, seed)[0]
    return example, example.metadata["puzzle"]


# ------------------------------------------------------------------------------------------------ generation


@settings(max_examples=30, deadline=None)
@given(
    config=st.sampled_from(_CONFIGS),
    difficulty=st.sampled_from(["easy", "medium", "hard"]),
    seed=st.integers(0, 2**63 - 1),
)
def test_property_every_generated_puzzle_has_exactly_its_stored_solution(config, difficulty, seed):
    family, size = config
    task = get_task(family, size=size, difficulty=difficulty)
    puzzle = task.puzzle(seed)
    assert puzzle.family == family and puzzle.size == size
    assert puzzle.solve(limit=2) == [puzzle.solution]
    assert puzzle.is_consistent(puzzle.givens) and puzzle.is_solution(puzzle.solution)
    assert all(
        g in (0, s)
        for gr, sr in zip(puzzle.givens, puzzle.solution, strict=True)
        for g, s in zip(gr, sr, strict=True)
    )
    assert 0 < len(puzzle.empty_cells()) <= task.target_holes
    if family == "futoshiki":
        assert puzzle.inequalities  # starts from n of them
    else:
        assert not puzzle.inequalities


def test_solver_enumerates_exactly_the_576_latin_squares_of_order_4_and_the_288_shidoku_grids():
    assert len(SQUARES) == 576 == len(set(SQUARES))
    empty = ((0,) * 4,) * 4
    latin = Puzzle("latin_square", empty, SQUARES[0])
    found = latin.solve(limit=1000)
    assert len(found) == 576 and set(found) == set(SQUARES)
    boxes = [[(r, c) for r in rows for c in cols] for rows in ((0, 1), (2, 3)) for cols in ((0, 1), (2, 3))]
    sudoku_grids = [sq for sq in SQUARES if all(len({sq[r][c] for r, c in box}) == 4 for box in boxes)]
    found = Puzzle("mini_sudoku", empty, sudoku_grids[0], box=(2, 2)).solve(limit=1000)
    assert len(sudoku_grids) == 288 and len(found) == 288 and set(found) == set(sudoku_grids)


def test_solver_matches_brute_force_on_random_givens_and_inequalities():
    rng = random.Random(0)
    adjacent = [((r, c), (r, c + 1)) for r in range(4) for c in range(3)]
    adjacent += [((r, c), (r + 1, c)) for r in range(3) for c in range(4)]
    for _ in range(40):
        solution = rng.choice(SQUARES)
        givens = tuple(tuple(v if rng.random() < 0.25 else 0 for v in row) for row in solution)
        pairs = rng.sample(adjacent, rng.randint(0, 6))
        inequalities = tuple(
            (a, b) if solution[a[0]][a[1]] < solution[b[0]][b[1]] else (b, a) for a, b in pairs
        )
        puzzle = Puzzle("futoshiki", givens, solution, inequalities)
        # the oracle is independent of the solver and of the verifier: SQUARES are Latin by construction
        expected = {
            sq
            for sq in SQUARES
            if all(
                g in (0, v) for gr, vr in zip(givens, sq, strict=True) for g, v in zip(gr, vr, strict=True)
            )
            and all(sq[ra][ca] < sq[rb][cb] for (ra, ca), (rb, cb) in inequalities)
        }
        assert solution in expected
        found = puzzle.solve(limit=1000)
        assert len(found) == len(set(found)) and set(found) == expected
        assert (len(puzzle.solve(limit=2)) == 1) == (len(expected) == 1)
    # an inconsistent partial grid has no completion; a bad limit is an error, not a silent answer
    assert _latin_4().solve(((1, 1, 0, 0),) + ((0,) * 4,) * 3) == []
    with pytest.raises(ValueError, match="limit"):
        _latin_4().solve(limit=0)


@pytest.mark.parametrize(("family", "size"), [("latin_square", 4), ("futoshiki", 5), ("mini_sudoku", 6)])
def test_generation_is_deterministic_by_seed(family, size):
    task = get_task(family, size=size, difficulty="medium")
    first = task.generate(4, seed=7)
    assert first == task.generate(4, seed=7)
    assert [e.prompt for e in first] != [e.prompt for e in task.generate(4, seed=8)]
    assert len({e.prompt for e in first}) == 4


@pytest.mark.parametrize(("family", "size"), [("latin_square", 5), ("futoshiki", 4), ("mini_sudoku", 6)])
def test_harder_difficulty_empties_a_superset_of_cells(family, size):
    levels = [
        get_task(family, size=size, difficulty=d).generate(6, seed=3) for d in ("easy", "medium", "hard")
    ]
    for easy, medium, hard in zip(*levels, strict=True):
        puzzles = [e.metadata["puzzle"] for e in (easy, medium, hard)]
        assert len({p.solution for p in puzzles}) == 1
        holes = [set(p.empty_cells()) for p in puzzles]
        assert holes[0] <= holes[1] <= holes[2]
        assert [e.metadata["holes"] for e in (easy, medium, hard)] == [len(h) for h in holes]
    targets = [get_task(family, size=size, difficulty=d).target_holes for d in ("easy", "medium", "hard")]
    assert targets == sorted(targets) and len(set(targets)) == 3


def test_holes_override_and_greedy_removal_stopping_short():
    _, full = _one(LatinSquareTask(holes=0))
    assert full.givens == full.solution
    # a 4x4 Latin square needs at least 4 givens, so asking for 16 holes stops short, still unique
    for seed in range(5):
        puzzle = LatinSquareTask(holes=16).puzzle(seed)
        assert len(puzzle.empty_cells()) <= 12 and len(puzzle.solve()) == 1


def test_generation_is_fast():
    start = time.perf_counter()
    LatinSquareTask(difficulty="hard").generate(100, seed=0)
    MiniSudokuTask(difficulty="hard").generate(100, seed=0)
    assert (time.perf_counter() - start) / 200 < 0.01  # measured ~0.25 ms
    start = time.perf_counter()
    FutoshikiTask(size=6, difficulty="hard").generate(5, seed=0)
    assert (time.perf_counter() - start) / 5 < 0.2  # measured ~10 ms


def test_split_supplies_500_training_and_50_validation_4x4_easy_puzzles():
    train, val = split_train_val(LatinSquareTask(), num_train=500, num_val=50, seed=0)
    assert len(train) == 500 and len(val) == 50
    assert not {e.prompt for e in train} & {e.prompt for e in val}


# ------------------------------------------------------------------------------------------------ text + verifier


def test_prompt_renders_the_grid_the_inequalities_and_the_answer_format():
    example, puzzle = _one(FutoshikiTask(size=4, difficulty="hard"))
    lines = example.prompt.splitlines()
    grid_lines = [line for line in lines if len(line) == 7 and set(line) <= set("1234. ")]
    assert len(grid_lines) == 4 and sum(line.count(".") for line in grid_lines) == len(puzzle.empty_cells())
    for (ra, ca), (rb, cb) in puzzle.inequalities:
        assert f"r{ra + 1}c{ca + 1} < r{rb + 1}c{cb + 1}" in lines
    assert "<answer>" in example.prompt and "/" in example.prompt
    assert (
        example.completion
        == f"<answer>{example.answer}</answer>"
        == f"<answer>{format_grid(puzzle.solution)}</answer>"
    )
    assert example.metadata.keys() >= {"task", "puzzle", "difficulty", "size"}
    assert example.metadata["task"] == "futoshiki" and example.metadata["size"] == 4
    sudoku, _ = _one(MiniSudokuTask(size=6))
    assert "------+------" in sudoku.prompt and " | " in sudoku.prompt


def test_format_and_parse_grid():
    grid = SQUARES[5]
    assert parse_grid(format_grid(grid), 4) == grid
    assert parse_grid(f"  {format_grid(grid)}\n", 4) == grid
    for bad in [
        "1234/3412/2143",
        "1234/3412/2143/4321/1234",
        "1234 / 3412/2143/4321",
        "1234,3412,2143,4321",
        "1235/3412/2143/4321",
        "0234/3412/2143/4321",
        "12 34/3412/2143/4321",
        "١٢٣٤/3412/2143/4321",
        "",
    ]:
        assert parse_grid(bad, 4) is None, bad
    assert format_grid(((1, 0), (0, 1))) == "10/01"
    with pytest.raises(ValueError, match="single digits"):
        format_grid(((10, 1), (1, 10)))
    with pytest.raises(ValueError, match="size"):
        parse_grid("1", 10)


@pytest.mark.parametrize("task", [LatinSquareTask(), FutoshikiTask(size=5), MiniSudokuTask(size=6)], ids=str)
def test_verifier_accepts_the_solution_and_rejects_everything_else(task, no_eval):
    example = task.generate(1, seed=1)[0]
    answer = example.answer
    assert task.score(example.completion, example) == 1.0
    assert task.score(f"<think>rows...</think>\n<answer> {answer} </answer>", example) == 1.0
    rows = answer.split("/")
    swapped = "/".join(
        [rows[1], rows[0], *rows[2:]]
    )  # a legal grid (rows 1-2 share a band), not the solution
    assert task.score(f"<answer>{swapped}</answer><answer>{answer}</answer>", example) == 1.0
    assert task.score(f"<answer>{answer}</answer><answer>{swapped}</answer>", example) == 0.0
    incomplete = answer.replace(answer[0], "0")
    for wrong in [
        swapped,
        incomplete,
        answer[:-1],
        answer + "1",
        answer.replace("/", " "),
        "__import__('os')",
    ]:
        assert task.score(f"<answer>{wrong}</answer>", example) == 0.0, wrong
    assert task.score(answer, example) == 0.0  # no tag, no answer
    # without the Puzzle object (an example rebuilt from text) the answer string decides, identically
    bare = Example(example.prompt, example.completion, example.answer, {"task": task.name})
    assert (
        task.score(example.completion, bare) == 1.0 and task.score(f"<answer>{swapped}</answer>", bare) == 0.0
    )


def test_verifier_rejects_a_grid_contradicting_a_given_or_breaking_an_inequality():
    _, puzzle = _one(LatinSquareTask(difficulty="easy"), seed=2)
    rival = next(
        sq
        for sq in SQUARES
        if any(
            g and g != v
            for gr, vr in zip(puzzle.givens, sq, strict=True)
            for g, v in zip(gr, vr, strict=True)
        )
    )
    assert puzzle.is_complete(rival) and not puzzle.is_solution(rival)
    assert not puzzle.is_solution(((0,) * 4,) * 4) and not puzzle.is_solution(puzzle.solution[:3])
    solution = SQUARES[0]
    (a0, a1), (b0, b1) = (0, 0), (0, 1)
    less = ((a0, a1), (b0, b1)) if solution[0][0] < solution[0][1] else ((b0, b1), (a0, a1))
    futoshiki = Puzzle("futoshiki", ((0,) * 4,) * 4, solution, (less,))
    flipped = tuple((row[1], row[0], *row[2:]) for row in solution)  # columns 1 and 2 swapped: still Latin
    assert Puzzle("latin_square", ((0,) * 4,) * 4, solution).is_solution(flipped)
    assert not futoshiki.is_solution(flipped) and not futoshiki.is_consistent(flipped)
    assert futoshiki.check_cell(0, 0, solution[0][0]) and not futoshiki.check_cell(0, 0, flipped[0][0])


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (LatinSquareTask, {"size": 2}, "size"),
        (FutoshikiTask, {"size": 7}, "size"),
        (MiniSudokuTask, {"size": 5}, "size"),
        (LatinSquareTask, {"difficulty": "expert"}, "difficulty"),
        (LatinSquareTask, {"holes": -1}, "holes"),
        (LatinSquareTask, {"holes": 17}, "holes"),
        (FutoshikiTask, {"holes": True}, "holes"),
    ],
)
def test_tasks_reject_bad_parameters(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_puzzle_rejects_bad_inequalities():
    for pair in [((0, 0), (0, 2)), ((0, 0), (1, 1)), ((0, -1), (0, 0)), ((3, 3), (3, 4))]:
        with pytest.raises(ValueError, match="adjacent"):
            Puzzle("futoshiki", ((0,) * 4,) * 4, SQUARES[0], (pair,))


def test_tasks_are_registered():
    assert {"latin_square", "futoshiki", "mini_sudoku"} <= set(available_tasks())
    assert get_task("mini_sudoku", size=6).box == (2, 3)


# ------------------------------------------------------------------------------------------------ DataModule


def test_puzzle_datamodule_batches_fit_and_train_only_the_answer():
    dm = PuzzleDataModule(family="futoshiki", size=4, difficulty="hard", num_train=6, num_val=2, batch_size=3)
    assert dm.task == FutoshikiTask(size=4, difficulty="hard")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the truncation warning would mean a conversation does not fit
        dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 3 and batch["input_ids"].shape[1] <= dm.hparams.max_length
    train, _ = dm._examples()
    completions = {example.completion + END for example in train}
    for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
        assert dm.tokenizer.decode(ids[labels != IGNORE_INDEX]) in completions
    assert all(len(item["input_ids"]) <= dm.hparams.max_length for item in dm._train_data)
    # the hparams are its own arguments, so a checkpoint's copy rebuilds it
    assert "task" not in dm.hparams and PuzzleDataModule(**dm.hparams).task == dm.task


def test_puzzle_datamodule_parses_from_the_cli_and_rejects_bad_arguments():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(PuzzleDataModule, "data")
    cfg = parser.parse_args(["--data.family=mini_sudoku", "--data.size=6", "--data.difficulty=hard"])
    dm = parser.instantiate(cfg).data
    assert dm.task == MiniSudokuTask(size=6, difficulty="hard")
    with pytest.raises(Exception, match="family"):
        parser.parse_args(["--data.family=sudoku"])
    with pytest.raises(ValueError, match=r"do not pass \['task'\]"):
        PuzzleDataModule(task="copy")
    with pytest.raises(ValueError, match="source"):
        PuzzleDataModule(source="data.jsonl")
    with pytest.raises(ValueError, match="unknown puzzle family"):
        PuzzleDataModule(family="kakuro")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size"):
        PuzzleDataModule(family="mini_sudoku", size=5)
