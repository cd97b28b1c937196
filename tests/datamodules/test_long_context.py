"""Long-context retrieval tasks (associative recall, needle, multi-key needle) and NeedleDataModule."""

from __future__ import annotations

import builtins

import pytest

from lightning_llm.datamodules import NeedleDataModule, get_task
from lightning_llm.datamodules.tasks import (
    AssociativeRecallTask,
    Example,
    MultiKeyNeedleTask,
    NeedleTask,
    available_tasks,
    split_train_val,
)
from lightning_llm.datamodules.tasks.long_context import (
    _FILLER_WORDS,
    LONG_CONTEXT_TASKS,
    NEEDLE_KEYS,
    prose_sentences,
)

_TASKS = [
    AssociativeRecallTask(),
    AssociativeRecallTask(num_pairs=6, num_queries=3, filler=2),
    NeedleTask(haystack_words=60),
    NeedleTask(haystack_words=60, depth=0.5),
    MultiKeyNeedleTask(haystack_words=60),
]


@pytest.fixture
def no_eval(monkeypatch):
    def _forbidden(*args, **kwargs):
        raise AssertionError("a verifier must never evaluate model output")

    monkeypatch.setattr(builtins, "eval", _forbidden)
    monkeypatch.setattr(builtins, "exec", _forbidden)


def test_tasks_are_registered():
    assert set(LONG_CONTEXT_TASKS) <= set(available_tasks())
    assert get_task("associative_recall", num_pairs=4) == AssociativeRecallTask(num_pairs=4)
    assert get_task("needle", depth=0.25) == NeedleTask(depth=0.25)
    assert get_task("multikey_needle", num_needles=2) == MultiKeyNeedleTask(num_needles=2)


@pytest.mark.parametrize("task", _TASKS, ids=repr)
def test_generation_is_deterministic_deduplicated_and_scores_its_reference(task, no_eval):
    examples = task.generate(200, seed=3)
    assert examples == task.generate(200, seed=3)
    assert examples != task.generate(200, seed=4)
    assert len({example.prompt for example in examples}) == 200
    for example in examples[:50]:
        assert task.score(example.completion, example) == 1.0
        assert example.completion == f"<answer>{example.answer}</answer>"
        assert example.metadata["task"] == task.name
        start, end = example.metadata["needle_char_start"], example.metadata["needle_char_end"]
        assert 0 <= start < end <= example.metadata["context_chars"] < len(example.prompt)
        assert 0.0 <= example.metadata["needle_depth"] < 1.0


def test_split_train_val_works_on_the_long_context_tasks():
    train, val = split_train_val(AssociativeRecallTask(num_pairs=4), num_train=300, num_val=50, seed=0)
    assert len(train) == 300 and not {e.prompt for e in train} & {e.prompt for e in val}


def test_generation_fails_clearly_when_the_task_space_is_too_small():
    with pytest.raises(ValueError, match="distinct examples"):
        AssociativeRecallTask(num_pairs=1, keys="ab", values="01").generate(10, seed=0)


# ---------------------------------------------------------------------------------------- associative recall


def test_associative_recall_examples_are_correct():
    task = AssociativeRecallTask(num_pairs=8, num_queries=2)
    for example in task.generate(100, seed=0):
        pairs = dict(example.metadata["pairs"])
        assert len(pairs) == 8  # distinct keys
        keys = example.metadata["query_keys"]
        assert example.prompt.endswith(f" Query: {' '.join(keys)}")
        assert example.answer == " ".join(pairs[key] for key in keys)
        for key, start in zip(keys, example.metadata["needle_char_starts"], strict=True):
            assert example.prompt[start : start + 3] == f"{key}={pairs[key]}"
        first = example.metadata["query_pair_indices"][0]
        key, value = example.metadata["pairs"][first]
        span = example.prompt[example.metadata["needle_char_start"] : example.metadata["needle_char_end"]]
        assert span == f"{key}={value}" and example.prompt[example.metadata["needle_char_start"] - 1] == " "


def test_associative_recall_depth_follows_the_pair_index():
    examples = AssociativeRecallTask(num_pairs=16).generate(300, seed=1)
    by_index = sorted(examples, key=lambda example: example.metadata["query_pair_indices"][0])
    depths = [example.metadata["needle_depth"] for example in by_index]
    assert depths == sorted(depths) and depths[0] < 0.15 and depths[-1] > 0.85


def test_associative_recall_length_scales_with_pairs_and_filler():
    def length(**kwargs):
        return len(AssociativeRecallTask(**kwargs).generate(1, seed=0)[0].prompt)

    assert length(num_pairs=4) < length(num_pairs=8) < length(num_pairs=16) < length(num_pairs=16, filler=2)
    assert length(num_pairs=8) - length(num_pairs=4) == 4 * len(" a=1")
    example = AssociativeRecallTask(num_pairs=5, filler=3).generate(1, seed=0)[0]
    context = example.prompt[: example.metadata["context_chars"]].removeprefix("Pairs: ").removesuffix(".")
    words = context.split()
    assert len(words) == 5 + 4 * 3 and all(word in _FILLER_WORDS for word in words if "=" not in word)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>7 2</answer>", 1.0),
        ("<answer> 7 2 </answer>", 1.0),
        ("<answer>1</answer> no: <answer>7 2</answer>", 1.0),
        ("<answer>7 2</answer> no: <answer>2 7</answer>", 0.0),
        ("<answer>2 7</answer>", 0.0),
        ("<answer>7  2</answer>", 0.0),
        ("<answer>7,2</answer>", 0.0),
        ("<answer>7</answer>", 0.0),
        ("7 2", 0.0),
        ("<answer>7 2", 0.0),
        ("", 0.0),
    ],
)
def test_associative_recall_verifier(completion, expected, no_eval):
    example = Example(prompt="Pairs: a=7 b=2. Query: a b", completion="<answer>7 2</answer>", answer="7 2")
    assert AssociativeRecallTask(num_pairs=2, num_queries=2).score(completion, example) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_pairs": 0}, "num_pairs"),
        ({"num_pairs": 22}, "num_pairs"),
        ({"num_pairs": 3, "keys": "abc", "num_queries": 4}, "num_queries"),
        ({"num_queries": 0}, "num_queries"),
        ({"filler": -1}, "filler"),
        ({"keys": "aab"}, "distinct"),
        ({"keys": "a b", "num_pairs": 2}, "whitespace"),
        ({"values": "1=2"}, "whitespace or any of"),
        ({"values": ""}, "values"),
        ({"keys": "ab1", "num_pairs": 2}, "share"),
    ],
)
def test_associative_recall_rejects_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AssociativeRecallTask(**kwargs)


# -------------------------------------------------------------------------------------------------- needles


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_needle_goes_at_the_requested_depth(depth):
    for example in NeedleTask(haystack_words=140, depth=depth).generate(20, seed=0):
        meta = example.metadata
        key, value = meta["needles"][0]
        assert meta["query_key"] == key and example.answer == value
        needle = f"The code for {key} is {value}."
        assert example.prompt[meta["needle_char_start"] : meta["needle_char_end"]] == needle
        assert example.prompt.count(needle) == 1
        assert example.prompt.endswith(f"\nWhat is the code for {key}?")
        assert meta["needle_depth"] == pytest.approx(depth, abs=0.1)
        if depth == 0.0:
            assert meta["needle_char_start"] == 0


def test_needle_random_depth_covers_the_context():
    depths = [example.metadata["needle_depth"] for example in NeedleTask(haystack_words=100).generate(200, 0)]
    assert min(depths) < 0.1 and max(depths) > 0.9


@pytest.mark.parametrize("words", [0, 1, 7, 50, 200])
def test_needle_haystack_has_exactly_the_requested_words(words):
    example = NeedleTask(haystack_words=words).generate(1, seed=0)[0]
    meta = example.metadata
    context = example.prompt[: meta["context_chars"]]
    haystack = context[: meta["needle_char_start"]] + context[meta["needle_char_end"] :]
    assert len(haystack.split()) == words
    assert not set(haystack.replace(".", " ").split()) & set(NEEDLE_KEYS)  # no key in the filler
    assert not any(character.isdigit() for character in haystack)


def test_needle_length_scales_with_haystack_words():
    lengths = [
        len(NeedleTask(haystack_words=words).generate(1, seed=0)[0].prompt) for words in (50, 100, 400)
    ]
    assert lengths[0] < lengths[1] < lengths[2]
    assert 4 * 350 < lengths[2] - lengths[0] < 6 * 350  # a filler word and its space are about 5 characters


def test_multikey_needles_are_distinct_and_the_query_is_one_of_them():
    task = MultiKeyNeedleTask(haystack_words=80, num_needles=5)
    for example in task.generate(50, seed=0):
        meta = example.metadata
        needles = meta["needles"]
        assert len({key for key, _ in needles}) == 5 and len({value for _, value in needles}) == 5
        for (key, value), start in zip(needles, meta["needle_char_starts"], strict=True):
            sentence = f"The code for {key} is {value}."
            assert example.prompt[start : start + len(sentence)] == sentence
        assert dict(needles)[meta["query_key"]] == example.answer
        assert example.prompt[meta["needle_char_start"] :].startswith(f"The code for {meta['query_key']} is")
        assert all(len(value) == 4 and value.isdigit() for _, value in needles)


@pytest.mark.parametrize("task", [NeedleTask(), MultiKeyNeedleTask()], ids=repr)
@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>0482</answer>", 1.0),
        ("<answer> 0482\n</answer>", 1.0),
        ("<answer>482</answer>", 0.0),
        ("<answer>04820</answer>", 0.0),
        ("<answer>0482</answer><answer>1</answer>", 0.0),
        ("<answer>0 4 8 2</answer>", 0.0),
        ("<answer>__import__('os')</answer>", 0.0),
        ("The code is 0482.", 0.0),
    ],
)
def test_needle_verifier(task, completion, expected, no_eval):
    example = Example(prompt="…", completion="<answer>0482</answer>", answer="0482")
    assert task.score(completion, example) == expected


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (NeedleTask, {"haystack_words": -1}, "haystack_words"),
        (NeedleTask, {"depth": 1.5}, "depth"),
        (NeedleTask, {"depth": -0.1}, "depth"),
        (NeedleTask, {"value_digits": 0}, "value_digits"),
        (MultiKeyNeedleTask, {"num_needles": 0}, "num_needles"),
        (MultiKeyNeedleTask, {"num_needles": 17}, "num_needles"),
        (MultiKeyNeedleTask, {"num_needles": 11, "value_digits": 1}, "distinct values"),
    ],
)
def test_needle_tasks_reject_bad_parameters(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


# ------------------------------------------------------------------------------------------------ DataModule


def test_datamodule_builds_batches_on_the_tiny_tokenizer():
    data = NeedleDataModule(task_kwargs={"num_pairs": 12, "filler": 1}, num_train=16, num_val=4, batch_size=4)
    assert data.task == AssociativeRecallTask(num_pairs=12, filler=1)
    with pytest.raises(RuntimeError, match="setup"):
        data.num_context_tokens  # noqa: B018
    data.setup()
    stats = data.num_context_tokens
    assert 60 < stats["min"] <= stats["mean"] <= stats["max"] < 100
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape == batch["labels"].shape
    assert batch["input_ids"].shape[1] > stats["min"]
    tokenizer = data.tokenizer
    trained = [tokenizer.decode(row[row != -100]) for row in batch["labels"]]
    assert all(text.startswith("<answer>") and "</answer>" in text for text in trained)
    assert len(data.val_examples) == 4


def test_datamodule_context_tokens_grow_with_the_haystack():
    lengths = []
    for words in (20, 80):
        data = NeedleDataModule(task="needle", task_kwargs={"haystack_words": words}, num_train=4, num_val=2)
        data.setup()
        lengths.append(data.num_context_tokens["mean"])
    assert lengths[0] + 60 < lengths[1]


@pytest.mark.parametrize("task", ["arithmetic", None, "nope"])
def test_datamodule_rejects_other_tasks(task):
    with pytest.raises(ValueError, match="long-context task"):
        NeedleDataModule(task=task)


def test_datamodule_passes_bad_task_parameters_through_to_the_task():
    with pytest.raises(ValueError, match="num_needles"):
        NeedleDataModule(task="multikey_needle", task_kwargs={"num_needles": 0})


@pytest.mark.parametrize("cls", [NeedleTask, MultiKeyNeedleTask])
@pytest.mark.parametrize("words", [1, 60, 2500])  # 2500 > the corpus: it wraps around
def test_prose_filler_is_consecutive_corpus_text_with_exactly_the_requested_words(cls, words):
    corpus = " ".join(prose_sentences())
    for example in cls(haystack_words=words, filler="prose").generate(5, seed=1):
        meta = example.metadata
        assert meta["filler"] == "prose"
        context = example.prompt[: meta["context_chars"]]
        for start in sorted(meta["needle_char_starts"], reverse=True):  # cut every needle sentence out
            end = context.index(".", start) + 1
            context = context[:start] + context[end + 1 :]
        assert len(context.split()) == words
        assert not set(context.replace(".", " ").replace(",", " ").split()) & set(NEEDLE_KEYS)
        assert not any(character.isdigit() for character in context)
        if words == 60:  # one stretch of the corpus (cut at the last word), not templated sentences
            assert context.strip().rstrip(".").rstrip(",;:") in corpus + " " + corpus


def test_prose_corpus_and_filler_option():
    sentences = prose_sentences()
    assert len(sentences) > 80 and sum(len(s.split()) for s in sentences) > 1500
    text = " ".join(sentences).lower()
    assert "code" not in text.split() and not any(c.isdigit() for c in text)
    with pytest.raises(ValueError, match="filler"):
        NeedleTask(filler="lorem")
    with pytest.raises(ValueError, match="filler"):
        MultiKeyNeedleTask(filler="lorem")
