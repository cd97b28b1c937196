"""Forecasting questions over a seeded, dated synthetic news corpus: the offline stand-in for OpenForecaster's data.

OpenForecaster (arXiv 2512.25070) turns news articles into questions about events that resolve later ("Who will
win …?"), answered from articles published well before the resolution date. Here a fictional world of events
(elections, prizes, takeovers; names made of random syllables, so nothing can be known from pre-training) is
reported by dated articles: an announcement naming the contenders, polls and rumours that favour the eventual
winner more often as the date approaches, and, after the resolution date, the result itself. A question is
answerable only as well as the articles it may read, and reading the late or post-resolution ones would be
leakage: :class:`~lightning_llm.datamodules.ForecastingDataModule` retrieves only from articles dated at least
``min_gap`` days before resolution.
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from lightning_llm.datamodules.tasks import Example, Task, register_task
from lightning_llm.datamodules.tasks.multihop_qa import unique_names
from lightning_llm.text import normalize_answer, parse_forecast
from lightning_llm.types import Doc

__all__ = ["FORECAST_INSTRUCTION", "ForecastingTask", "NewsDoc", "format_question"]

#: What every forecasting prompt asks for (OpenForecaster's output format).
FORECAST_INSTRUCTION = (
    "Give your best guess and the probability that it is correct, as "
    "<answer>your answer</answer><probability>a number between 0 and 1</probability>."
)

_START = dt.date(2030, 1, 1)


@dataclass(frozen=True)
class NewsDoc(Doc):
    """A dated article: :class:`~lightning_llm.envs.search.Doc` (``title``, ``text``) with its publication date."""

    date: dt.date


class _Kind(NamedTuple):
    """An event type: its topic phrase, the question, the background, the criteria and the article texts."""

    topic: str  # "{place}" / "{name}" formatted
    question: str  # "{topic}", "{date}"
    binary: str  # "{candidate}", "{topic}", "{date}"
    background: str  # "{topic}", "{date}"
    criteria: str  # "{topic}"
    announce: str  # "{topic}", "{contenders}"
    hint: tuple[str, ...]  # "{favourite}", "{topic}"
    result: str  # "{winner}", "{topic}"


_KINDS = (
    _Kind(
        topic="the {place} mayoral election",
        question="Who will win {topic} on {date}?",
        binary="Will {candidate} win {topic} on {date}?",
        background="{topic_cap} is held on {date}; the city's mayor serves four years.",
        criteria="Resolves to the name of the candidate the electoral board declares the winner of {topic}.",
        announce="The candidates in {topic} are {contenders}.",
        hint=("A poll puts {favourite} ahead in {topic}.", "{favourite} leads the latest survey of {topic}."),
        result="{winner} won {topic}.",
    ),
    _Kind(
        topic="the {place} prize for poetry",
        question="Who will receive {topic} on {date}?",
        binary="Will {candidate} receive {topic} on {date}?",
        background="{topic_cap} is awarded on {date} by a jury of five.",
        criteria="Resolves to the name of the nominee announced as the winner of {topic}.",
        announce="The nominees for {topic} are {contenders}.",
        hint=(
            "Critics see {favourite} as the favourite for {topic}.",
            "Bookmakers favour {favourite} for {topic}.",
        ),
        result="{winner} received {topic}.",
    ),
    _Kind(
        topic="the takeover of {place} Works",
        question="Which bidder will complete {topic} by {date}?",
        binary="Will {candidate} complete {topic} by {date}?",
        background="The board has set {date} as the deadline for {topic}.",
        criteria="Resolves to the name of the bidder that completes {topic}.",
        announce="The bidders in {topic} are {contenders}.",
        hint=(
            "Sources say {favourite} is close to winning {topic}.",
            "{favourite} raised its offer in {topic}.",
        ),
        result="{winner} completed {topic}.",
    ),
)


class _Event(NamedTuple):
    kind: _Kind
    topic: str
    contenders: tuple[str, ...]
    winner: str
    date: dt.date
    binary_candidate: str | None  # set for a yes/no question
    leaky: bool


class _World(NamedTuple):
    docs: list[NewsDoc]
    examples: list[Example]


def format_question(question: str, background: str, resolution_criteria: str, resolution_date: str) -> str:
    """The question block of a forecasting prompt (retrieved articles, if any, go before it)."""
    return (
        f"Question: {question}\nBackground: {background}\nResolution criteria: {resolution_criteria}\n"
        f"Resolution date: {resolution_date}\n{FORECAST_INSTRUCTION}"
    )


@register_task
@dataclass(frozen=True)
class ForecastingTask(Task):
    """Questions about future events of a fictional world, with a dated news corpus (:meth:`documents`).

    Each of ``num_events`` events (an election, a prize or a takeover; 3 contenders, resolution dates spread
    over 2030–2031) is reported by: an announcement naming the contenders (90–120 days before resolution);
    ``hints_per_phase`` articles favouring one contender 31–89 days before (the favourite is the winner with
    probability ``early_hint_accuracy``, otherwise another contender) and as many 1–29 days before (with
    ``late_hint_accuracy``); and the result, 1–5 days after. With the default 30-day gap only the early
    articles are retrievable, so the best forecast is uncertain by design; the late and result articles are
    there so that a leak would show.

    Every event gives one question: free-form ("Who will win …?", answer the winner's name) or, with
    probability ``binary_fraction``, binary ("Will X win …?", answer ``yes``/``no``, ``metadata["outcome"]``
    1/0, X the winner half of the time). ``leak_rate`` of the questions name the winner in their background:
    bad data on purpose, for the DataModule's leakage filter to catch.

    ``prompt`` is the question block (:func:`format_question`, no articles); ``metadata`` has ``question``,
    ``background``, ``resolution_criteria``, ``resolution_date`` (ISO), ``outcome`` (None for free-form) and
    ``event``. The reference completion answers the favourite of the last retrievable article with
    probability ``early_hint_accuracy``: a format demonstration, not the Bayes forecast. The verifier is exact
    match (SQuAD normalisation) of the parsed answer, 0 when unparsable.

    Args:
        num_events: Events (= distinct questions) in the world, 10 to 5000.
        seed: Seed of the world (not of the questions drawn from it: that is :meth:`generate`'s).
        hints_per_phase: Hint articles per event in each phase (early, late), 1 to 5.
        early_hint_accuracy: Probability that an early (≥ 31 days before) article favours the winner.
        late_hint_accuracy: The same for the late articles (1–29 days before).
        binary_fraction: Share of yes/no questions.
        leak_rate: Share of questions whose background names the answer.
    """

    name = "forecasting"

    num_events: int = 200
    seed: int = 0
    hints_per_phase: int = 2
    early_hint_accuracy: float = 0.6
    late_hint_accuracy: float = 0.9
    binary_fraction: float = 0.25
    leak_rate: float = 0.0

    def __post_init__(self) -> None:
        if not 10 <= self.num_events <= 5000:
            raise ValueError(f"forecasting: num_events must be in [10, 5000], got {self.num_events}")
        if not 1 <= self.hints_per_phase <= 5:
            raise ValueError(f"forecasting: hints_per_phase must be in [1, 5], got {self.hints_per_phase}")
        for name in ("early_hint_accuracy", "late_hint_accuracy", "binary_fraction", "leak_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"forecasting: {name} must be in [0, 1], got {getattr(self, name)}")

    def documents(self) -> list[NewsDoc]:
        """The news corpus, in date order."""
        return list(self._world.docs)

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        return [rng.choice(self._world.examples) for _ in range(n)]

    def score(self, completion: str, example: Example) -> float:

        parsed = parse_forecast(completion)
        return float(parsed is not None and normalize_answer(parsed[0]) == normalize_answer(example.answer))

    @cached_property
    def _world(self) -> _World:
        rng = random.Random(self.seed)
        names = unique_names(rng, 4 * self.num_events)
        places, people = names[: self.num_events], names[self.num_events :]
        docs: list[NewsDoc] = []
        examples = []
        for index, place in enumerate(places):
            event = self._event(rng, place, people)
            articles, favourite = self._articles(rng, event)
            docs += articles
            examples.append(self._example(event, index, favourite))
        docs.sort(key=lambda doc: doc.date)
        return _World(docs, examples)

    def _event(self, rng: random.Random, place: str, people: list[str]) -> _Event:
        kind = rng.choice(_KINDS)
        contenders = tuple(rng.sample(people, 3))
        winner = rng.choice(contenders)
        date = _START + dt.timedelta(days=120 + rng.randrange(730))
        candidate = None
        if rng.random() < self.binary_fraction:
            candidate = winner if rng.random() < 0.5 else rng.choice([c for c in contenders if c != winner])
        topic = kind.topic.format(place=place)
        return _Event(kind, topic, contenders, winner, date, candidate, rng.random() < self.leak_rate)

    def _articles(self, rng: random.Random, event: _Event) -> tuple[list[NewsDoc], str]:
        """The event's articles and the favourite of its last early (retrievable with a 30-day gap) one."""
        kind, topic = event.kind, event.topic
        title = topic[0].upper() + topic[1:]

        def dated(days_before: int) -> dt.date:
            return event.date - dt.timedelta(days=days_before)

        contenders = ", ".join(event.contenders[:-1]) + f" and {event.contenders[-1]}"
        announcement = kind.announce.format(topic=topic, contenders=contenders)
        docs = [NewsDoc(title, announcement, dated(rng.randint(90, 120)))]
        last_early: tuple[dt.date, str] | None = None
        phases = ((self.early_hint_accuracy, 31, 89), (self.late_hint_accuracy, 1, 29))
        for phase, (accuracy, low, high) in enumerate(phases):
            for _ in range(self.hints_per_phase):
                favourite = event.winner
                if rng.random() >= accuracy:
                    favourite = rng.choice([c for c in event.contenders if c != event.winner])
                text = rng.choice(kind.hint).format(favourite=favourite, topic=topic)
                docs.append(NewsDoc(title, text, dated(rng.randint(low, high))))
                if phase == 0 and (last_early is None or docs[-1].date > last_early[0]):
                    last_early = (docs[-1].date, favourite)
        result = kind.result.format(winner=event.winner, topic=topic)
        docs.append(NewsDoc(title, result, dated(-rng.randint(1, 5))))
        assert last_early is not None  # hints_per_phase >= 1
        return docs, last_early[1]

    def _example(self, event: _Event, index: int, favourite: str) -> Example:
        kind, topic, date = event.kind, event.topic, event.date.isoformat()
        if event.binary_candidate is None:
            question = kind.question.format(topic=topic, date=date)
            answer, outcome = event.winner, None
        else:
            question = kind.binary.format(candidate=event.binary_candidate, topic=topic, date=date)
            outcome = int(event.binary_candidate == event.winner)
            answer = "yes" if outcome else "no"
        background = kind.background.format(topic=topic, topic_cap=topic[0].upper() + topic[1:], date=date)
        if event.leaky:
            background += f" Insiders expect {event.winner} to come out on top."
        criteria = kind.criteria.format(topic=topic)
        # The reference forecast: the favourite of the last article a 30-day gap allows (the early phase).
        if event.binary_candidate is None:
            guess = favourite
        else:
            guess = "yes" if favourite == event.binary_candidate else "no"
        completion = f"<answer>{guess}</answer><probability>{self.early_hint_accuracy:.2f}</probability>"
        return Example(
            prompt=format_question(question, background, criteria, date),
            completion=completion,
            answer=answer,
            metadata={
                "task": self.name,
                "question": question,
                "background": background,
                "resolution_criteria": criteria,
                "resolution_date": date,
                "outcome": outcome,
                "event": index,
                "seed": self.seed,
            },
        )
