"""Twenty questions: oracle answers, invalid and repeated turns, turn budget, win, reward, never raising."""

from __future__ import annotations

import pickle
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_llm.datamodules import Example
from lightning_llm.datamodules.tasks import get_task
from lightning_llm.envs import (
    ATTRIBUTES,
    ITEMS,
    EnvReply,
    TwentyQuestionsEnvironment,
    parse_question,
    run_episode,
)

FOX = Example(prompt="Game 1: find the secret item.", completion="", answer="fox", metadata={"secret": "fox"})


@pytest.fixture
def env() -> TwentyQuestionsEnvironment:
    return TwentyQuestionsEnvironment(num_items=8, max_turns=5)


def test_item_table_is_a_binary_code():
    assert len(ITEMS) == 16 and tuple(ITEMS["book"]) == ATTRIBUTES
    assert ITEMS["fox"] == {
        "alive": True,
        "big": True,
        "red": True,
        "round": False,
        "loud": False,
        "soft": False,
    }
    codes = {tuple(attrs[a] for a in ("alive", "big", "red", "round")) for attrs in ITEMS.values()}
    assert len(codes) == 16


def test_parse_question():
    assert parse_question("<search>red</search>") == ("ask", "red")
    assert parse_question(" <think>hm</think> <search> Big </search>") == ("ask", "big")
    assert parse_question("<answer>Fox</answer>") == ("guess", "fox")
    assert parse_question("<search>red</search><answer>fox</answer>") == ("ask", "red")  # cut at first stop
    for bad in (
        "",
        "red",
        "<search>red",
        "<search></search>",
        "x<search>red</search>",
        "<answer>a<b</answer>",
    ):
        assert parse_question(bad) is None, bad


def test_oracle_answers_and_win(env):
    state = env.reset(FOX)
    assert env.step(state, "<search>alive</search>") == EnvReply("<information>yes</information>", False)
    assert env.step(state, "<search>round</search>") == EnvReply("<information>no</information>", False)
    assert env.candidates(state) == ["bee", "cow", "bird", "fox"]
    assert env.step(state, "<answer>cow</answer>") == EnvReply("<information>no</information>", False)
    assert env.candidates(state) == ["bee", "bird", "fox"]
    assert env.step(state, "<answer>fox</answer>") == EnvReply(None, True)
    assert state.won and state.done and state.turns == 4
    assert state.events == ["yes", "no", "wrong", "win"]
    assert env.step(state, "<search>red</search>") == EnvReply(None, True)  # after done: nothing changes
    assert state.turns == 4
    assert env.reward(state, FOX, "") == pytest.approx(2.0 - 0.05 * 4)


def test_invalid_and_repeated_are_detected_and_penalised(env):
    state = env.reset(FOX)
    replies = [
        env.step(state, turn)
        for turn in (
            "<search>red</search>",
            "<search>red</search>",
            "<search>wings</search>",
            "hello</search>",
        )
    ]
    assert [r.observation for r in replies] == [
        "<information>yes</information>",
        "<information>repeated</information>",
        "<information>invalid</information>",
        "<information>invalid</information>",
    ]
    assert (state.invalid, state.repeated) == (2, 1)
    assert env.turn_penalties(state) == [0.0, -1.0, -5.0, -5.0]
    assert env.step(state, "<answer>dragon</answer>") == EnvReply(
        None, True
    )  # unknown item: invalid, last turn
    assert state.invalid == 3 and not state.won
    assert env.end_reward(state) == pytest.approx(-0.25)
    assert env.reward(state, FOX, "") == pytest.approx(-0.25 - 1 - 15)


def test_turn_budget_ends_the_episode(env):
    state = env.reset(FOX)
    for turn in range(1, 6):
        reply = env.step(state, "<search>big</search>" if turn == 1 else f"<answer>{'book'}</answer>")
        assert reply.done == (turn == 5)
    assert state.turns == 5 and not state.won


def test_reset_refuses_unknown_secret(env):
    with pytest.raises(ValueError, match="not one of"):
        env.reset(Example("p", "", "dragon"))
    with pytest.raises(ValueError, match="not one of"):
        env.reset(Example("p", "", "dog"))  # item 16 is not among the first 8


def test_bad_settings_fail_at_construction():
    with pytest.raises(ValueError, match="num_items"):
        TwentyQuestionsEnvironment(num_items=1)
    with pytest.raises(ValueError, match="max_turns"):
        TwentyQuestionsEnvironment(max_turns=0)
    with pytest.raises(ValueError, match="penalties"):
        TwentyQuestionsEnvironment(invalid_penalty=1.0)
    with pytest.raises(ValueError, match="same answers"):
        TwentyQuestionsEnvironment({"a": {"x": True}, "b": {"x": True}})
    with pytest.raises(ValueError, match="attributes"):
        TwentyQuestionsEnvironment({"a": {"x": True}, "b": {"y": True}})


def test_custom_items():
    env = TwentyQuestionsEnvironment({"Sun": {"hot": True}, "Moon": {"hot": False}}, max_turns=2)
    state = env.reset(Example("p", "", "moon"))
    assert env.step(state, "<search>hot</search>").observation == "<information>no</information>"
    assert env.step(state, "<answer>moon</answer>").done and state.won


_PIECES = st.sampled_from(
    ["<search>", "</search>", "<answer>", "</answer>", "<think>", "red", "fox", " ", "<", "x"]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=12), st.lists(_PIECES, max_size=6).map("".join)), max_size=7))
def test_never_raises_and_state_pickles(turns):
    env = TwentyQuestionsEnvironment(num_items=16, max_turns=6)
    state = env.reset(FOX)
    for turn in turns:
        reply = env.step(state, turn)
        assert isinstance(reply, EnvReply)
    assert state.turns <= 6 and len(state.events) == state.turns
    assert isinstance(env.reward(state, FOX, "".join(turns)), float)
    assert pickle.loads(pickle.dumps(state)) == state


def test_reference_strategy_wins_within_budget():
    task = get_task("twenty_questions", num_items=8, max_turns=4)
    env = TwentyQuestionsEnvironment(num_items=8, max_turns=4)
    examples = task.generate(40, seed=3)
    assert examples == task.generate(40, seed=3)  # seeded
    assert len({e.completion.split("</search>")[0] for e in examples}) > 1  # several first questions
    for example in examples:
        turns = [t + "</search>" if "<search>" in t else t for t in example.completion.split("</search>")]
        policy = iter(t.split("</information>")[-1] for t in turns)
        episode = run_episode(env, example, lambda _context, policy=policy: next(policy))
        assert episode.completion == example.completion
        assert episode.turns[-1] == f"<answer>{example.answer}</answer>" and len(episode.turns) == 4
        assert task.score(example.completion, example) == 1.0
        assert episode.reward == pytest.approx(2.0 - 0.05 * 4)
    assert task.score("<answer>book</answer>", examples[0]) == float(examples[0].answer == "book")
    assert task.score("garbage <answer>", examples[0]) == 0.0


def test_task_checks_budget():
    with pytest.raises(ValueError, match="too few"):
        get_task("twenty_questions", num_items=16, max_turns=4)


def test_reference_early_guesses_fit_the_budget():
    task = get_task("twenty_questions", num_items=8, max_turns=5, guess_rate=0.5)
    examples = task.generate(60, seed=1)
    early = [e for e in examples if e.completion.count("<answer>") == 2 or e.metadata["turns"] < 4]
    assert 10 < len(early) < 60  # some games guess early, wrong ("no") or right (won sooner)
    assert all(task.score(e.completion, e) == 1.0 and e.metadata["turns"] <= 5 for e in examples)
    # no room for an early guess when the budget is exactly the questions plus the guess
    tight = get_task("twenty_questions", num_items=8, max_turns=4, guess_rate=1.0).generate(20, seed=1)
    assert all(e.completion.count("<answer>") == 1 and e.metadata["turns"] == 4 for e in tight)
    with pytest.raises(ValueError, match="guess_rate"):
        get_task("twenty_questions", guess_rate=1.5)


def test_random_reference_strategy_asks_any_attribute_and_still_wins():
    task = get_task("twenty_questions", num_items=8, max_turns=8, guess_rate=0.3, strategy="random")
    env = TwentyQuestionsEnvironment(num_items=8, max_turns=8)
    examples = task.generate(200, seed=2)
    assert examples == task.generate(200, seed=2)  # seeded
    asked = [q for e in examples for q in re.findall(r"<search>(\w+)</search>", e.completion)]
    # uninformative "round" (no for all 8 items) and the partial splits loud/soft are asked too
    assert {"round", "loud", "soft"} <= set(asked)
    for example in examples:
        assert task.score(example.completion, example) == 1.0 and example.metadata["turns"] <= 8
        state = env.reset(example)
        for turn in re.findall(r"<(?:search|answer)>\w+</(?:search|answer)>", example.completion):
            env.step(state, turn)
        assert state.won and state.repeated == 0 and state.invalid == 0
    with pytest.raises(ValueError, match="too few"):  # 6 questions + the guess must fit
        get_task("twenty_questions", num_items=8, max_turns=6, strategy="random")
    with pytest.raises(ValueError, match="strategy"):
        get_task("twenty_questions", strategy="greedy")


def test_informative_questions(env):
    state = env.reset(FOX)
    # round: "no" for all 8 items; alive splits them; the repeat adds nothing; cup is not an item here (invalid,
    # not a question); big splits the 4 alive ones. The fifth turn exhausts the budget.
    turns = ["<search>round</search>", "<search>alive</search>", "<search>alive</search>", "<answer>cup</answer>",
             "<search>big</search>"]  # fmt: skip
    for turn in turns:
        env.step(state, turn)
    assert state.events == ["no", "yes", "repeated", "invalid", "yes"]
    assert env.informative_questions(state) == [False, True, False, True]
    assert env.candidates(state) == ["cow", "fox"]
