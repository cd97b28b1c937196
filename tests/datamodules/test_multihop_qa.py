"""Synthetic multi-hop QA: a seeded world, questions that need its documents, reference completions that
replay exactly through the search environment."""

from __future__ import annotations

import re

import pytest

from lightning_llm.datamodules import Example, MultiHopQATask, get_task, split_train_val
from lightning_llm.envs import SearchEnvironment, parse_action, run_episode


@pytest.fixture(scope="module", params=[1, 2], ids=["1hop", "2hop"])
def task(request) -> MultiHopQATask:
    return MultiHopQATask(hops=request.param)


@pytest.fixture(scope="module")
def env(task) -> SearchEnvironment:
    return get_task("multihop_qa", hops=task.hops).make_env()


def _turns(example: Example) -> list[str]:
    """The model's turns of the reference completion: the text between the observations."""
    turns, start = [], 0
    for begin, end in example.metadata["observation_spans"]:
        turns.append(example.completion[start:begin])
        start = end
    return [*turns, example.completion[start:]]


def test_registered_with_parameters():
    assert get_task("multihop_qa", num_entities=50, hops=1, seed=3) == MultiHopQATask(50, 1, 3)
    with pytest.raises(ValueError, match="hops must be 1 or 2"):
        MultiHopQATask(hops=3)
    with pytest.raises(ValueError, match="num_entities"):
        MultiHopQATask(num_entities=5)


def test_knowledge_base_is_small_seeded_and_uses_short_unique_names():
    docs = MultiHopQATask().documents()
    assert len(docs) == 200
    assert len({doc.title for doc in docs}) == 200
    assert all(4 <= len(doc.title) <= 5 and doc.title.isalpha() for doc in docs)
    assert all(doc.title in doc.text and len(doc.text) < 80 for doc in docs)
    assert MultiHopQATask(seed=0).documents() == docs
    assert MultiHopQATask(seed=1).documents() != docs
    assert MultiHopQATask(hops=1).documents() == docs  # the world does not depend on the questions


def test_generation_is_deterministic_by_seed(task):
    first = task.generate(50, seed=7)
    assert first == MultiHopQATask(hops=task.hops).generate(50, seed=7)
    assert [e.prompt for e in first] != [e.prompt for e in task.generate(50, seed=8)]
    assert {example.metadata["corpus_id"] for example in first} == {task.corpus_id}


def test_reference_completions_score_one_and_replay_through_the_environment(task, env):
    _check_reference_completions(task, env, task.generate(300, seed=0))


@pytest.mark.parametrize(("num_entities", "seed"), [(10, 1), (2000, 2)])
def test_reference_completions_replay_in_the_smallest_and_largest_worlds(num_entities, seed):
    for hops in (1, 2):
        task = MultiHopQATask(num_entities=num_entities, hops=hops, seed=seed)
        _check_reference_completions(task, task.make_env(), task.generate(300, seed=0))


def _check_reference_completions(
    task: MultiHopQATask, env: SearchEnvironment, examples: list[Example]
) -> None:
    for example in examples:
        assert task.score(example.completion, example) == 1.0
        turns = _turns(example)
        assert len(turns) == task.hops + 1 == len(example.metadata["titles"]) + 1
        # Playing the reference turns gives back the reference completion, and the reward.
        replies = iter(turns)
        episode = run_episode(env, example, lambda context, replies=replies: next(replies))
        assert episode.completion == example.completion and episode.reward == 1.0
        # Every search is for a document the answer needs, and that document is among its results.
        searches = zip(episode.turns, episode.observations, example.metadata["titles"], strict=False)
        for hop, (turn, observation, title) in enumerate(searches):
            assert parse_action(turn) == ("search", title)
            assert f"(Title: {title}) " in observation
            begin, end = example.metadata["observation_spans"][hop]
            assert example.completion[begin:end] == observation
        assert parse_action(episode.turns[-1]) == ("answer", example.answer)


def test_wrong_or_missing_answers_score_zero(task):
    example = task.generate(1, seed=0)[0]
    assert task.score(example.completion.replace(example.answer, "Nobody"), example) == 0.0
    assert task.score(f"<answer>{example.answer}</answer><answer>Nobody</answer>", example) == 0.0
    assert task.score(f"<answer> {example.answer.lower()}. </answer>", example) == 1.0
    assert task.score("", example) == 0.0


def test_first_hop_retrieval_finds_the_needed_document_from_the_question(task):
    env = task.make_env()
    examples = task.generate(300, seed=1)
    hits = sum(
        example.metadata["titles"][0] in [doc.title for doc in env.retriever.search(example.prompt, 3)]
        for example in examples
    )
    assert hits / len(examples) >= 0.95


def test_two_hop_questions_need_two_different_documents():
    for example in MultiHopQATask(hops=2).generate(100, seed=2):
        first, second = example.metadata["titles"]
        words = set(re.findall(r"\w+", example.prompt))
        assert first != second and first in words and second not in words and example.answer not in words


def test_environment_refuses_examples_of_another_world(task):
    example = task.generate(1, seed=0)[0]
    other = MultiHopQATask(seed=task.seed + 1).make_env()
    with pytest.raises(ValueError, match="knowledge base"):
        other.reset(example)


def test_instruction_prefix_is_search_r1_s():
    example = MultiHopQATask(instruction=True).generate(1, seed=0)[0]
    assert example.prompt.startswith("Answer the given question. You must conduct reasoning inside <think>")
    assert example.prompt.endswith("?") and "Question: " in example.prompt


def test_train_and_validation_split_over_one_world():
    train, val = split_train_val(MultiHopQATask(), num_train=300, num_val=40, seed=0)
    assert not {e.prompt for e in train} & {e.prompt for e in val}
