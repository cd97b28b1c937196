"""Copying: "Copy: a c b" → ``<answer>a c b</answer>``, the simplest task a model can learn from scratch."""

from __future__ import annotations

import random
from dataclasses import dataclass

from lightning_llm.datamodules.tasks import Example, Task, extract_answer, register_task


@register_task
@dataclass(frozen=True)
class CopyTask(Task):
    """Sequences of ``length`` symbols drawn uniformly from ``alphabet``, space-separated.

    The verifier requires the last ``<answer>…</answer>`` to hold exactly the sequence (single spaces between
    symbols; whitespace around the whole sequence is allowed).

    Args:
        length: Number of symbols per sequence, at least 1.
        alphabet: The symbols, distinct non-whitespace characters.
    """

    name = "copy"

    length: int = 8
    alphabet: str = "abcdefgh"

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"copy: length must be >= 1, got {self.length}")
        if not self.alphabet or len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError(f"copy: alphabet must be non-empty distinct characters, got {self.alphabet!r}")
        if any(symbol.isspace() for symbol in self.alphabet):
            raise ValueError(f"copy: alphabet must not contain whitespace, got {self.alphabet!r}")

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        examples = []
        for _ in range(n):
            answer = " ".join(rng.choices(self.alphabet, k=self.length))
            examples.append(
                Example(
                    prompt=f"Copy: {answer}",
                    completion=f"<answer>{answer}</answer>",
                    answer=answer,
                    metadata={"task": self.name},
                )
            )
        return examples

    def score(self, completion: str, example: Example) -> float:
        content = extract_answer(completion)
        return float(content is not None and content.strip() == example.answer)
