"""Long-context retrieval: associative recall, needle in a haystack, multi-key needles (RULER's MK-NIAH).

Tasks whose answer sits at a known place far back in the prompt, for evaluating what a model loses when its
KV cache evicts tokens (docs/methods.md §11). Every example records where its needle is, in characters of the prompt
(``needle_char_start``/``needle_char_end``) and as a fraction of the context (``needle_depth``), so accuracy can
be bucketed by depth. The symbols are chosen for the tiny backbone's ~1k-token BPE vocabulary: keys are single
tokens (``" k"``, ``" fire"``), values are digits (one token each), so the context length in tokens is close
to its length in symbols and the answer is a copy of tokens the model has seen.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from lightning_llm.datamodules.tasks import Example, Task, extract_answer, register_task

__all__ = [
    "FILLERS",
    "LONG_CONTEXT_TASKS",
    "AssociativeRecallTask",
    "MultiKeyNeedleTask",
    "NeedleTask",
    "prose_sentences",
]

#: Names of the tasks of this module (``NeedleDataModule`` accepts these).
LONG_CONTEXT_TASKS = ("associative_recall", "needle", "multikey_needle")

# Filler text: sentences "The cat sat by the river today." from a fixed vocabulary of (mostly) single tokens
# of the tiny tokenizer. No filler word is a needle key, a single letter or a digit, so a key or value occurs
# in the prompt only where the task put it.
_SUBJECTS = ("cat", "man", "fox", "model")
_VERBS = ("sat", "sees", "reads", "stays", "finds", "opens", "returns")
_PREPOSITIONS = ("on", "by", "over", "with", "into", "in")
_OBJECTS = ("mat", "river", "sea", "city", "water", "wind", "stars", "text")
_TIMES = ("", " today", " at night", " in the morning", " again")
#: Filler words between associative-recall pairs.
_FILLER_WORDS = tuple(sorted({"the", *_SUBJECTS, *_VERBS, *_PREPOSITIONS, *_OBJECTS}))
#: Needle keys, single tokens of the tiny tokenizer that the filler never uses.
NEEDLE_KEYS = (
    "fire",
    "beans",
    "pears",
    "car",
    "tag",
    "letter",
    "store",
    "plant",
    "weather",
    "region",
    "cache",
    "product",
    "state",
    "sample",
    "group",
    "robot",
)
_KEY_VALUE_FORBIDDEN = set("=.:") | {" "}
_MAX_ATTEMPTS_FACTOR = 20


def _filler_sentence(rng: random.Random) -> list[str]:
    """One filler sentence as words (the last ends with a full stop)."""
    time = rng.choice(_TIMES)
    words = [
        "The",
        rng.choice(_SUBJECTS),
        rng.choice(_VERBS),
        rng.choice(_PREPOSITIONS),
        "the",
        rng.choice(_OBJECTS),
        *time.split(),
    ]
    words[-1] += "."
    return words


def _haystack(rng: random.Random, num_words: int) -> list[str]:
    """Filler sentences totalling exactly ``num_words`` words (the last one cut short if need be)."""
    sentences: list[str] = []
    remaining = num_words
    while remaining > 0:
        words = _filler_sentence(rng)[:remaining]
        if not words[-1].endswith("."):
            words[-1] += "."
        sentences.append(" ".join(words))
        remaining -= len(words)
    return sentences


#: Filler styles of the needle tasks: the templated sentences above, or natural English prose.
FILLERS = ("synthetic", "prose")


@functools.cache
def prose_sentences() -> tuple[str, ...]:
    """The sentences of the shipped natural-English filler corpus (``lightning_llm/assets/needle_prose.txt``).

    The corpus is original prose written for this package: twenty short paragraphs (about 1,600 words) of everyday
    description (a harbour town, a library, a railway, cooking, weather...), with no digits, no word "code" and
    none of :data:`NEEDLE_KEYS`, so a needle's key and value occur in a prompt only where the task put them.
    """
    text = resources.files("lightning_llm").joinpath("assets/needle_prose.txt").read_text(encoding="utf-8")
    return tuple(s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s)


def _prose_haystack(rng: random.Random, num_words: int) -> list[str]:
    """Consecutive corpus sentences from a random start (wrapping around), ``num_words`` words in total (the
    last sentence cut short if need be)."""
    corpus = prose_sentences()
    index = rng.randrange(len(corpus))
    sentences: list[str] = []
    remaining = num_words
    while remaining > 0:
        words = corpus[index % len(corpus)].split()[:remaining]
        if not words[-1].endswith((".", "!", "?")):
            words[-1] = words[-1].rstrip(",;:") + "."
        sentences.append(" ".join(words))
        remaining -= len(words)
        index += 1
    return sentences


def _unique(n: int, seed: int, make: Any, name: str) -> list[Example]:
    """``n`` examples with distinct prompts from ``make(rng)``; a task space too small to supply them fails."""
    rng = random.Random(seed)
    examples: list[Example] = []
    seen: set[str] = set()
    for _ in range(max(n * _MAX_ATTEMPTS_FACTOR, 100)):
        if len(examples) == n:
            return examples
        example = make(rng)
        if example.prompt not in seen:
            seen.add(example.prompt)
            examples.append(example)
    if len(examples) == n:
        return examples
    raise ValueError(
        f"{name}: could only generate {len(examples)} distinct examples of {n}; enlarge the task"
    )


def _check_symbols(task: str, field: str, symbols: str, minimum: int) -> None:
    if len(symbols) < minimum or len(set(symbols)) != len(symbols):
        raise ValueError(f"{task}: {field} must be at least {minimum} distinct characters, got {symbols!r}")
    bad = sorted(set(symbols) & _KEY_VALUE_FORBIDDEN) + sorted(c for c in set(symbols) if c.isspace())
    if bad:
        raise ValueError(f"{task}: {field} must not contain whitespace or any of '=.:', got {bad}")


def _depth(char_start: int, context_chars: int) -> float:
    return char_start / max(1, context_chars)


@register_task
@dataclass(frozen=True)
class AssociativeRecallTask(Task):
    """Associative recall: ``num_pairs`` key–value pairs, then query keys; the answer is their values.

    Prompt ``"Pairs: k=7 b=2 m=0 ... Query: b"``, completion ``<answer>2</answer>``; with ``num_queries > 1``
    the query names several distinct keys and the answer is their values in query order, space-separated
    (``<answer>2 0</answer>``). Keys are distinct within an example; values may repeat. With the default
    alphabets every key (``" k"``) and every value (``"7"``) is one token of the tiny tokenizer, and a pair is
    three tokens: 16 pairs are a 48-token context, about 70 tokens with the chat template. ``filler`` words
    (from a fixed vocabulary that contains no key or value) between consecutive pairs stretch the context
    without making the task harder to *state*, only to attend over.

    Metadata: ``pairs`` (the (key, value) pairs in order), ``query_keys``, ``query_pair_indices``, and for the
    first query the character span of its pair in the prompt (``needle_char_start``/``needle_char_end``:
    ``prompt[start:end] == "b=2"``) and ``needle_depth``, that start as a fraction of the context's characters
    (0: first pair, close to 1: last); ``needle_char_starts`` has the start of every query's pair.

    The verifier requires the last ``<answer>…</answer>`` to hold exactly the values (single spaces between
    them; whitespace around the whole answer is allowed).

    **Learnability on the tiny backbone** (measured; not yet a working recipe). The tiny backbone is randomly
    initialised (``load_backbone("tiny")`` builds it from a seed, it is not pretrained), and content-based
    lookup is the slow thing for it to learn: trained with ``CausalLMModule("tiny", lr=...)`` +
    ``NeedleDataModule(task_kwargs=..., batch_size=16, num_val=200)`` and a CPU ``lightning.Trainer``,
    single-threaded (one shared core, about 0.07 s per step at 4 pairs and 0.14 s at 16 pairs with
    ``filler=1``, i.e. ~85-token prompts), scored greedily (``CausalLMModule.generate``, ``task.score``) on
    the 200 validation examples:

    ==========================================================  =======  =======  =====================
    configuration (training = evaluation unless said)           lr       steps    accuracy
    ==========================================================  =======  =======  =====================
    ``num_pairs=16, filler=1`` (batch 32)                       3e-3     800      0.10 (chance)
    ``num_pairs=16, filler=1``                                  1e-2     500      0.10
    ``num_pairs=16, filler=1``                                  3e-3     1250     0.11
    ``num_pairs=16, filler=1, num_queries=8``                   3e-3     500      (loss flat at 1.01)
    ``num_pairs=4``                                             3e-3     400      0.24
    ``num_pairs=4`` without ``=`` (``"n8 o7"``)                 3e-3     500      0.25
    curriculum 4 pairs (1200) → 8 (600) → 16 + filler 1 (600)   5e-3     2400     0.11
    ``num_pairs=4, num_queries=4``                              5e-3     1500     (loss 0.92 → 0.68)
    ==========================================================  =======  =======  =====================

    Chance is 0.10 (a digit); guessing one of the prompt's values gives about 0.3 with 4 pairs. With one query
    the loss stays on the plateau ≈ ln(10)/4 (the value digit is one of the four trained response tokens,
    predicted uniformly) in every run; with dense supervision (every key queried) it was still falling
    slowly at 1500 steps, outputs still near-constant. The content-based lookup circuit that recall needs
    does not form within a few thousand single-core steps, so ≥ 0.9 full-cache accuracy at ≥ 96 context
    tokens needs a much longer (or a GPU) run, or a backbone already trained on recall.

    Args:
        num_pairs: Number of key–value pairs, 1 to ``len(keys)``.
        num_queries: Number of keys asked about, 1 to ``num_pairs``.
        keys: Key alphabet, distinct non-whitespace characters (default: the lowercase letters that the tiny
            tokenizer encodes as one token after a space).
        values: Value alphabet, distinct non-whitespace characters (default: the digits).
        filler: Filler words between consecutive pairs, at least 0.
    """

    name = "associative_recall"

    num_pairs: int = 16
    num_queries: int = 1
    keys: str = "abcdefghiklmnoprstuvw"
    values: str = "0123456789"
    filler: int = 0

    def __post_init__(self) -> None:
        _check_symbols(self.name, "keys", self.keys, 1)
        _check_symbols(self.name, "values", self.values, 1)
        if set(self.keys) & set(self.values):
            raise ValueError(f"{self.name}: keys and values must not share symbols")
        if not 1 <= self.num_pairs <= len(self.keys):
            raise ValueError(
                f"{self.name}: num_pairs must be in [1, {len(self.keys)}] (the number of keys), "
                f"got {self.num_pairs}"
            )
        if not 1 <= self.num_queries <= self.num_pairs:
            raise ValueError(f"{self.name}: num_queries must be in [1, num_pairs], got {self.num_queries}")
        if self.filler < 0:
            raise ValueError(f"{self.name}: filler must be >= 0, got {self.filler}")

    def generate(self, n: int, seed: int) -> list[Example]:
        return _unique(n, seed, self._example, self.name)

    def score(self, completion: str, example: Example) -> float:
        content = extract_answer(completion)
        return float(content is not None and content.strip() == example.answer)

    def _example(self, rng: random.Random) -> Example:
        keys = rng.sample(self.keys, self.num_pairs)
        values = [rng.choice(self.values) for _ in keys]
        queried = rng.sample(range(self.num_pairs), self.num_queries)
        prefix = "Pairs:"
        parts = [prefix]
        starts = []
        position = len(prefix)
        for index, (key, value) in enumerate(zip(keys, values, strict=True)):
            if index and self.filler:
                words = " ".join(rng.choice(_FILLER_WORDS) for _ in range(self.filler))
                parts.append(words)
                position += 1 + len(words)
            starts.append(position + 1)
            parts.append(f"{key}={value}")
            position += 1 + len(key) + 1 + len(value)
        context = " ".join(parts) + "."
        query = " ".join(keys[index] for index in queried)
        answer = " ".join(values[index] for index in queried)
        first = queried[0]
        return Example(
            prompt=f"{context} Query: {query}",
            completion=f"<answer>{answer}</answer>",
            answer=answer,
            metadata={
                "task": self.name,
                "pairs": tuple(zip(keys, values, strict=True)),
                "query_keys": tuple(keys[index] for index in queried),
                "query_pair_indices": tuple(queried),
                "needle_char_start": starts[first],
                "needle_char_end": starts[first] + len(keys[first]) + 1 + len(values[first]),
                "needle_char_starts": tuple(starts[index] for index in queried),
                "needle_depth": _depth(starts[first], len(context)),
                "context_chars": len(context),
            },
        )


_VALUE_RE = re.compile(r"\s*([0-9]+)\s*")


def _needle_sentence(key: str, value: str) -> str:
    return f"The code for {key} is {value}."


def _needle_example(
    task: str,
    rng: random.Random,
    haystack_words: int,
    needles: list[tuple[str, str]],
    depths: list[float],
    query: int,
    filler: str = "synthetic",
) -> Example:
    """Filler with ``needles`` (key, value) inserted at sentence boundaries nearest ``depths``; asks ``query``."""
    sentences = _prose_haystack(rng, haystack_words) if filler == "prose" else _haystack(rng, haystack_words)
    # Boundary b is before sentence b (b = len(sentences): at the end); several needles may share one.
    boundaries = [round(depth * len(sentences)) for depth in depths]
    order = sorted(range(len(needles)), key=lambda index: (boundaries[index], index))
    pieces: list[tuple[str, int | None]] = [(sentence, None) for sentence in sentences]
    for index in reversed(order):  # insert from the back so that earlier boundaries stay valid
        pieces.insert(boundaries[index], (_needle_sentence(*needles[index]), index))
    starts: dict[int, int] = {}
    position = 0
    for text, index in pieces:
        if index is not None:
            starts[index] = position
        position += len(text) + 1
    context = " ".join(text for text, _ in pieces)
    key, value = needles[query]
    return Example(
        prompt=f"{context}\nWhat is the code for {key}?",
        completion=f"<answer>{value}</answer>",
        answer=value,
        metadata={
            "task": task,
            "needles": tuple(needles),
            "query_key": key,
            "needle_char_start": starts[query],
            "needle_char_end": starts[query] + len(_needle_sentence(key, value)),
            "needle_char_starts": tuple(starts[index] for index in range(len(needles))),
            "needle_depth": _depth(starts[query], len(context)),
            "context_chars": len(context),
            "haystack_words": haystack_words,
            "filler": filler,
        },
    )


def _check_needle(task: str, haystack_words: int, value_digits: int, filler: str) -> None:
    if filler not in FILLERS:
        raise ValueError(f"{task}: filler must be one of {FILLERS}, got {filler!r}")
    if haystack_words < 0:
        raise ValueError(f"{task}: haystack_words must be >= 0, got {haystack_words}")
    if value_digits < 1:
        raise ValueError(f"{task}: value_digits must be >= 1, got {value_digits}")


def _score_value(completion: str, example: Example) -> float:
    content = extract_answer(completion)
    if content is None:
        return 0.0
    match = _VALUE_RE.fullmatch(content)
    return float(match is not None and match.group(1) == example.answer)


def _random_value(rng: random.Random, digits: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(digits))


@register_task
@dataclass(frozen=True)
class NeedleTask(Task):
    """Needle in a haystack: one sentence "The code for fire is 4821." hidden in filler text.

    The haystack is ``haystack_words`` words of filler sentences ("The cat sat by the river today.", a fixed
    vocabulary, seeded), the needle sentence is inserted at the sentence boundary nearest ``depth`` (0: before
    the first sentence, 1: after the last), and the question after a newline asks "What is the code for
    fire?"; completion ``<answer>4821</answer>``. The key is drawn from :data:`NEEDLE_KEYS` (single tokens of
    the tiny tokenizer, never filler words), the value is ``value_digits`` random digits (one token each).
    With the tiny tokenizer a filler word is about 1.2 tokens: 200 words are about 250 tokens.

    Metadata: ``needle_char_start``/``needle_char_end`` (``prompt[start:end]`` is the needle sentence),
    ``needle_depth`` (its start as a fraction of the context's characters), ``query_key``, ``needles``.

    The verifier requires the last ``<answer>…</answer>`` to hold exactly the digits (surrounding whitespace
    allowed).

    Args:
        haystack_words: Number of filler words, at least 0 (the needle and the question come on top).
        depth: Where the needle goes, a fraction in [0, 1]; None draws it uniformly per example.
        value_digits: Number of digits of the value, at least 1.
        filler: ``"synthetic"`` (the templated sentences above) or ``"prose"``: consecutive sentences of the
            shipped natural-English corpus (:func:`prose_sentences`) from a random start, wrapping around (its
            ~1,600 words repeat beyond that); with the SmolLM2 tokenizer a prose word is about 1.25 tokens.
    """

    name = "needle"

    haystack_words: int = 200
    depth: float | None = None
    value_digits: int = 4
    filler: str = "synthetic"

    def __post_init__(self) -> None:
        _check_needle(self.name, self.haystack_words, self.value_digits, self.filler)
        if self.depth is not None and not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"{self.name}: depth must be in [0, 1] or None (random), got {self.depth}")

    def generate(self, n: int, seed: int) -> list[Example]:
        return _unique(n, seed, self._example, self.name)

    def score(self, completion: str, example: Example) -> float:
        return _score_value(completion, example)

    def _example(self, rng: random.Random) -> Example:
        depth = rng.random() if self.depth is None else self.depth
        needle = (rng.choice(NEEDLE_KEYS), _random_value(rng, self.value_digits))
        return _needle_example(self.name, rng, self.haystack_words, [needle], [depth], 0, self.filler)


@register_task
@dataclass(frozen=True)
class MultiKeyNeedleTask(Task):
    """Multi-key needle in a haystack (RULER's MK-NIAH): ``num_needles`` needles with distinct keys, one asked.

    As :class:`NeedleTask`, but ``num_needles`` needle sentences with distinct keys and distinct values are
    inserted at independent uniform depths, and the question names one of them: the others are distractors of
    exactly the needle's form. Metadata as :class:`NeedleTask`'s (for the queried needle), plus
    ``needle_char_starts`` (every needle's start, in the order of ``needles``).

    Args:
        haystack_words: Number of filler words, at least 0.
        num_needles: Number of needles, 1 to ``len(NEEDLE_KEYS)`` (16).
        value_digits: Number of digits of each value, at least 1 (and enough for distinct values).
        filler: ``"synthetic"`` or ``"prose"``, as for :class:`NeedleTask`.
    """

    name = "multikey_needle"

    haystack_words: int = 200
    num_needles: int = 4
    value_digits: int = 4
    filler: str = "synthetic"

    def __post_init__(self) -> None:
        _check_needle(self.name, self.haystack_words, self.value_digits, self.filler)
        if not 1 <= self.num_needles <= len(NEEDLE_KEYS):
            raise ValueError(
                f"{self.name}: num_needles must be in [1, {len(NEEDLE_KEYS)}], got {self.num_needles}"
            )
        if self.num_needles > 10**self.value_digits:
            raise ValueError(
                f"{self.name}: {self.num_needles} distinct values need more than value_digits={self.value_digits}"
            )

    def generate(self, n: int, seed: int) -> list[Example]:
        return _unique(n, seed, self._example, self.name)

    def score(self, completion: str, example: Example) -> float:
        return _score_value(completion, example)

    def _example(self, rng: random.Random) -> Example:
        keys = rng.sample(NEEDLE_KEYS, self.num_needles)
        values = [
            str(number).zfill(self.value_digits)
            for number in rng.sample(range(10**self.value_digits), self.num_needles)
        ]
        depths = [rng.random() for _ in keys]
        query = rng.randrange(self.num_needles)
        needles = list(zip(keys, values, strict=True))
        return _needle_example(self.name, rng, self.haystack_words, needles, depths, query, self.filler)
