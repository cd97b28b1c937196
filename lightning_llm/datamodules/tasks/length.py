"""Length following (LARFT, arXiv 2603.19255): "Write exactly N words about T." → N words on the topic."""

from __future__ import annotations

import random
from dataclasses import dataclass

from lightning_llm.datamodules.tasks import Example, Task, register_task
from lightning_llm.rewards import length_score

_TOPICS = ("the sea", "a city", "the night", "a garden", "the rain", "a journey", "the market", "a river")
_WORDS = (
    "the", "a", "of", "and", "to", "in", "is", "was", "on", "with", "at", "by", "from", "for", "light",
    "water", "stone", "green", "old", "small", "bright", "quiet", "road", "house", "wind", "cold", "warm",
    "people", "walk", "slowly", "every", "morning", "evening", "long", "blue", "field", "bird", "song",
)  # fmt: skip


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
