"""A small fixed corpus of multi-turn chats, shipped as package data (``assets/chat_corpus.jsonl``).

What it is for: harvesting an instruct model's residual stream on *conversations* (several user and assistant
turns in the chat template, so the template's special tokens recur inside a sequence and not only at its start)
without generating them with the model, which cost 8 CPU-minutes for a few hundred on SmolLM2-135M.

How it was made: :func:`make_chat_corpus` writes every conversation from templates, with no model and no
external data. A seeded ``random.Random`` picks one of eight topics (cooking, travel, arithmetic, unit
conversion, programming, word meanings, scheduling, gardening), the slot values of that topic's opening
question and answer (the numbers in the arithmetic, conversion and scheduling answers are computed, so they are
right), then one to three follow-up exchanges from the topic's own follow-ups and a shared pool ("Thanks! Can
you make that shorter?"...), and, for a quarter of the conversations, a system message. The shipped file is
``make_chat_corpus()`` (300 conversations, seed 0) written by :func:`write_chat_corpus`; a test checks that the
file still equals the generator's output, so the corpus is reproducible from this module alone.

Each line of the file is ``{"id": int, "topic": str, "messages": [{"role", "content"}, ...]}`` with alternating
``user`` / ``assistant`` turns (after an optional ``system`` message), ending with the assistant. Render a
conversation with ``tokenizer.apply_chat_template(messages, tokenize=False)``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["CHAT_CORPUS_ASSET", "load_chat_corpus", "make_chat_corpus", "write_chat_corpus"]

#: The shipped corpus, relative to the ``lightning_llm`` package.
CHAT_CORPUS_ASSET = "assets/chat_corpus.jsonl"

Message = dict[str, str]
Exchange = tuple[str, str]

_SYSTEMS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in a few sentences.",
    "You are a friendly tutor who explains things step by step.",
    "You are an assistant for a small online shop. Be polite and brief.",
)
_SHARED_FOLLOW_UPS: tuple[Exchange, ...] = (
    ("Thanks! Can you make that shorter?", "Sure. In short: {short}"),
    ("Could you say that again in one sentence?", "{short}"),
    ("Great, that helps. Anything I should avoid?", "Mainly avoid rushing it. {short}"),
    ("Why is that?", "Because it keeps things simple and predictable. {short}"),
    ("OK. Is there a common mistake people make here?", "Yes: skipping the check at the end. {short}"),
)


def _cooking(rng: random.Random) -> tuple[list[Exchange], str]:
    dish, minutes, tip = rng.choice(
        [
            ("soft-boiled eggs", 6, "cool them in cold water right away"),
            ("hard-boiled eggs", 10, "start them in boiling water so they peel easily"),
            ("white rice", 18, "let it rest covered for five minutes after cooking"),
            ("pasta", 9, "salt the water well before adding the pasta"),
            ("roast potatoes", 45, "dry them well before they go in the oven"),
            ("a vegetable soup", 30, "add the leafy greens only at the end"),
            ("pancakes", 4, "wait for bubbles on top before flipping"),
            ("steamed broccoli", 5, "take it off while it is still bright green"),
        ]
    )
    people = rng.randint(2, 6)
    opening = (
        f"How long should I cook {dish}?",
        f"About {minutes} minutes is a good starting point for {dish}. A useful tip: {tip}.",
    )
    follow = (
        f"I am cooking for {people} people. Do I need to change the time?",
        f"For {people} people the time stays about {minutes} minutes; use a larger pot or tray so nothing "
        "is crowded, and check a little before the end.",
    )
    return [opening, follow], f"Cook {dish} for about {minutes} minutes and {tip}."


def _travel(rng: random.Random) -> tuple[list[Exchange], str]:
    city, month, weather = rng.choice(
        [
            ("Lisbon", "April", "mild and sometimes rainy"),
            ("Oslo", "January", "cold, dark and snowy"),
            ("Rome", "August", "hot and dry"),
            ("Tokyo", "June", "warm and humid, with frequent rain"),
            ("Edinburgh", "October", "cool and windy"),
            ("Cairo", "March", "warm during the day and cooler at night"),
            ("Vancouver", "November", "wet and cool"),
            ("Madrid", "December", "cold in the mornings and sunny"),
        ]
    )
    days = rng.randint(2, 10)
    opening = (
        f"I am visiting {city} in {month} for {days} days. What should I pack?",
        f"{city} in {month} is usually {weather}. Pack layers you can combine, comfortable walking shoes, "
        "and a small bag for day trips.",
    )
    follow = (
        "Should I bring an umbrella?",
        f"Yes, a small folding umbrella is worth it for {days} days in {city}; it takes little space.",
    )
    return [opening, follow], f"Expect weather that is {weather}, and pack layers."


def _arithmetic(rng: random.Random) -> tuple[list[Exchange], str]:
    item, price = rng.choice([("notebooks", 3), ("pens", 2), ("apples", 1), ("tickets", 12), ("mugs", 7)])
    count, extra = rng.randint(3, 19), rng.randint(2, 9)
    total = count * price
    opening = (
        f"If {item} cost {price} dollars each, how much do {count} of them cost?",
        f"{count} times {price} is {total}, so {count} {item} cost {total} dollars.",
    )
    follow = (
        f"And if I buy {extra} more?",
        f"Then you buy {count + extra} {item}, which cost {(count + extra) * price} dollars in total.",
    )
    return [opening, follow], f"The total is {total} dollars."


def _conversion(rng: random.Random) -> tuple[list[Exchange], str]:
    kind = rng.choice(["km", "kg", "celsius", "minutes"])
    value = rng.randint(2, 95)
    if kind == "km":
        question, answer = (
            f"How many miles is {value} kilometres?",
            f"{value} km is about {value * 0.621:.1f} miles.",
        )
    elif kind == "kg":
        question, answer = (
            f"What is {value} kilograms in pounds?",
            f"{value} kg is about {value * 2.205:.1f} pounds.",
        )
    elif kind == "celsius":
        question = f"Convert {value} degrees Celsius to Fahrenheit, please."
        answer = f"{value} degrees Celsius is {value * 9 / 5 + 32:.1f} degrees Fahrenheit."
    else:
        minutes = value * 7
        question = f"How many hours and minutes are {minutes} minutes?"
        answer = f"{minutes} minutes is {minutes // 60} hours and {minutes % 60} minutes."
    follow = (
        "How did you work that out?",
        "I multiplied by the conversion factor and rounded to one decimal.",
    )
    if kind == "minutes":
        follow = (
            "How did you work that out?",
            "I divided by 60: the quotient is the hours, the rest the minutes.",
        )
    return [(question, answer), follow], answer


def _programming(rng: random.Random) -> tuple[list[Exchange], str]:
    language, task, code = rng.choice(
        [
            ("Python", "reverse a list", "my_list[::-1] returns a reversed copy"),
            ("Python", "read a file line by line", "for line in open(path): handles one line at a time"),
            ("JavaScript", "remove duplicates from an array", "[...new Set(array)] keeps the first copies"),
            ("Python", "count words in a string", "len(text.split()) counts words separated by spaces"),
            ("SQL", "count the rows of a table", "SELECT COUNT(*) FROM table_name; returns the count"),
            ("JavaScript", "sort numbers in an array", "array.sort((a, b) => a - b) sorts them numerically"),
            ("Bash", "list files by size", "ls -lS lists the largest files first"),
        ]
    )
    opening = (f"How do I {task} in {language}?", f"In {language}, {code}.")
    follow = (
        "Does that change the original?",
        "It depends on the method: some return a new value and leave the original as it was, others change it "
        "in place. Check the documentation of the one you use.",
    )
    return [opening, follow], f"Use this: {code}."


def _meaning(rng: random.Random) -> tuple[list[Exchange], str]:
    word, meaning, example = rng.choice(
        [
            ("ephemeral", "lasting a very short time", "The morning fog was ephemeral."),
            ("meticulous", "very careful about small details", "She kept meticulous notes."),
            ("candid", "honest and direct", "He gave a candid answer."),
            ("frugal", "careful not to spend much money", "They lived a frugal life."),
            ("resilient", "able to recover quickly", "The team was resilient after the loss."),
            ("ambiguous", "open to more than one meaning", "The instructions were ambiguous."),
            ("verbose", "using more words than needed", "The report was too verbose."),
        ]
    )
    opening = (f"What does the word '{word}' mean?", f"'{word.capitalize()}' means {meaning}.")
    follow = ("Can you use it in a sentence?", f"Of course: {example}")
    return [opening, follow], f"'{word.capitalize()}' means {meaning}."


def _scheduling(rng: random.Random) -> tuple[list[Exchange], str]:
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    start, offset = rng.randrange(7), rng.randint(2, 12)
    hour, length = rng.randint(8, 16), rng.randint(1, 3)
    opening = (
        f"Today is {days[start]}. What day will it be in {offset} days?",
        f"In {offset} days it will be {days[(start + offset) % 7]}.",
    )
    follow = (
        f"If a meeting starts at {hour}:00 and lasts {length} hours, when does it end?",
        f"It ends at {hour + length}:00.",
    )
    return [opening, follow], f"It will be {days[(start + offset) % 7]}."


def _gardening(rng: random.Random) -> tuple[list[Exchange], str]:
    plant, water, light = rng.choice(
        [
            ("tomatoes", "deeply two or three times a week", "at least six hours of sun"),
            ("basil", "when the top of the soil is dry", "a warm, sunny spot"),
            ("a snake plant", "every two to three weeks", "low or indirect light"),
            ("lavender", "sparingly once it is established", "full sun"),
            ("ferns", "often enough to keep the soil moist", "shade or indirect light"),
            ("strawberries", "regularly, especially while fruiting", "plenty of sun"),
        ]
    )
    opening = (f"How often should I water {plant}?", f"Water {plant} {water}. They also like {light}.")
    follow = (
        "The leaves are turning yellow. What could be wrong?",
        "Yellow leaves often mean too much water or poor drainage. Let the soil dry a little and make sure the "
        "pot has holes at the bottom.",
    )
    return [opening, follow], f"Water {plant} {water}."


_TOPICS: dict[str, Callable[[random.Random], tuple[list[Exchange], str]]] = {
    "cooking": _cooking,
    "travel": _travel,
    "arithmetic": _arithmetic,
    "conversion": _conversion,
    "programming": _programming,
    "meaning": _meaning,
    "scheduling": _scheduling,
    "gardening": _gardening,
}


def make_chat_corpus(num_conversations: int = 300, seed: int = 0) -> list[dict[str, Any]]:
    """``num_conversations`` templated multi-turn chats (module docstring), the same for the same arguments.

    Each has 2 to 4 user/assistant exchanges: the topic's opening exchange, then its own follow-up with
    probability 0.8, then up to two shared follow-ups; a quarter start with a system message.
    """
    if num_conversations < 1:
        raise ValueError(f"num_conversations must be >= 1, got {num_conversations}")
    rng = random.Random(seed)
    names = sorted(_TOPICS)
    corpus = []
    for index in range(num_conversations):
        topic = names[index % len(names)] if index < len(names) else rng.choice(names)
        (opening, own), short = _TOPICS[topic](rng)
        exchanges = [opening]
        if rng.random() < 0.8:
            exchanges.append(own)
        shared = rng.sample(_SHARED_FOLLOW_UPS, rng.randint(0 if len(exchanges) > 1 else 1, 2))
        exchanges += [(question, answer.format(short=short)) for question, answer in shared]
        messages: list[Message] = []
        if rng.random() < 0.25:
            messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
        for question, answer in exchanges:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        corpus.append({"id": index, "topic": topic, "messages": messages})
    return corpus


def write_chat_corpus(path: str | Path, num_conversations: int = 300, seed: int = 0) -> Path:
    """Write :func:`make_chat_corpus` as JSON lines (how the shipped asset was made)."""
    path = Path(path)
    lines = [json.dumps(item, ensure_ascii=False) for item in make_chat_corpus(num_conversations, seed)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def load_chat_corpus() -> list[dict[str, Any]]:
    """The shipped corpus: ``[{"id", "topic", "messages"}, ...]`` (300 conversations)."""
    text = resources.files("lightning_llm").joinpath(CHAT_CORPUS_ASSET).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]
