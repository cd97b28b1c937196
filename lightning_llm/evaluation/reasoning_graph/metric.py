"""The flow efficiency η averaged over traces, as a torchmetrics metric."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torchmetrics import Metric

from lightning_llm.datamodules.tasks.puzzles import Grid, Puzzle
from lightning_llm.evaluation.reasoning_graph.efficiency import (
    CMin,
    DeadEnds,
    reasoning_efficiency,
    structure_stats,
)
from lightning_llm.evaluation.reasoning_graph.extract import LLMClaimExtractor
from lightning_llm.evaluation.reasoning_graph.graph import build_reasoning_graph
from lightning_llm.evaluation.reasoning_graph.parse import TraceParser

__all__ = ["ReasoningEfficiency"]


class ReasoningEfficiency(Metric):
    r"""Mean η (:func:`reasoning_efficiency`) over traces, with the mean structure statistics.

    ``update(traces, puzzles)`` parses each trace (the trace format, leniently, or through ``extractor`` for
    free-form traces), builds its graph and adds η and its statistics to sums; traces without claims are counted
    in ``empty`` and left out of the means. All states are sums (``dist_reduce_fx="sum"``), so the metric is
    exact under DDP. :meth:`compute` returns the mean η as a tensor, or with ``return_stats=True`` a dict:
    ``eta``, ``depth``, ``branching``, ``dead_end_fraction``, ``false_fraction``, ``solved`` (means),
    ``traces`` and ``empty`` (counts).

    Args:
        c_min: Passed to :func:`reasoning_efficiency`.
        dead_ends: Passed to :func:`reasoning_efficiency`.
        extractor: Turns free-form traces into claims; None reads the trace format.
        return_stats: See above.
    """

    full_state_update = False
    _STATS = ("depth", "branching", "dead_end_fraction", "false_fraction", "solved")

    def __init__(
        self,
        c_min: CMin = "ancestors",
        dead_ends: DeadEnds = "backtrack",
        extractor: LLMClaimExtractor | None = None,
        return_stats: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.c_min, self.dead_ends = c_min, dead_ends
        self.extractor, self.return_stats = extractor, return_stats
        for name in ("eta", "traces", "empty", *self._STATS):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, traces: Sequence[str], puzzles: Sequence[Puzzle]) -> None:
        if len(traces) != len(puzzles):
            raise ValueError(f"got {len(traces)} traces for {len(puzzles)} puzzles")
        if self.extractor is not None:
            all_claims = self.extractor.extract(traces, puzzles)
            answers: list[Grid | None] = [None] * len(traces)
        else:
            all_claims, answers = [], []
            for trace, puzzle in zip(traces, puzzles, strict=True):
                parser = TraceParser(puzzle.size, strict=False)
                all_claims.append(parser.parse(trace))
                answers.append(parser.parse_answer(trace))
        for claims, puzzle, answer in zip(all_claims, puzzles, answers, strict=True):
            if not claims:
                self.empty += 1
                continue
            graph = build_reasoning_graph(puzzle, claims, answer)
            stats = structure_stats(graph)
            self.eta += reasoning_efficiency(graph, c_min=self.c_min, dead_ends=self.dead_ends)
            self.traces += 1
            for name in self._STATS:
                getattr(self, name).add_(float(getattr(stats, name)))

    def compute(self) -> torch.Tensor | dict[str, torch.Tensor]:
        count = self.traces
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=count.device)
        eta = self.eta / count if count > 0 else nan
        if not self.return_stats:
            return eta
        out = {"eta": eta}
        for name in self._STATS:
            out[name] = getattr(self, name) / count if count > 0 else nan
        out["traces"], out["empty"] = count.clone(), self.empty.clone()
        return out
