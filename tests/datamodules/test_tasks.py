"""Synthetic tasks: determinism, exact verifiers, registry, train/validation disjointness."""

from __future__ import annotations

import builtins
import time
from dataclasses import dataclass
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_llm.datamodules.tasks import (
    ArithmeticTask,
    CopyTask,
    Example,
    Task,
    available_tasks,
    extract_answer,
    get_task,
    register_task,
    split_train_val,
)


def _left_to_right(operands: tuple[int, ...], ops: tuple[str, ...]) -> int:
    value = operands[0]
    for op, operand in zip(ops, operands[1:], strict=True):
        value = {"+": value + operand, "-": value - operand, "*": value * operand}[op]
    return value


# ------------------------------------------------------------------------------------------------ registry


def test_registry_lists_builtin_tasks_and_builds_them_with_kwargs():
    assert {"arithmetic", "copy"} <= set(available_tasks())
    assert get_task("arithmetic", digits=3) == ArithmeticTask(digits=3)
    assert isinstance(get_task("copy"), CopyTask)


def test_unknown_task_error_lists_available_names():
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*arithmetic.*copy"):
        get_task("nope")


def test_register_rejects_a_taken_name_and_a_missing_name():
    with pytest.raises(ValueError, match="already registered"):

        @register_task
        class _Clash(ArithmeticTask):
            name = "arithmetic"

    with pytest.raises(TypeError, match="name"):

        @register_task
        class _Nameless(Task):
            def generate(self, n: int, seed: int) -> list[Example]:
                return []

            def score(self, completion: str, example: Example) -> float:
                return 0.0


def test_unknown_task_parameter_fails_at_construction():
    with pytest.raises(TypeError, match="digitz"):
        get_task("arithmetic", digitz=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"digits": 0}, "digits"),
        ({"operands": 1}, "operands"),
        ({"ops": ""}, "ops"),
        ({"ops": "+/"}, "ops"),
        ({"ops": "++"}, "ops"),
    ],
)
def test_arithmetic_rejects_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"length": 0}, "length"), ({"alphabet": "aa"}, "distinct"), ({"alphabet": "a b"}, "space")],
)
def test_copy_rejects_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CopyTask(**kwargs)


# ------------------------------------------------------------------------------------------------ generation


@pytest.mark.parametrize("task", [ArithmeticTask(operands=3, chain_of_thought=True), CopyTask()], ids=repr)
def test_generation_is_deterministic_by_seed(task):
    assert task.generate(50, seed=1) == task.generate(50, seed=1)
    assert task.generate(50, seed=1) != task.generate(50, seed=2)


def test_arithmetic_examples_are_correct_left_to_right():
    task = ArithmeticTask(digits=2, operands=4, chain_of_thought=True)
    for example in task.generate(200, seed=0):
        operands, ops = example.metadata["operands"], example.metadata["ops"]
        assert all(10 <= value <= 99 for value in operands)
        assert example.answer == str(_left_to_right(operands, ops))
        assert example.prompt.endswith("? Evaluate left to right.")
        assert example.completion.startswith("<think>") and example.completion.endswith(
            f"</think><answer>{example.answer}</answer>"
        )
        assert example.completion.count(" = ") == 3  # one step per operator
        assert task.score(example.completion, example) == 1.0


def test_arithmetic_two_operand_format():
    example = ArithmeticTask(digits=1, ops="+").generate(1, seed=0)[0]
    a, b = example.metadata["operands"]
    assert example.prompt == f"What is {a} + {b}?"
    assert example.completion == f"<answer>{a + b}</answer>"


def test_copy_examples():
    task = CopyTask(length=5, alphabet="xyz")
    for example in task.generate(50, seed=0):
        symbols = example.answer.split(" ")
        assert len(symbols) == 5 and set(symbols) <= set("xyz")
        assert example.prompt == f"Copy: {example.answer}"
        assert example.completion == f"<answer>{example.answer}</answer>"


@pytest.mark.parametrize(
    "task", [ArithmeticTask(operands=4, chain_of_thought=True), CopyTask(length=16)], ids=repr
)
def test_generation_of_10k_examples_takes_well_under_a_second(task):
    def seconds() -> float:
        start = time.perf_counter()
        task.generate(10_000, seed=0)
        return time.perf_counter() - start

    assert min(seconds() for _ in range(3)) < 0.75  # best of three: robust to a busy machine


# ------------------------------------------------------------------------------------------------ verifiers


@pytest.fixture
def no_eval(monkeypatch):
    """Make any use of eval/exec during scoring fail loudly."""

    def _forbidden(*args, **kwargs):
        raise AssertionError("a verifier must never evaluate model output")

    monkeypatch.setattr(builtins, "eval", _forbidden)
    monkeypatch.setattr(builtins, "exec", _forbidden)


_NINETY_FIVE = Example(prompt="What is 37 + 58?", completion="<answer>95</answer>", answer="95")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>95</answer>", 1.0),
        ("<answer> 95\n</answer>", 1.0),
        ("<think>37 + 58 = 95</think><answer>95</answer>", 1.0),
        ("<answer>12</answer> wait, no: <answer>95</answer>", 1.0),  # the last tag counts
        ("<answer>95</answer> wait, no: <answer>12</answer>", 0.0),
        ("<answer>96</answer>", 0.0),
        ("95", 0.0),  # missing tag
        ("<answer>95", 0.0),  # unclosed
        ("<answer>The answer is 95</answer>", 0.0),
        ("<answer>95.</answer>", 0.0),
        ("<answer>95.0</answer>", 0.0),
        ("<answer>+95</answer>", 0.0),
        ("<answer>095</answer>", 0.0),
        ("<answer>9 5</answer>", 0.0),
        ("<answer>٩٥</answer>", 0.0),  # Arabic-Indic digits: not ASCII
        ("<answer>37 + 58</answer>", 0.0),
        ("<answer></answer>", 0.0),
        ("", 0.0),
    ],
)
def test_arithmetic_verifier(completion, expected, no_eval):
    assert ArithmeticTask().score(completion, _NINETY_FIVE) == expected


def test_arithmetic_verifier_negative_answers():
    example = Example(prompt="What is 3 - 8?", completion="<answer>-5</answer>", answer="-5")
    task = ArithmeticTask()
    assert task.score("<answer>-5</answer>", example) == 1.0
    assert task.score("<answer>5</answer>", example) == 0.0
    assert task.score("<answer>--5</answer>", example) == 0.0
    assert task.score("<answer>- 5</answer>", example) == 0.0


def test_eval_bait_scores_zero_without_executing(tmp_path, no_eval):
    marker = tmp_path / "pwned"
    bait = f"<answer>__import__('pathlib').Path({str(marker)!r}).touch() or 95</answer>"
    example = Example(prompt="What is 95 + 0?", completion="<answer>95</answer>", answer="95")
    assert ArithmeticTask().score(bait, example) == 0.0
    assert CopyTask().score(bait, example) == 0.0
    assert not marker.exists()


def test_huge_numbers_do_not_hit_int_conversion_limits():
    huge = "9" * 5000  # int() of a string this long raises ValueError by default
    example = Example(prompt="", completion=f"<answer>{huge}</answer>", answer=huge)
    assert ArithmeticTask().score(example.completion, example) == 1.0


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>a b c</answer>", 1.0),
        ("<answer> a b c </answer>", 1.0),
        ("<answer>a b</answer><answer>a b c</answer>", 1.0),
        ("<answer>a b c</answer><answer>a b</answer>", 0.0),
        ("<answer>a  b c</answer>", 0.0),
        ("<answer>abc</answer>", 0.0),
        ("<answer>a b c d</answer>", 0.0),
        ("<answer>Copy: a b c</answer>", 0.0),
        ("a b c", 0.0),
    ],
)
def test_copy_verifier(completion, expected, no_eval):
    example = Example(prompt="Copy: a b c", completion="<answer>a b c</answer>", answer="a b c")
    assert CopyTask().score(completion, example) == expected


def test_extract_answer_takes_the_last_closed_tag():
    assert extract_answer("<answer>1</answer><answer>2</answer><answer>3") == "2"
    assert extract_answer("<answer>a\nb</answer>") == "a\nb"
    assert extract_answer("no tag") is None


_TASK_PARAMS = st.builds(
    ArithmeticTask,
    digits=st.integers(1, 6),
    ops=st.sampled_from(["+", "-", "*", "+-", "-*", "+-*"]),
    operands=st.integers(2, 5),
    chain_of_thought=st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(task=_TASK_PARAMS, seed=st.integers(0, 2**63 - 1), delta=st.integers(-1000, 1000).filter(bool))
def test_property_reference_scores_one_and_a_perturbed_answer_zero(task, seed, delta):
    (example,) = task.generate(1, seed)
    assert example.answer == str(_left_to_right(example.metadata["operands"], example.metadata["ops"]))
    assert task.score(example.completion, example) == 1.0
    wrong = str(int(example.answer) + delta)
    assert (
        task.score(example.completion.replace(f"<answer>{example.answer}<", f"<answer>{wrong}<"), example)
        == 0.0
    )


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_property_any_text_scores_zero_or_one_without_error(text):
    assert ArithmeticTask().score(text, _NINETY_FIVE) in (0.0, 1.0)
    assert CopyTask().score(text, _NINETY_FIVE) in (0.0, 1.0)


# ------------------------------------------------------------------------------------------------ splitting


def test_split_train_val_is_disjoint_sized_and_deterministic():
    task = ArithmeticTask(digits=1)  # 300 distinct prompts: collisions are certain without the filter
    train, val = split_train_val(task, num_train=500, num_val=50, seed=3)
    assert len(train) == 500 and len(val) == 50
    assert not {example.prompt for example in train} & {example.prompt for example in val}
    assert (train, val) == split_train_val(task, num_train=500, num_val=50, seed=3)
    assert val == task.generate(50, seed=3)


def test_split_train_val_fails_when_validation_exhausts_the_task():
    @dataclass(frozen=True)
    class _Constant(Task):
        name: ClassVar[str] = "constant"

        def generate(self, n: int, seed: int) -> list[Example]:
            return [Example(prompt="same", completion="<answer>1</answer>", answer="1")] * n

        def score(self, completion: str, example: Example) -> float:
            return 0.0

    with pytest.raises(ValueError, match="prompt space is too small"):
        split_train_val(_Constant(), num_train=10, num_val=1, seed=0)


def test_examples_pass_through_lightning_device_transfer_unchanged():
    from lightning.fabric.utilities.apply_func import move_data_to_device

    examples = CopyTask().generate(3, seed=0)
    moved = move_data_to_device({"example": examples}, "cpu")
    assert all(a is b for a, b in zip(moved["example"], examples, strict=True))
