"""Forecasting prompts with leakage-free retrieval (OpenForecaster, arXiv 2512.25070; docs/methods.md §4).

A forecasting question (question, background, resolution criteria, answer, resolution date; optionally a binary
outcome) is shown with news articles retrieved by BM25, but only from articles dated at least ``min_gap_days``
before the resolution date, so that no prompt can contain the outcome or its last-minute tell-tales. Questions
whose answer is already written in the question, background or criteria are dropped (the leakage filter).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_llm.datamodules.prompt import PromptDataModule
from lightning_llm.datamodules.sources import DataSourceError, _read, read_text_records, render_prompt
from lightning_llm.datamodules.tasks.forecasting import NewsDoc, format_question
from lightning_llm.envs.search import BM25Retriever
from lightning_llm.text import normalize_answer
from lightning_llm.types import Example

__all__ = [
    "QUESTION_FIELDS",
    "DatedRetriever",
    "ForecastingDataModule",
    "answer_leaks",
    "load_forecast_questions",
    "load_news_corpus",
]

#: Fields of a forecasting question; ``outcome`` (0/1, binary questions) is optional.
QUESTION_FIELDS = ("question", "background", "resolution_criteria", "answer", "resolution_date", "outcome")


def _parse_date(value: Any, where: str, column: str) -> dt.date:
    if isinstance(value, dt.datetime):
        return value.date()
    if isinstance(value, dt.date):
        return value
    if isinstance(value, str):
        try:
            return dt.date.fromisoformat(value)
        except ValueError:
            try:
                return dt.datetime.fromisoformat(value).date()
            except ValueError:
                pass
    raise DataSourceError(f"{where}: column {column!r} must hold an ISO date (YYYY-MM-DD), got {value!r}")


def load_forecast_questions(source: str, columns: Mapping[str, str] | None = None) -> list[Example]:
    """Forecasting questions from a local ``.json``/``.jsonl``/``.parquet`` file (or a ``datasets`` source).

    Args:
        source: The file (read by the machinery of :mod:`lightning_llm.datamodules.sources`).
        columns: Maps our fields (:data:`QUESTION_FIELDS`) to the source's columns; unmapped fields are looked
            up under their own name. ``background`` and ``resolution_criteria`` may be missing (``""``),
            ``outcome`` may be missing or null (a free-form question); the others are required.

    Returns examples shaped like :class:`~lightning_llm.datamodules.tasks.forecasting.ForecastingTask`'s: the
    prompt is the question block, the metadata holds every field (``resolution_date`` as an ISO string) and
    the source's other columns. Bad records raise :class:`DataSourceError` naming the file, line or index, and
    column.
    """
    mapping = dict(columns or {})
    unknown = sorted(set(mapping) - set(QUESTION_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; fields are {list(QUESTION_FIELDS)}")
    names = {name: mapping.get(name, name) for name in QUESTION_FIELDS}
    examples = []
    for where, record in _read(source, "train"):
        values: dict[str, Any] = {}
        for name in ("question", "background", "resolution_criteria", "answer"):
            column, value = names[name], record.get(names[name])
            if value is None and name in ("background", "resolution_criteria"):
                value = ""
            if not isinstance(value, str) or (name in ("question", "answer") and not value.strip()):
                problem = "missing column" if column not in record else f"{type(value).__name__} in column"
                raise DataSourceError(
                    f"{where}: {problem} {column!r} (field {name!r}, a non-empty string); the record has "
                    f"columns {sorted(record)}"
                )
            values[name] = value.strip()
        column = names["resolution_date"]
        if record.get(column) is None:
            raise DataSourceError(
                f"{where}: missing column {column!r}; the record has columns {sorted(record)}"
            )
        date = _parse_date(record[column], where, column).isoformat()
        outcome = record.get(names["outcome"])
        if outcome is not None and outcome not in (0, 1, True, False):
            raise DataSourceError(
                f"{where}: column {names['outcome']!r} must be 0, 1 or null, got {outcome!r}"
            )
        consumed = {names[name] for name in QUESTION_FIELDS}
        metadata = {key: value for key, value in record.items() if key not in consumed}
        metadata.update(values, resolution_date=date, outcome=None if outcome is None else int(outcome))
        del metadata["answer"]
        prompt = format_question(
            values["question"], values["background"], values["resolution_criteria"], date
        )
        examples.append(Example(prompt=prompt, completion="", answer=values["answer"], metadata=metadata))
    if not examples:
        raise DataSourceError(f"{source}: no questions (empty file)")
    return examples


def load_news_corpus(path: str | Path) -> list[NewsDoc]:
    """Dated articles from a JSONL file, one ``{"title": str, "text": str, "date": "YYYY-MM-DD"}`` per line."""
    schema = "{'title': str, 'text': str, 'date': 'YYYY-MM-DD'}"
    docs = []
    for where, record, values in read_text_records(path, ("title", "text"), schema):
        if "date" not in record:
            raise DataSourceError(f"{where}: missing column 'date'; the record has columns {sorted(record)}")
        docs.append(NewsDoc(*values, date=_parse_date(record["date"], where, "date")))
    return docs


def answer_leaks(example: Example) -> bool:
    """Whether the answer occurs (normalised, case-insensitive, as whole words) in the question, background or
    resolution criteria. Binary questions (answer yes/no) never leak by their answer string."""
    if example.metadata.get("outcome") is not None:
        return False
    answer = normalize_answer(example.answer)
    if not answer:
        return False
    fields = (example.metadata.get(name, "") for name in ("question", "background", "resolution_criteria"))
    return any(f" {answer} " in f" {normalize_answer(text)} " for text in fields)


def _chunks(docs: Sequence[NewsDoc], words: int | None) -> list[NewsDoc]:
    """Each document cut into consecutive pieces of at most ``words`` words (same title and date)."""
    if words is None:
        return list(docs)
    out = []
    for doc in docs:
        tokens = doc.text.split()
        for start in range(0, max(len(tokens), 1), words):
            out.append(replace(doc, text=" ".join(tokens[start : start + words])))
    return out


class DatedRetriever:
    """BM25 over dated documents that only ever returns documents dated on or before a cutoff.

    The filter is applied to the full BM25 ranking (every document sharing a query token), before the top
    ``k`` are taken: restricting the corpus never leaves a question with fewer documents than it could have.
    """

    def __init__(self, docs: Sequence[NewsDoc]) -> None:
        self.docs = list(docs)
        self._bm25 = BM25Retriever(self.docs)

    def search(self, query: str, k: int, cutoff: dt.date) -> list[NewsDoc]:
        """The at most ``k`` best documents for ``query`` dated ``<= cutoff``, best first."""
        if k < 1:
            return []
        ranked = self._bm25.search(query, len(self.docs))
        return [doc for doc in ranked if doc.date <= cutoff][:k]  # type: ignore[union-attr]


def cutoff_date(resolution_date: str | dt.date, min_gap_days: int) -> dt.date:
    """The last publication date a question resolving on ``resolution_date`` may read."""
    if isinstance(resolution_date, str):
        resolution_date = dt.date.fromisoformat(resolution_date)
    return resolution_date - dt.timedelta(days=min_gap_days)


def _draw_seed(seed: int, index: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"{seed}/forecast/{index}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def render_forecast_prompt(example: Example, docs: Sequence[NewsDoc]) -> str:
    """The user message: the retrieved articles (dated, best first), then the question block."""
    if not docs:
        return example.prompt
    articles = "\n".join(f"[{doc.date.isoformat()}] {doc.title}: {doc.text}" for doc in docs)
    return f"Articles:\n{articles}\n{example.prompt}"


@dataclass(frozen=True)
class _Renderer:
    """Renders and tokenizes a question with its articles (picklable, for DataLoader workers)."""

    tokenizer: Any
    system_prompt: str | None
    max_length: int

    def ids(self, text: str) -> list[int]:
        return self.tokenizer([text], add_special_tokens=False)["input_ids"][0]

    def item(self, example: Example, docs: Sequence[NewsDoc]) -> dict[str, Any]:
        """The dataset item of ``example`` shown with ``docs``, dropping the last ones until it fits."""
        docs = list(docs)
        while True:
            text = render_prompt(self.tokenizer, render_forecast_prompt(example, docs), self.system_prompt)
            ids = self.ids(text)
            if len(ids) <= self.max_length or not docs:
                break
            docs.pop()
        shown = replace(
            example,
            prompt=render_forecast_prompt(example, docs),
            metadata={**example.metadata, "retrieved": [(doc.date.isoformat(), doc.title) for doc in docs]},
        )
        return {"input_ids": torch.tensor(ids), "prompt": text, "example": shown}


class _ForecastItems(Dataset):
    """Training items built on access: index ``epoch * N + i`` is question ``i`` with its epoch's articles."""

    def __init__(
        self, renderer: _Renderer, examples: list[Example], pools: list[list[NewsDoc]], seed: int, k: int
    ) -> None:
        self.renderer, self.examples, self.pools, self.seed, self.k = renderer, examples, pools, seed, k

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        epoch, i = divmod(index, len(self.examples))
        rng = random.Random(_draw_seed(self.seed, i, epoch))
        pool = self.pools[i]
        count = rng.randint(0, min(self.k, len(pool)))
        picked = sorted(rng.sample(range(len(pool)), count))
        return self.renderer.item(self.examples[i], [pool[j] for j in picked])


class _EpochSampler(DistributedSampler):
    """A (distributed) shuffling sampler whose indices carry the epoch, ``epoch * N + i``, so that the articles
    drawn for a question are a function of the seed, the question and the epoch: reproducible and resumable.
    A ``DistributedSampler``, so Lightning keeps it under DDP instead of replacing it."""

    def __iter__(self) -> Iterator[int]:
        offset = self.epoch * len(self.dataset)
        return (offset + i for i in super().__iter__())


class ForecastingDataModule(PromptDataModule):
    r"""OpenForecaster's training data: forecasting questions with date-restricted BM25 retrieval.

    Questions come from the synthetic ``forecasting`` task (default; its dated news corpus is the retrieval
    corpus) or from a local file (``source``, with ``columns`` mapping :data:`QUESTION_FIELDS`; a ``corpus``
    JSONL of dated articles is then optional). Every question first passes the **leakage filter**: a
    free-form question whose answer occurs in its question, background or resolution criteria
    (:func:`answer_leaks`) is dropped, and the count is warned about.

    **Retrieval**: the question text is the BM25 query, over the corpus cut into ``chunk_words``-word chunks,
    restricted to chunks dated :math:`\le` resolution date − ``min_gap_days`` (paper: one month). During
    training each question shows :math:`n \sim U\{0, \dots, k\}` of its top-``max_chunks`` chunks (``k =
    max_chunks``, paper: 0–5), a random subset in ranking order, drawn from a seed of (``seed``, question,
    epoch), so a run and its resume see the same prompts; validation shows the top ``val_chunks``. Articles
    that would push a prompt past ``max_length`` tokens are dropped, lowest-ranked first; questions whose
    prompt alone does not fit are dropped (warned).

    Batch: as :class:`PromptDataModule` (``input_ids``, ``attention_mask``, ``prompt``, ``example``); the
    examples carry the user message with its articles as ``prompt``, the gold ``answer`` and the question's
    metadata plus ``retrieved`` (the chunks' ``(date, title)``), which the ``forecasting`` rewards read.

    Args:
        task: The synthetic task (``"forecasting"``), or None with ``source``.
        task_kwargs: Its parameters (``num_events``, ``early_hint_accuracy``, ``leak_rate``...).
        source: A local ``.json``/``.jsonl``/``.parquet`` file of questions (see :func:`load_forecast_questions`).
        columns: Maps :data:`QUESTION_FIELDS` to the source's columns.
        corpus: JSONL of dated articles for a ``source`` (see :func:`load_news_corpus`); None: no retrieval.
        min_gap_days: Retrieval cutoff: only articles at least this many days older than the resolution date.
        max_chunks: ``k``, the most articles a training prompt shows (0 disables retrieval).
        val_chunks: Articles every validation prompt shows (default ``max_chunks``).
        chunk_words: Words per retrieved chunk (None: whole documents; the synthetic articles are one sentence).
        **kwargs: The other arguments of :class:`~lightning_llm.datamodules.sources.ExampleDataModule`.
    """

    _required = ("prompt", "answer")

    def __init__(
        self,
        *,
        task: str | None = "forecasting",
        source: str | None = None,
        columns: dict[str, str] | None = None,
        corpus: str | None = None,
        min_gap_days: int = 30,
        max_chunks: int = 5,
        val_chunks: int | None = None,
        chunk_words: int | None = 200,
        max_length: int = 512,
        **kwargs: Any,
    ) -> None:
        if min_gap_days < 0 or max_chunks < 0 or (val_chunks is not None and val_chunks < 0):
            raise ValueError(
                f"need min_gap_days, max_chunks and val_chunks >= 0, got {min_gap_days}, {max_chunks}, {val_chunks}"
            )
        if chunk_words is not None and chunk_words < 1:
            raise ValueError(f"chunk_words must be >= 1 (or None), got {chunk_words}")
        if corpus is not None and source is None:
            raise ValueError("`corpus` applies to a `source`; the synthetic task brings its own news corpus")
        if source is not None and Path(source).suffix.lower() not in (".json", ".jsonl", ".parquet"):
            raise ValueError(
                f"{source}: forecasting questions come from a local .json, .jsonl or .parquet file"
            )
        # The base maps `columns` onto its own fields; ours are the question fields, handled here.
        super().__init__(task=task, source=source, max_length=max_length, **kwargs)
        unknown = sorted(set(columns or {}) - set(QUESTION_FIELDS))
        if unknown:
            raise ValueError(f"unknown field(s) {unknown} in columns; fields are {list(QUESTION_FIELDS)}")
        self.hparams["columns"] = columns
        self.leaked = 0  #: questions dropped by the leakage filter (set by setup)
        self._retriever: DatedRetriever | None = None

    @property
    def val_chunk_count(self) -> int:
        hp = self.hparams
        return hp.max_chunks if hp.val_chunks is None else hp.val_chunks

    @property
    def retriever(self) -> DatedRetriever | None:
        """The date-restricted BM25 index (None without a corpus); built by :meth:`setup`."""
        return self._retriever

    def retrieve(self, example: Example, k: int) -> list[NewsDoc]:
        """The top ``k`` chunks for ``example``'s question that its cutoff allows (built by :meth:`setup`)."""
        if self._retriever is None or k < 1:
            return []
        cutoff = cutoff_date(example.metadata["resolution_date"], self.hparams.min_gap_days)
        return self._retriever.search(example.metadata["question"], k, cutoff)

    def _examples(self) -> tuple[list[Example], list[Example]]:
        hp = self.hparams
        if self._task is not None:
            train, val = super()._examples()
        else:
            records = load_forecast_questions(hp.source, hp.columns)
            random.Random(hp.seed).shuffle(records)
            val, train = records[: hp.num_val], records[hp.num_val :][: hp.num_train]
        kept_train = [example for example in train if not answer_leaks(example)]
        kept_val = [example for example in val if not answer_leaks(example)]
        self.leaked = len(train) + len(val) - len(kept_train) - len(kept_val)
        if self.leaked:
            rank_zero_warn(
                f"{type(self).__name__}: leakage filter dropped {self.leaked} of {len(train) + len(val)} questions "
                "whose answer occurs in the question, background or resolution criteria"
            )
        if not kept_train:
            raise DataSourceError("no training questions left after the leakage filter")
        return kept_train, kept_val

    def _corpus(self) -> list[NewsDoc]:
        if self._task is not None:
            return self._task.documents()  # type: ignore[attr-defined]
        return load_news_corpus(self.hparams.corpus) if self.hparams.corpus is not None else []

    def _build(self, train: list[Example], val: list[Example]) -> tuple[list[Any], list[Any]]:
        hp = self.hparams
        chunks = _chunks(self._corpus(), hp.chunk_words)
        self._retriever = DatedRetriever(chunks) if chunks else None
        renderer = _Renderer(self.tokenizer, self.system_prompt, hp.max_length)
        kept_train = [
            ex for ex in train if len(renderer.ids(self._render_prompt(ex.prompt))) <= hp.max_length
        ]
        kept_val = [ex for ex in val if len(renderer.ids(self._render_prompt(ex.prompt))) <= hp.max_length]
        dropped = len(train) + len(val) - len(kept_train) - len(kept_val)
        if dropped:
            rank_zero_warn(
                f"{type(self).__name__}: dropped {dropped} of {len(train) + len(val)} questions whose prompt alone "
                f"is longer than max_length={hp.max_length} tokens"
            )
        if not kept_train:
            raise ValueError(f"no training question fits in max_length={hp.max_length} tokens")
        self._val_examples = kept_val
        pools = [self.retrieve(example, hp.max_chunks) for example in kept_train]
        val_items = [
            renderer.item(example, self.retrieve(example, self.val_chunk_count)) for example in kept_val
        ]
        train_items = _ForecastItems(renderer, kept_train, pools, hp.seed, hp.max_chunks)
        return train_items, val_items  # type: ignore[return-value]

    def train_dataloader(self) -> StatefulDataLoader:
        data = self._built(self._train_data)
        trainer = self.trainer
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = _EpochSampler(
            data, num_replicas=replicas, rank=rank, shuffle=self.hparams.shuffle, seed=self.hparams.seed
        )
        return StatefulDataLoader(
            data,
            batch_size=self.hparams.batch_size,
            sampler=sampler,
            collate_fn=self._collator(),
            num_workers=self.hparams.num_workers,
        )
