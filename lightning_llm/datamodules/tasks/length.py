"""Length following (LARFT, arXiv 2603.19255): "Write exactly N words about T." → N words on the topic.

Also the word-counting task LARFT's hindsight samples are made of ("Count the words of this text." →
``<word_count>N</word_count>``), on reference texts: a warm-up task standing in for the rough counting skill an
instruct model starts with.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from lightning_llm.datamodules.tasks import Example, Task, register_task
from lightning_llm.text import length_score, word_count

#: User message of the word-counting task, and the default of LARFT's hindsight task
#: (:class:`~lightning_llm.callbacks.HindsightLengthAwareness`); ``{response}`` is replaced by the text. The paper's
#: exact wording is not given (unverified): this is the simplest instruction naming the expected format.
_COUNT = re.compile(r"<word_count>\s*(\d+)\s*</word_count>")
COUNT_PROMPT = "Count the words of this text. Answer as <word_count>N</word_count>.\n\n{response}"

_TOPICS = ("the sea", "a city", "the night", "a garden", "the rain", "a journey", "the market", "a river")
_WORDS = (
    "the", "a", "of", "and", "to", "in", "is", "was", "on", "with", "at", "by", "from", "for", "light",
    "water", "stone", "green", "old", "small", "bright", "quiet", "road", "house", "wind", "cold", "warm",
    "people", "walk", "slowly", "every", "morning", "evening", "long", "blue", "field", "bird", "song",
)  # fmt: skip


def count_answer(n: int) -> str:
    """The answer format of the counting task: ``<word_count>n</word_count>``."""
    return f"<word_count>{n}</word_count>"


def parse_word_count(text: str) -> int | None:
    """The ``N`` of the first ``<word_count>N</word_count>`` in ``text``, or ``None`` (never raises)."""
    match = _COUNT.search(text)
    return int(match.group(1)) if match else None


@register_task
@dataclass(frozen=True)
class LengthTask(Task):
    """Prompts asking for exactly ``N`` words (``N`` uniform in ``[min_words, max_words]``) on a topic.

    The reference completion is ``N`` words drawn from a small vocabulary (its content is not the point);
    ``metadata["target_words"]`` carries ``N`` for :func:`lightning_llm.rewards.length_reward`, and the
    verifier is that reward: :math:`\\max(0, 1 - |L - N| / N)` with ``L`` the word count outside
    ``<think>…</think>``.

    Args:
        min_words: Smallest requested length, at least 0.
        max_words: Largest requested length, at least ``min_words``.
    """

    name = "length"
    answer_format = "Reply with exactly the requested number of words and nothing else."

    min_words: int = 5
    max_words: int = 40

    def __post_init__(self) -> None:
        if not 0 <= self.min_words <= self.max_words:
            raise ValueError(
                f"length: need 0 <= min_words <= max_words, got {self.min_words}, {self.max_words}"
            )

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        examples = []
        for _ in range(n):
            target = rng.randint(self.min_words, self.max_words)
            topic = rng.choice(_TOPICS)
            words = " ".join(rng.choices(_WORDS, k=target))
            examples.append(
                Example(
                    prompt=f"Write exactly {target} words about {topic}.",
                    completion=words,
                    answer=str(target),
                    metadata={"task": self.name, "target_words": target},
                )
            )
        return examples

    def score(self, completion: str, example: Example) -> float:
        return length_score(completion, int(example.metadata["target_words"]))


@register_task
@dataclass(frozen=True)
class WordCountTask(Task):
    """:data:`COUNT_PROMPT` on a text of ``N`` words (``N`` uniform in ``[min_words, max_words]``, the length
    task's vocabulary) → :func:`count_answer` ``(N)``. The verifier is 1.0 if the completion states ``N`` in that
    format, else 0.0.

    Args:
        min_words: Shortest text, at least 0.
        max_words: Longest text, at least ``min_words``.
    """

    name = "word_count"

    min_words: int = 1
    max_words: int = 40

    def __post_init__(self) -> None:
        if not 0 <= self.min_words <= self.max_words:
            raise ValueError(
                f"word_count: need 0 <= min_words <= max_words, got {self.min_words}, {self.max_words}"
            )

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        examples = []
        for _ in range(n):
            count = rng.randint(self.min_words, self.max_words)
            text = " ".join(rng.choices(_WORDS, k=count))
            examples.append(
                Example(
                    prompt=COUNT_PROMPT.replace("{response}", text),
                    completion=count_answer(count),
                    answer=str(count),
                    metadata={"task": self.name, "text": text},
                )
            )
        return examples

    def score(self, completion: str, example: Example) -> float:
        return float(parse_word_count(completion) == word_count(example.metadata["text"]))
