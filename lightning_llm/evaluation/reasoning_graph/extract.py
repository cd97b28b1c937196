"""Claims from free-form traces: an LLM rewrites each trace into the trace format
(:mod:`~lightning_llm.evaluation.reasoning_graph.parse`), which is then parsed leniently."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_llm.datamodules.tasks.puzzles import Puzzle
from lightning_llm.evaluation.dualgraph.backends import CallableBackend, LLMBackend
from lightning_llm.evaluation.reasoning_graph.parse import Claim, TraceParser

__all__ = ["LLMClaimExtractor"]

_EXTRACT_PROMPT = """Rewrite the reasoning below as a list of atomic claims about the grid, one per line, exactly as:
[id] r<row>c<col>=<value> <- <ids of earlier claims it uses> : <short reason>
[id] r<row>c<col>!=<value> <- <ids of earlier claims it uses> : <short reason>
Rows and columns are 1-based; ids are 1, 2, 3, ... in order; omit "<- ..." for a claim that follows from the
givens alone. Write only claims the reasoning states, including wrong ones. No other text.

Puzzle ({size} x {size}, 0 = empty):
{grid}

Reasoning:
{trace}

Claims:"""


class LLMClaimExtractor:
    """Turns free-form traces into claims: an LLM rewrites each trace into the trace format, which is then
    parsed leniently (malformed lines are skipped and counted, never executed).

    Args:
        backend: An :class:`~lightning_llm.evaluation.dualgraph.LLMBackend` (``complete(list[str])``, e.g.
            :class:`~lightning_llm.evaluation.dualgraph.CallableBackend` around a model's ``generate``, or
            :class:`~lightning_llm.evaluation.dualgraph.OpenAICompatibleBackend`), or any ``str -> str``
            callable, which is wrapped into a ``CallableBackend``.
        template: The prompt, with ``{size}``, ``{grid}`` and ``{trace}`` fields.

    Attributes:
        skipped: Unparseable lines in the LLM's answers, summed over calls.
        dropped_dependencies: Dependencies on unknown claim ids dropped, summed over calls.
    """

    def __init__(self, backend: LLMBackend | Callable[[str], str], template: str = _EXTRACT_PROMPT) -> None:
        if not hasattr(backend, "complete"):
            if not callable(backend):
                raise TypeError("backend must have .complete(list[str]) or be a str -> str callable")
            fn = backend
            backend = CallableBackend(lambda prompts: [fn(p) for p in prompts])
        self.backend: LLMBackend = backend  # type: ignore[assignment]
        self.template = template
        self.skipped = 0
        self.dropped_dependencies = 0

    def extract(self, traces: Sequence[str], puzzles: Sequence[Puzzle]) -> list[list[Claim]]:
        """One list of claims per trace (batched through the backend)."""
        if len(traces) != len(puzzles):
            raise ValueError(f"got {len(traces)} traces for {len(puzzles)} puzzles")
        prompts = [
            self.template.format(
                size=p.size, grid="\n".join(" ".join(str(v) for v in row) for row in p.givens), trace=t
            )
            for t, p in zip(traces, puzzles, strict=True)
        ]
        out = []
        for answer, puzzle in zip(self.backend.complete(prompts), puzzles, strict=True):
            parser = TraceParser(puzzle.size, strict=False)
            out.append(parser.parse(answer))
            self.skipped += parser.skipped
            self.dropped_dependencies += parser.dropped_dependencies
        return out
