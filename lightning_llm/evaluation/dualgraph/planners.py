"""Planners: a round's queries from the two graphs. Gap-driven (the method: :class:`DeterministicPlanner` with
its :class:`QueryQuota`, or :class:`LLMPlanner`) or from the outline alone (:class:`OutlineOnlyPlanner`, the
baseline)."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_llm.evaluation.dualgraph.backends import LLMBackend
from lightning_llm.evaluation.dualgraph.graphs import Gap, KnowledgeGraph, OutlineGraph, detect_gaps

__all__ = ["DeterministicPlanner", "LLMPlanner", "OutlineOnlyPlanner", "Planner", "QueryQuota"]


def _outline_queries(goal: str, keywords: Sequence[str]) -> list[str]:
    return [goal, *(f"{goal} {k}" for k in keywords)]


@dataclass(frozen=True)
class QueryQuota:
    """How many queries of each gap kind one round may issue (paper's balance; numbers "(unverified)")."""

    weak_edge: int = 2
    cross_community: int = 2
    bridge: int = 1
    outline: int = 1

    def __post_init__(self) -> None:
        for name in ("weak_edge", "cross_community", "bridge", "outline"):
            if getattr(self, name) < 0:
                raise ValueError(f"QueryQuota.{name} must be >= 0")


class Planner(ABC):
    """Decides a round's queries from the two graphs; must not return a query in ``issued``."""

    @abstractmethod
    def plan(
        self, kg: KnowledgeGraph, outline: OutlineGraph, issued: set[str], round_index: int
    ) -> list[str]: ...


class DeterministicPlanner(Planner):
    """Gap-driven (the method): up to the quota of each gap kind, most urgent first, skipping issued queries."""

    def __init__(self, quota: QueryQuota | None = None, *, min_evidence: int = 2, seed: int = 0) -> None:
        self.quota, self.min_evidence, self.seed = quota or QueryQuota(), min_evidence, seed

    def plan(
        self, kg: KnowledgeGraph, outline: OutlineGraph, issued: set[str], round_index: int
    ) -> list[str]:
        left = {k: getattr(self.quota, k) for k in ("weak_edge", "cross_community", "bridge", "outline")}
        queries: list[str] = []
        gaps = detect_gaps(kg, outline, min_evidence=self.min_evidence, seed=self.seed)
        if not kg.relations:  # nothing to reason about yet: every section is a gap
            gaps = [Gap("outline", (s.goal, *s.keywords), "empty graph") for s in outline.sections]
            left["outline"] = sum(left.values())
        for gap in gaps:
            if left[gap.kind] <= 0:
                continue
            # an outline gap is searched with its goal, then its goal and one keyword at a time
            options = [gap.query] if gap.kind != "outline" else _outline_queries(gap.terms[0], gap.terms[1:])
            q = next((o for o in options if o not in issued and o not in queries), None)
            if q is not None:
                queries.append(q)
                left[gap.kind] -= 1
        return queries


class OutlineOnlyPlanner(Planner):
    """The baseline: queries from the outline alone — each section's goal, then its goal with one keyword at
    a time, round-robin over sections, ``per_round`` per round."""

    def __init__(self, per_round: int = 6) -> None:
        if per_round < 1:
            raise ValueError("per_round must be >= 1")
        self.per_round = per_round

    def plan(
        self, kg: KnowledgeGraph, outline: OutlineGraph, issued: set[str], round_index: int
    ) -> list[str]:
        per_section = [_outline_queries(s.goal, s.keywords) for s in outline.sections]
        depth = max(len(q) for q in per_section)
        candidates = [q[level] for level in range(depth) for q in per_section if level < len(q)]
        fresh = [q for q in dict.fromkeys(candidates) if q not in issued]
        return fresh[: self.per_round]


_PLAN_PROMPT = (
    "You are researching: {title}.\nKnown gaps:\n{gaps}\n\n"
    "Write up to {n} search queries, one per line, each starting with 'query:'."
)
_QUERY = re.compile(r"^\s*query:\s*(.{2,120}?)\s*$", re.IGNORECASE)


class LLMPlanner(Planner):
    """An LLM proposes queries from the detected gaps; lines must read ``query: <text>`` (others are dropped
    and counted in ``dropped``). Falls back to :class:`DeterministicPlanner` when nothing parses."""

    def __init__(
        self, backend: LLMBackend, per_round: int = 6, *, min_evidence: int = 2, seed: int = 0
    ) -> None:
        self.backend, self.per_round = backend, per_round
        self.fallback = DeterministicPlanner(min_evidence=min_evidence, seed=seed)
        self.min_evidence, self.seed = min_evidence, seed
        self.dropped = 0

    def plan(
        self, kg: KnowledgeGraph, outline: OutlineGraph, issued: set[str], round_index: int
    ) -> list[str]:
        gaps = detect_gaps(kg, outline, min_evidence=self.min_evidence, seed=self.seed)[:12]
        listing = (
            "\n".join(f"- {g.kind}: {g.reason} (terms: {', '.join(g.terms)})" for g in gaps) or "- none yet"
        )
        answer = self.backend.complete(
            [_PLAN_PROMPT.format(title=outline.title, gaps=listing, n=self.per_round)]
        )[0]
        queries = []
        for line in answer.splitlines():
            m = _QUERY.match(line)
            if m is None:
                self.dropped += bool(line.strip())
            elif m.group(1) not in issued and m.group(1) not in queries:
                queries.append(m.group(1))
        return queries[: self.per_round] or self.fallback.plan(kg, outline, issued, round_index)
