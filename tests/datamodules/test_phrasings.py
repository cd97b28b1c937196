"""Question phrasings: arithmetic items asked in several wordings, held-out items and wordings, lenient reading."""

from __future__ import annotations

import pytest

from lightning_llm.datamodules.tasks import get_task, split_train_val
from lightning_llm.datamodules.tasks.arithmetic import ARITHMETIC_PHRASINGS
from lightning_llm.text import last_integer


def test_default_phrasing_keeps_the_original_prompts():
    task = get_task("arithmetic", digits=2, ops="+")
    examples = task.generate(20, seed=3)
    assert all(ex.prompt.startswith("What is ") for ex in examples)
    assert [ex.prompt for ex in examples] == [
        ex.prompt for ex in get_task("arithmetic", digits=2, ops="+", phrasings=[0]).generate(20, seed=3)
    ]


def test_several_phrasings_are_drawn_and_rephrase_keeps_the_answer():
    task = get_task("arithmetic", digits=1, ops="+", operands=3, phrasings=[1, 3, 5])
    examples = task.generate(60, seed=0)
    assert {ex.metadata["phrasing"] for ex in examples} == {1, 3, 5}
    ex = examples[0]
    for i, template in enumerate(ARITHMETIC_PHRASINGS):
        asked = task.rephrase(ex, i)
        assert asked.answer == ex.answer and asked.metadata["phrasing"] == i
        assert (
            asked.prompt == template.format(expression=ex.metadata["expression"]) + " Evaluate left to right."
        )
    with pytest.raises(ValueError, match="phrasing must be in"):
        task.rephrase(ex, len(ARITHMETIC_PHRASINGS))


@pytest.mark.parametrize("bad", [[], [0, 0], [99], [-1]])
def test_bad_phrasings_are_refused(bad):
    with pytest.raises(ValueError, match="phrasings must be distinct indices"):
        get_task("arithmetic", phrasings=bad)


def test_training_never_sees_a_validation_item_in_any_wording():
    task = get_task("arithmetic", digits=1, ops="+", operands=3, phrasings=[0, 1, 2, 3, 4, 5])
    train, val = split_train_val(task, 400, 48, seed=0)
    held_out = {task.item_key(ex) for ex in val}
    assert not held_out & {task.item_key(ex) for ex in train}
    # with several wordings the prompt no longer identifies the item: a prompt check alone would leak
    assert len({ex.prompt for ex in train}) > len({task.item_key(ex) for ex in train})


def test_a_task_with_one_phrasing_refuses_another():
    task = get_task("copy")
    ex = task.generate(1, seed=0)[0]
    assert task.rephrase(ex, 0) is ex
    with pytest.raises(ValueError, match="one phrasing"):
        task.rephrase(ex, 1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", "42"),
        ("<answer>17</answer>", "17"),
        ("3 + 4 = 7, so 7", "7"),
        ("it is -05", "-5"),
        ("007", "7"),
        ("-0", "0"),
        ("no number", None),
        ("12 apples and 30 pears", "30"),
    ],
)
def test_last_integer(text, expected):
    assert last_integer(text) == expected
