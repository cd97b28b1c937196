"""Reasoning graphs of logic-puzzle traces and their flow efficiency η (arXiv 2606.03883; docs/methods.md §9).

A reasoning trace is turned into a DAG of *atomic claims* about the grid, each verified against the puzzle, and
the shape of that DAG is scored: a focused deduction spends every claim on the way to the answer, a meandering
one also wanders into wrong guesses and claims nothing uses.

- :mod:`~lightning_llm.evaluation.reasoning_graph.parse`: the trace format (:class:`Claim`,
  :func:`format_trace`) and its parser (:class:`TraceParser`);
- :mod:`~lightning_llm.evaluation.reasoning_graph.extract`: :class:`LLMClaimExtractor`, which has an LLM rewrite
  free-form traces into the trace format;
- :mod:`~lightning_llm.evaluation.reasoning_graph.verify`: :func:`verify_claims`, each claim checked against the
  solution;
- :mod:`~lightning_llm.evaluation.reasoning_graph.graph`: :func:`build_reasoning_graph`, the DAG with its answer
  claims and dead ends;
- :mod:`~lightning_llm.evaluation.reasoning_graph.efficiency`: the flow efficiency η (:func:`visitation`,
  :func:`reasoning_efficiency`; one documented reading of the paper's) and :func:`structure_stats`;
- :mod:`~lightning_llm.evaluation.reasoning_graph.metric`: :class:`ReasoningEfficiency`, η averaged over traces
  as a torchmetrics metric;
- :mod:`~lightning_llm.evaluation.reasoning_graph.draw`: :func:`draw_reasoning_graph`;
- :mod:`~lightning_llm.evaluation.reasoning_graph.synthetic`: :func:`focused_trace` and
  :func:`meandering_trace`, synthetic traces for tests and tutorial 11.
"""

from lightning_llm.evaluation.reasoning_graph.draw import draw_reasoning_graph
from lightning_llm.evaluation.reasoning_graph.efficiency import (
    StructureStats,
    reasoning_efficiency,
    structure_stats,
    visitation,
)
from lightning_llm.evaluation.reasoning_graph.extract import LLMClaimExtractor
from lightning_llm.evaluation.reasoning_graph.graph import QUESTION_NODE, build_reasoning_graph
from lightning_llm.evaluation.reasoning_graph.metric import ReasoningEfficiency
from lightning_llm.evaluation.reasoning_graph.parse import Claim, TraceParser, format_trace
from lightning_llm.evaluation.reasoning_graph.synthetic import focused_trace, meandering_trace
from lightning_llm.evaluation.reasoning_graph.verify import ClaimVerdict, verify_claims

__all__ = [
    "QUESTION_NODE",
    "Claim",
    "ClaimVerdict",
    "LLMClaimExtractor",
    "ReasoningEfficiency",
    "StructureStats",
    "TraceParser",
    "build_reasoning_graph",
    "draw_reasoning_graph",
    "focused_trace",
    "format_trace",
    "meandering_trace",
    "reasoning_efficiency",
    "structure_stats",
    "verify_claims",
    "visitation",
]
