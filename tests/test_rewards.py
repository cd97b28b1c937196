"""Reward functions: LARFT's length reward and its word count, and the word-count task (the format reward is tested with GRPO)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_llm.datamodules.tasks import Example, get_task
from lightning_llm.datamodules.tasks.length import COUNT_PROMPT, count_answer, parse_word_count
from lightning_llm.rewards import get_reward, length_reward, length_score, word_count


def _words(n: int) -> str:
    return " ".join(["word"] * n)


@pytest.mark.parametrize(
    ("words", "target", "expected"),
    [
        (90, 100, 0.9),
        (100, 100, 1.0),
        (110, 100, 0.9),
        (200, 100, 0.0),
        (250, 100, 0.0),
        (0, 100, 0.0),
        (3, 4, 0.75),
    ],
)
def test_length_score_values(words, target, expected):
    assert length_score(_words(words), target) == pytest.approx(expected)


def test_zero_target_and_errors():
    assert length_score("", 0) == 1.0
    assert length_score("<think>plenty of thinking</think>", 0) == 1.0
    assert length_score("one", 0) == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        length_score("x", -1)
    with pytest.raises(ValueError, match="target_words"):
        length_reward(["x"], [Example(prompt="p", completion="c", answer="1")])


def test_word_count_ignores_thinking_and_tags():
    assert word_count("<think>a b c d</think> one two three") == 3
    assert word_count("<think>a b</think>x<think>c</think> y") == 2
    assert word_count("one two <think>never closed, so it runs to the end") == 2
    assert word_count("<answer>one two</answer>") == 2
    assert word_count("  spaced\tout\nwords  ") == 3


@given(st.text(max_size=200), st.integers(min_value=0, max_value=500))
def test_length_score_is_bounded_and_never_raises_on_any_text(text, target):
    assert 0.0 <= length_score(text, target) <= 1.0


def test_length_task_and_registered_reward_agree():
    task = get_task("length", min_words=3, max_words=9)
    examples = task.generate(20, seed=0)
    assert {e.metadata["target_words"] for e in examples} <= set(range(3, 10))
    assert all(word_count(e.completion) == e.metadata["target_words"] for e in examples)
    assert all(task.score(e.completion, e) == 1.0 for e in examples)
    assert all(f"exactly {e.answer} words" in e.prompt for e in examples)
    completions = [_words(e.metadata["target_words"] + 1) for e in examples]
    assert get_reward("length")(completions, examples) == [
        task.score(c, e) for c, e in zip(completions, examples, strict=True)
    ]
    assert task.generate(5, seed=1) == task.generate(5, seed=1)
    with pytest.raises(ValueError, match="min_words"):
        get_task("length", min_words=5, max_words=2)


def test_word_count_task_labels_and_verifier():
    task = get_task("word_count", min_words=0, max_words=6)
    examples = task.generate(50, seed=3)
    assert examples == task.generate(50, seed=3)
    assert {int(e.answer) for e in examples} == set(range(7))  # 0 words included
    for example in examples:
        text = example.metadata["text"]
        assert example.prompt == COUNT_PROMPT.replace("{response}", text)
        assert example.completion == count_answer(word_count(text))
        assert task.score(example.completion, example) == 1.0
        assert task.score(count_answer(word_count(text) + 1), example) == 0.0
    assert task.score("no answer <word_count>x</word_count>", examples[0]) == 0.0
    with pytest.raises(ValueError, match="min_words"):
        get_task("word_count", min_words=3, max_words=2)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parse_word_count_never_raises(text):
    value = parse_word_count(text)
    assert value is None or value >= 0
