"""Copying: "Copy: a c b" → ``<answer>a c b</answer>``, the simplest task a model can learn from scratch."""

from __future__ import annotations

import random
from dataclasses import dataclass

from lightning_llm.datamodules.tasks import Example, Task, extract_answer, register_task


@register_task
@dataclass(frozen=True)
class CopyTask(Task):
    """Sequences of ``length`` symbols drawn uniformly from ``alphabet``, space-separated.

    With ``shift = k ≠ 0`` the answer is the sequence enciphered by a Caesar shift of ``k`` places in
    ``alphabet`` (``shift=1``: "a c b" → "b d c"): a *shifted* copy task. A model that already copies must
    learn a permutation of the symbols, a full-rank change of its output map (the cyclic permutation minus
    the identity has rank ``len(alphabet) − 1``), which is what low-rank adapters find hard (ScaLoRA's
    tutorial uses it).

    The verifier requires the last ``<answer>…</answer>`` to hold exactly the sequence (single spaces between
    symbols; whitespace around the whole sequence is allowed).

    Args:
        length: Number of symbols per sequence, at least 1.
        alphabet: The symbols, distinct non-whitespace characters.
        shift: Caesar shift applied to the answer (0: plain copying).
    """

    name = "copy"

    length: int = 8
    alphabet: str = "abcdefgh"
    shift: int = 0

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
            symbols = rng.choices(range(len(self.alphabet)), k=self.length)
            shown = " ".join(self.alphabet[i] for i in symbols)
            answer = " ".join(self.alphabet[(i + self.shift) % len(self.alphabet)] for i in symbols)
            examples.append(
                Example(
                    prompt=f"Copy: {shown}",
                    completion=f"<answer>{answer}</answer>",
                    answer=answer,
                    metadata={"task": self.name},
                )
            )
        return examples

    def score(self, completion: str, example: Example) -> float:
        content = extract_answer(completion)
        return float(content is not None and content.strip() == example.answer)
