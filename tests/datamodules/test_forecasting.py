"""ForecastingDataModule: leakage filter, date-restricted retrieval, seeded chunk sampling, file sources."""

import datetime as dt
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_llm.datamodules import DataSourceError, ForecastingDataModule, get_task
from lightning_llm.datamodules.forecasting import (
    DatedRetriever,
    answer_leaks,
    cutoff_date,
    load_forecast_questions,
    load_news_corpus,
)
from lightning_llm.datamodules.tasks import Example
from lightning_llm.datamodules.tasks.forecasting import NewsDoc

BASE = dt.date(2030, 1, 1)
# A fixed corpus: every document matches the query; dates spread over 400 days.
DOCS = [
    NewsDoc(f"Velo news {i}", f"Velo election poll number {i}", BASE + dt.timedelta(days=i * 7))
    for i in range(60)
]
RETRIEVER = DatedRetriever(DOCS)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 500), st.integers(0, 120), st.integers(1, 10))
def test_retrieval_never_returns_a_document_after_the_cutoff(resolution_offset, min_gap, k):
    resolution = BASE + dt.timedelta(days=resolution_offset)
    cutoff = cutoff_date(resolution.isoformat(), min_gap)
    found = RETRIEVER.search("Velo election poll", k, cutoff)
    assert all(doc.date <= cutoff for doc in found)
    assert all((resolution - doc.date).days >= min_gap for doc in found)
    allowed = sum(doc.date <= cutoff for doc in DOCS)
    assert len(found) == min(k, allowed)  # the filter is applied before the top k is taken


def test_synthetic_task_is_seeded_and_has_post_resolution_articles():
    task = get_task("forecasting", num_events=20)
    assert task.documents() == get_task("forecasting", num_events=20).documents()
    assert task.generate(5, seed=1) == task.generate(5, seed=1)
    example = task.generate(1, seed=0)[0]
    date = dt.date.fromisoformat(example.metadata["resolution_date"])
    titles = {doc.title for doc in task.documents() if doc.date > date}
    assert titles  # the result articles exist, so a leak would show
    assert task.score(f"<answer>{example.answer}</answer><probability>0.5</probability>", example) == 1.0
    assert task.score("nothing", example) == 0.0
    with pytest.raises(ValueError, match="leak_rate"):
        get_task("forecasting", leak_rate=2.0)


def test_answer_leaks():
    meta = {"question": "Who will win?", "background": "Tamur and Velo run.", "resolution_criteria": ""}
    assert answer_leaks(Example("", "", "tamur", meta))
    assert not answer_leaks(Example("", "", "Tam", meta))  # whole words only
    assert not answer_leaks(Example("", "", "yes", {**meta, "background": "yes", "outcome": 1}))


@pytest.fixture(scope="module")
def module(tiny_backbone):
    dm = ForecastingDataModule(
        task_kwargs={"num_events": 60, "leak_rate": 0.2}, num_train=40, num_val=8, batch_size=4, max_chunks=3
    )
    with pytest.warns(UserWarning, match="leakage filter dropped"):
        dm.setup()
    return dm


def test_leakage_filter_drops_and_counts(module):
    assert module.leaked > 0
    assert not any(answer_leaks(item["example"]) for item in module._val_data)
    assert not any(answer_leaks(example) for example in module._train_data.examples)


def test_prompts_show_only_articles_before_the_cutoff(module):
    data = module._train_data
    counts = set()
    for epoch in range(3):
        for i in range(len(data)):
            example = data[epoch * len(data) + i]["example"]
            cutoff = cutoff_date(example.metadata["resolution_date"], 30)
            retrieved = example.metadata["retrieved"]
            counts.add(len(retrieved))
            assert all(dt.date.fromisoformat(date) <= cutoff for date, _ in retrieved)
            assert example.metadata["question"] in example.prompt
    assert counts == {0, 1, 2, 3}  # 0..k chunks
    for item in module._val_data:
        assert len(item["example"].metadata["retrieved"]) <= 3


def test_chunk_draws_are_seeded_by_question_and_epoch(module):
    data = module._train_data
    n = len(data)
    assert data[3]["prompt"] == data[3]["prompt"]
    draws = [[data[epoch * n + i]["example"].metadata["retrieved"] for i in range(n)] for epoch in range(2)]
    assert draws[0] != draws[1]  # a new draw each epoch


def test_dataloader_batches_and_epoch_sampler(module):
    loader = module.train_dataloader()
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "attention_mask", "prompt", "example"}
    assert batch["input_ids"].shape[0] == 4
    assert batch["input_ids"].shape[1] <= module.hparams.max_length
    first = list(loader.sampler)
    loader.sampler.set_epoch(1)
    second = list(loader.sampler)
    assert all(index >= len(module._train_data) for index in second) and sorted(first) != sorted(second)


def test_file_source_and_errors(tmp_path, tiny_backbone):
    rows = [
        {
            "q": f"Who will win race {i}?",
            "answer": f"Runner{i}",
            "resolution_date": "2031-06-01",
            "background": "",
        }
        for i in range(6)
    ]
    rows.append(
        {"q": "Who will win race X?", "answer": "Zed", "resolution_date": "2031-06-01", "background": "Zed"}
    )
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    corpus = tmp_path / "news.jsonl"
    corpus.write_text(
        json.dumps({"title": "race", "text": "Runner1 leads the race", "date": "2031-01-01"})
        + "\n"
        + json.dumps({"title": "race", "text": "Runner1 won the race", "date": "2031-06-02"})
    )
    dm = ForecastingDataModule(
        task=None, source=str(path), columns={"question": "q"}, corpus=str(corpus), num_val=2
    )
    with pytest.warns(UserWarning, match="dropped 1 of 7"):
        dm.setup()
    texts = [item["example"].prompt for item in dm._val_data] + [ex.prompt for ex in dm._train_data.examples]
    assert not any("won the race" in text for text in texts)

    examples = load_forecast_questions(str(path), {"question": "q"})
    assert examples[0].metadata["resolution_date"] == "2031-06-01" and examples[0].metadata["outcome"] is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps({**rows[1], "resolution_date": "June"}))
    with pytest.raises(DataSourceError, match=r"bad.jsonl, line 3: column 'resolution_date'"):
        load_forecast_questions(str(bad), {"question": "q"})
    with pytest.raises(DataSourceError, match=r"line 1: missing column 'question'"):
        load_forecast_questions(str(path))
    bad.write_text(json.dumps({"title": "t", "text": "x"}))
    with pytest.raises(DataSourceError, match=r"line 1: missing column 'date'"):
        load_news_corpus(bad)


def test_constructor_errors():
    with pytest.raises(ValueError, match="min_gap_days"):
        ForecastingDataModule(min_gap_days=-1)
    with pytest.raises(ValueError, match="corpus"):
        ForecastingDataModule(corpus="news.jsonl")
    with pytest.raises(ValueError, match="unknown field"):
        ForecastingDataModule(task=None, source="q.jsonl", columns={"prompt": "x"})
