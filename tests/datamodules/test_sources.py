"""Real sources: local JSON/JSONL/Parquet, chat `messages`, column mapping, errors that point at the data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_llm.datamodules import DataSourceError, Example, PromptDataModule, load_records

ROWS = [
    {"question": "What is 1 + 1?", "response": "<answer>2</answer>", "gold": "2", "level": 1},
    {"question": "What is 2 + 2?", "response": "<answer>4</answer>", "gold": "4", "level": 2},
]
MAPPING = {"prompt": "question", "completion": "response", "answer": "gold"}
EXPECTED = [
    Example("What is 1 + 1?", "<answer>2</answer>", "2", {"level": 1}),
    Example("What is 2 + 2?", "<answer>4</answer>", "4", {"level": 2}),
]


def _jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _write(path: Path, rows) -> str:
    if path.suffix == ".jsonl":
        return _jsonl(path, [json.dumps(row) for row in rows])
    if path.suffix == ".json":
        path.write_text(json.dumps(rows), encoding="utf-8")
        return str(path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize("name", ["data.jsonl", "data.json", "data.parquet"])
def test_local_files_with_column_mapping(tmp_path, name):
    source = _write(tmp_path / name, ROWS)
    assert load_records(source, columns=MAPPING, required=("prompt", "completion", "answer")) == EXPECTED


def test_json_object_with_data_list(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"data": ROWS, "version": 1}))
    assert load_records(str(path), columns=MAPPING) == EXPECTED


def test_unmapped_fields_use_their_own_name_and_optional_ones_default_to_empty(tmp_path):
    source = _write(tmp_path / "data.jsonl", [{"prompt": "p", "id": 7}])
    assert load_records(source, required=("prompt",)) == [Example("p", "", "", {"id": 7})]


def test_messages_column_gives_last_user_prompt_and_final_assistant_completion(tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<answer>4</answer>"},
    ]
    source = _write(tmp_path / "chat.jsonl", [{"messages": chat, "answer": "4"}, {"messages": chat[:2]}])
    sft, prompt_only = load_records(source, required=("prompt",))
    assert sft == Example("What is 2 + 2?", "<answer>4</answer>", "4", {})
    assert prompt_only == Example("Hi", "", "", {})
    with pytest.raises(DataSourceError, match=r"chat\.jsonl, line 2: missing column 'completion'"):
        load_records(source)  # completion required: the second chat does not end with the assistant


def test_messages_column_can_be_renamed(tmp_path):
    source = _write(
        tmp_path / "chat.json",
        [{"conv": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}],
    )
    assert load_records(source, columns={"messages": "conv"}) == [Example("Q", "A", "", {})]


# ------------------------------------------------------------------------------------------------ errors


def test_missing_column_names_file_line_and_column(tmp_path):
    rows = [ROWS[0], {"question": "What is 3 + 3?", "gold": "6"}]
    source = _write(tmp_path / "data.jsonl", [*rows])
    with pytest.raises(DataSourceError) as error:
        load_records(source, columns=MAPPING)
    message = str(error.value)
    assert f"{source}, line 2" in message
    assert "missing column 'response'" in message and "'completion'" in message
    assert "['gold', 'question']" in message  # what the record does have


def test_line_numbers_count_blank_lines(tmp_path):
    source = _jsonl(tmp_path / "data.jsonl", [json.dumps(ROWS[0]), "", json.dumps({"question": "q"})])
    with pytest.raises(DataSourceError, match=r"data\.jsonl, line 3: missing column 'response'"):
        load_records(source, columns=MAPPING)


def test_malformed_json_line_names_file_and_line(tmp_path):
    source = _jsonl(tmp_path / "data.jsonl", [json.dumps(ROWS[0]), '{"question": "q", "response": }'])
    with pytest.raises(DataSourceError, match=r"data\.jsonl, line 2: malformed JSON \(.* at column 31\)"):
        load_records(source, columns=MAPPING)


def test_jsonl_line_that_is_not_an_object(tmp_path):
    source = _jsonl(tmp_path / "data.jsonl", ['["a", "b"]'])
    with pytest.raises(DataSourceError, match=r"line 1: expected a JSON object, got list"):
        load_records(source)


def test_malformed_json_file_names_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[\n  {"prompt": "p"},\n  {"prompt": }\n]')
    with pytest.raises(DataSourceError, match=r"data\.json, line 3: malformed JSON"):
        load_records(str(path))


def test_json_of_the_wrong_shape(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('{"rows": []}')
    with pytest.raises(DataSourceError, match="expected a JSON list"):
        load_records(str(path))


@pytest.mark.parametrize("name", ["data.jsonl", "data.json", "data.parquet"])
def test_empty_file(tmp_path, name):
    path = tmp_path / name
    if name == "data.parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    else:
        path.write_text("[]" if name == "data.json" else "\n\n")
    with pytest.raises(DataSourceError, match=rf"{name}: no records"):
        load_records(str(path))


def test_non_string_value_names_line_and_column(tmp_path):
    source = _write(tmp_path / "data.jsonl", [ROWS[0], {**ROWS[1], "gold": 4}])
    with pytest.raises(
        DataSourceError, match=r"data\.jsonl, line 2: column 'gold' must hold a string, got int 4"
    ):
        load_records(source, columns=MAPPING)


def test_parquet_errors_name_the_index(tmp_path):
    rows = [
        {"prompt": "p", "completion": "c", "answer": "a"},
        {"prompt": "q", "completion": None, "answer": None},
    ]
    source = _write(tmp_path / "data.parquet", rows)
    with pytest.raises(DataSourceError, match=r"data\.parquet, index 1: null in 'completion'"):
        load_records(source)
    # null in an optional column means "absent": Parquet and datasets write it for missing keys
    assert load_records(source, required=("prompt",))[1] == Example("q", "", "", {})


def test_bad_messages_column(tmp_path):
    source = _write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(DataSourceError, match=r"line 1: column 'messages' must be a list of"):
        load_records(source)
    source = _write(tmp_path / "chat2.jsonl", [{"messages": [{"role": "assistant", "content": "A"}]}])
    with pytest.raises(DataSourceError, match=r"line 1: column 'messages' has no user message"):
        load_records(source)


def test_missing_file_and_unknown_field(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        load_records(str(tmp_path / "nope.jsonl"))
    source = _write(tmp_path / "data.jsonl", ROWS)
    with pytest.raises(ValueError, match="unknown field"):
        load_records(source, columns={"question": "prompt"})


# ------------------------------------------------------------------------------------------------ datasets


def test_hub_names_go_to_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return [{"problem": "What is 1 + 1?", "solution": "2"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    records = load_records(
        "org/math", split="test", columns={"prompt": "problem", "answer": "solution"}, required=("prompt",)
    )
    assert calls == [("org/math", {"split": "test"})]
    assert records == [Example("What is 1 + 1?", "", "2", {})]


def test_hub_errors_name_the_dataset_split_and_index(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda path, split: [{"prompt": "p"}, {"text": "t"}])
    with pytest.raises(
        DataSourceError, match=r"org/math \(split 'train'\), index 1: missing column 'prompt'"
    ):
        load_records("org/math", required=("prompt",))


def test_save_to_disk_directory(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert load_records(str(tmp_path / "saved"), columns=MAPPING) == EXPECTED


# ------------------------------------------------------------------------------------------------ in a DataModule


def test_datamodule_holds_out_validation_prompts_from_a_single_file(tmp_path):
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(30)]
    rows += rows[:10]  # duplicates: a held-out prompt must not sneak back into training
    source = _write(tmp_path / "data.jsonl", rows)
    dm = PromptDataModule(task=None, source=source, num_train=100, num_val=5, batch_size=4)
    dm.setup("fit")
    train = [item["example"] for item in dm._train_data]
    val = [item["example"] for item in dm._val_data]
    assert len(val) == 5 and dm.task is None
    assert not {e.prompt for e in train} & {e.prompt for e in val}
    assert len(train) == sum(row["prompt"] not in {e.prompt for e in val} for row in rows)  # all the rest
    capped = PromptDataModule(task=None, source=source, num_train=10, num_val=5)
    capped.setup("fit")
    assert len(capped._train_data) == 10


def test_datamodule_val_split_comes_from_load_dataset(monkeypatch):
    import datasets

    splits = {
        "train": [{"q": f"Q{i}", "a": str(i)} for i in range(20)],
        "validation": [{"q": f"Q{i}", "a": str(i)} for i in range(15, 25)],
    }
    monkeypatch.setattr(datasets, "load_dataset", lambda path, split: splits[split])
    dm = PromptDataModule(
        task=None, source="org/qa", columns={"prompt": "q", "answer": "a"}, val_split="validation", num_val=10
    )
    dm.setup("fit")
    train = {item["example"].prompt for item in dm._train_data}
    val = {item["example"].prompt for item in dm._val_data}
    assert val == {f"Q{i}" for i in range(15, 25)}
    assert train == {f"Q{i}" for i in range(15)}  # Q15..Q19 are validation prompts


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task": "arithmetic", "source": "x.jsonl"}, "exactly one of `task` and `source`"),
        ({"task": None}, "exactly one of `task` and `source`"),
        ({"task": None, "source": "x.jsonl", "task_kwargs": {"digits": 3}}, "task_kwargs"),
        ({"columns": {"prompt": "q"}}, "only apply to a real source"),
        ({"task": None, "source": "x.jsonl", "val_split": "test"}, "single split"),
        ({"num_train": 0}, "num_train"),
        ({"batch_size": 0}, "batch_size"),
        ({"max_length": 1}, "max_length"),
        ({"task": "nope"}, "unknown task"),
        ({"task_kwargs": {"digits": 0}}, "digits"),
    ],
)
def test_datamodule_rejects_bad_arguments_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PromptDataModule(**kwargs)


def test_local_data_directory_goes_through_load_dataset_for_real(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")  # never the user's cache
    data = tmp_path / "qa"
    data.mkdir()
    _write(data / "train.jsonl", ROWS)
    _write(data / "test.jsonl", [{"question": "What is 5 + 5?", "response": "10"}])
    # datasets unifies the splits' columns, writing null for the ones test.jsonl lacks
    expected = Example("What is 5 + 5?", "10", "", {"level": None})
    assert load_records(str(data), split="test", columns=MAPPING) == [expected]
    assert (tmp_path / "hf_cache").is_dir()


def _dataset(n: int) -> list[int]:
    return list(range(n))


def test_epoch_sampler_draws_the_orders_of_a_seeded_shuffling_loader():
    """Pass k is the k-th order of ``StatefulDataLoader(shuffle=True, generator=manual_seed(seed))`` (the
    DataModules' loader before the EpochSampler): single-process orders are unchanged by it."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_llm.datamodules.sources import EpochSampler

    for n, seed in ((13, 0), (40, 3)):
        reference = StatefulDataLoader(
            _dataset(n), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed)
        )
        loader = StatefulDataLoader(_dataset(n), batch_size=4, sampler=EpochSampler(_dataset(n), seed=seed))
        expected = [torch.cat(list(reference)).tolist() for _ in range(4)]
        got = [torch.cat(list(loader)).tolist() for _ in range(4)]
        assert got == expected and len({tuple(order) for order in got}) == 4
        assert sorted(got[0]) == list(range(n))
    ordered = EpochSampler(_dataset(5), shuffle=False)
    assert list(ordered) == list(ordered) == [0, 1, 2, 3, 4]


def test_epoch_sampler_deals_one_processes_order_to_the_ranks():
    from lightning_llm.datamodules.sources import EpochSampler

    single = EpochSampler(_dataset(11), seed=1)
    ranks = [EpochSampler(_dataset(11), num_replicas=2, rank=r, seed=1) for r in (0, 1)]
    for _ in range(3):  # every pass: rank r takes order[r::2], the order padded to 12 with its first index
        order = list(single)
        padded = order + order[:1]
        assert [list(rank) for rank in ranks] == [padded[0::2], padded[1::2]]
        assert len(ranks[0]) == len(ranks[1]) == 6


def test_epoch_sampler_set_epoch_does_not_move_the_pass():
    from lightning_llm.datamodules.sources import EpochSampler

    a, b = EpochSampler(_dataset(9), seed=2), EpochSampler(_dataset(9), seed=2)
    first = list(a)
    b.set_epoch(5)
    assert list(b) == first and b.epoch == 5
    assert list(a) != first  # the next pass is the next order


def test_epoch_sampler_state_resumes_its_pass_and_the_passes_after_it():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_llm.datamodules.sources import EpochSampler

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(_dataset(10), batch_size=3, sampler=EpochSampler(_dataset(10), seed=4))

    straight = loader()
    list(straight)  # pass 0
    it = iter(straight)
    next(it), next(it)  # pass 1, two batches in
    state = straight.state_dict()
    rest = [batch.tolist() for batch in it] + [[batch.tolist() for batch in straight] for _ in range(2)]
    resumed = loader()
    resumed.load_state_dict(state)
    got = [batch.tolist() for batch in resumed] + [[batch.tolist() for batch in resumed] for _ in range(2)]
    assert got == rest
