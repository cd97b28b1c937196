"""Integer arithmetic: "What is 37 + 58?" → ``<answer>95</answer>``."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from lightning_llm.datamodules.tasks import Example, Task, extract_answer, register_task

_INTEGER_RE = re.compile(r"\s*(-?[0-9]+)\s*")
_SUPPORTED_OPS = "+-*"


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

    def __post_init__(self) -> None:
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
        suffix = " Evaluate left to right." if self.operands > 2 else ""
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
            examples.append(
                Example(
                    prompt=f"What is {expression}?{suffix}",
                    completion=f"{thought}<answer>{answer}</answer>",
                    answer=answer,
                    metadata={"task": self.name, "operands": tuple(values), "ops": tuple(ops)},
                )
            )
        return examples

    def score(self, completion: str, example: Example) -> float:
        content = extract_answer(completion)
        if content is None:
            return 0.0
        match = _INTEGER_RE.fullmatch(content)
        # String comparison, not int(): exact canonical form, and no int() digit-limit errors on huge inputs.
        return float(match is not None and match.group(1) == example.answer)
