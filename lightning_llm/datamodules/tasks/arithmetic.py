"""Integer arithmetic: "What is 37 + 58?" → ``<answer>95</answer>``."""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass

from lightning_llm.datamodules.tasks import Example, Task, extract_answer, register_task

_INTEGER_RE = re.compile(r"\s*(-?[0-9]+)\s*")
_SUPPORTED_OPS = "+-*"

#: The question wordings of :class:`ArithmeticTask` (``phrasings`` picks among them by index); 0 is the default.
ARITHMETIC_PHRASINGS = (
    "What is {expression}?",
    "Compute {expression}.",
    "Calculate {expression}.",
    "{expression} = ?",
    "Work out the value of {expression}.",
    "Find {expression}.",
    "How much is {expression}?",
    "Give the result of {expression}.",
)


@register_task
@dataclass(frozen=True)
class ArithmeticTask(Task):
    """Expressions of ``operands`` non-negative ``digits``-digit integers joined by operators from ``ops``.

    Expressions are evaluated strictly **left to right**, ignoring precedence (``2 + 3 * 4`` is 20): every
    prefix is then a meaningful intermediate result, so a chain of thought is one step per operator. Prompts
    with more than two operands say so, since a reader would otherwise assume precedence.

    The verifier compares the content of the last ``<answer>…</answer>`` with the canonical decimal integer
    (ASCII digits, optional leading minus, no leading zeros or plus sign, surrounding whitespace allowed).

    Args:
        digits: Number of digits of each operand (1 means 0–9; d > 1 means 10^(d-1) to 10^d − 1).
        ops: The operators to draw from, any non-empty subset of ``"+-*"``.
        operands: Number of operands, at least 2.
        chain_of_thought: Whether the reference completion shows its steps in ``<think>…</think>`` first.
        latent_steps: Coconut's data format (arXiv 2412.06769, the baseline of LT-Tuning): each of the
            ``operands − 1`` steps is replaced by this many ``<thinking>`` placeholders before the answer, so a
            model reasons in latents instead of tokens. 0 (default) writes none; exclusive with
            ``chain_of_thought``.
        phrasings: indices into :data:`ARITHMETIC_PHRASINGS` of the wordings generated examples are asked in,
            one drawn per example (default ``(0,)``: "What is …?" only). Hold wordings out of training by
            listing only the others; :meth:`rephrase` asks any item in any wording. Training and validation
            never share an item (operands and operators), whatever its wording.
    """

    name = "arithmetic"
    answer_format = (
        "Evaluate the expression strictly left to right and give the result inside <answer></answer> tags."
    )

    digits: int = 2
    ops: str = "+-*"
    operands: int = 2
    chain_of_thought: bool = False
    latent_steps: int = 0
    phrasings: tuple[int, ...] = (0,)

    num_phrasings = len(ARITHMETIC_PHRASINGS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "phrasings", tuple(self.phrasings))
        if (
            not self.phrasings
            or len(set(self.phrasings)) != len(self.phrasings)
            or not all(isinstance(i, int) and 0 <= i < self.num_phrasings for i in self.phrasings)
        ):
            raise ValueError(
                f"arithmetic: phrasings must be distinct indices in 0..{self.num_phrasings - 1}, got {self.phrasings!r}"
            )
        if self.latent_steps < 0:
            raise ValueError(f"arithmetic: latent_steps must be >= 0, got {self.latent_steps}")
        if self.latent_steps and self.chain_of_thought:
            raise ValueError("arithmetic: latent_steps replaces the chain of thought; set one of the two")
        if self.digits < 1:
            raise ValueError(f"arithmetic: digits must be >= 1, got {self.digits}")
        if self.operands < 2:
            raise ValueError(f"arithmetic: operands must be >= 2, got {self.operands}")
        if not self.ops or set(self.ops) - set(_SUPPORTED_OPS) or len(set(self.ops)) != len(self.ops):
            raise ValueError(
                f"arithmetic: ops must be distinct characters from {_SUPPORTED_OPS!r}, got {self.ops!r}"
            )

    def generate(self, n: int, seed: int) -> list[Example]:
        rng = random.Random(seed)
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        high = 10**self.digits - 1
        examples = []
        for _ in range(n):
            values = [rng.randint(low, high) for _ in range(self.operands)]
            ops = [rng.choice(self.ops) for _ in range(self.operands - 1)]
            result = values[0]
            steps = []
            for op, value in zip(ops, values[1:], strict=True):
                new = result + value if op == "+" else result - value if op == "-" else result * value
                steps.append(f"{result} {op} {value} = {new}")
                result = new
            expression = " ".join(
                [str(values[0])] + [f"{op} {value}" for op, value in zip(ops, values[1:], strict=True)]
            )
            answer = str(result)
            thought = f"<think>{'; '.join(steps)}</think>" if self.chain_of_thought else ""
            thought += "<thinking>" * (self.latent_steps * len(steps))
            # one wording: no draw, so the default's examples do not depend on the phrasing option
            phrasing = self.phrasings[0] if len(self.phrasings) == 1 else rng.choice(self.phrasings)
            examples.append(
                Example(
                    prompt=self._question(expression, phrasing),
                    completion=f"{thought}<answer>{answer}</answer>",
                    answer=answer,
                    metadata={
                        "task": self.name,
                        "operands": tuple(values),
                        "ops": tuple(ops),
                        "expression": expression,
                        "phrasing": phrasing,
                    },
                )
            )
        return examples

    def _question(self, expression: str, phrasing: int) -> str:
        suffix = " Evaluate left to right." if self.operands > 2 else ""
        return ARITHMETIC_PHRASINGS[phrasing].format(expression=expression) + suffix

    def item_key(self, example: Example) -> tuple[tuple[int, ...], tuple[str, ...]]:
        return tuple(example.metadata["operands"]), tuple(example.metadata["ops"])

    def rephrase(self, example: Example, phrasing: int) -> Example:
        if not 0 <= phrasing < self.num_phrasings:
            raise ValueError(f"arithmetic: phrasing must be in 0..{self.num_phrasings - 1}, got {phrasing}")
        metadata = {**example.metadata, "phrasing": phrasing}
        return dataclasses.replace(
            example, prompt=self._question(example.metadata["expression"], phrasing), metadata=metadata
        )

    def score(self, completion: str, example: Example) -> float:
        content = extract_answer(completion)
        if content is None:
            return 0.0
        match = _INTEGER_RE.fullmatch(content)
        # String comparison, not int(): exact canonical form, and no int() digit-limit errors on huge inputs.
        return float(match is not None and match.group(1) == example.answer)
