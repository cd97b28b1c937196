"""The DualGraph loop (:class:`DualGraphResearcher`), what a run did (:class:`ResearchTrace`), and how much of a
ground truth it found (:func:`relation_recall`, :func:`recall_curve`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_llm.envs.search import BM25Retriever, Doc, Retriever
from lightning_llm.evaluation.dualgraph.extractors import Extractor
from lightning_llm.evaluation.dualgraph.graphs import Evidence, KnowledgeGraph, OutlineGraph, Triple
from lightning_llm.evaluation.dualgraph.planners import Planner

__all__ = ["DualGraphResearcher", "ResearchTrace", "recall_curve", "relation_recall"]


@dataclass
class ResearchTrace:
    """What a run did: every search (query, retrieved doc ids, triples first found by it) and the graphs."""

    queries: list[str] = field(default_factory=list)
    retrieved: list[list[int]] = field(default_factory=list)
    new_triples: list[list[Triple]] = field(default_factory=list)
    rounds: int = 0
    kg: KnowledgeGraph = field(default_factory=KnowledgeGraph)
    outline: OutlineGraph | None = None

    @property
    def searches(self) -> int:
        return len(self.queries)


class DualGraphResearcher:
    """Runs the DualGraph loop over a corpus.

    Args:
        docs: The offline corpus (searched with ``retriever``, default BM25 over it).
        outline: The initial outline (its sections' evidence and entities are filled in by the run).
        planner: Gap-driven (:class:`DeterministicPlanner`, :class:`LLMPlanner`) or :class:`OutlineOnlyPlanner`.
        extractor: Relations from documents.
        k: Documents per search.
        max_rounds, max_searches: Stopping rules (a round is cut short at ``max_searches``).
        seed: Community detection seed.
    """

    def __init__(
        self,
        docs: Sequence[Doc],
        outline: OutlineGraph,
        planner: Planner,
        extractor: Extractor,
        *,
        retriever: Retriever | None = None,
        k: int = 3,
        max_rounds: int = 10,
        max_searches: int = 40,
        seed: int = 0,
    ) -> None:
        if not docs:
            raise ValueError("the corpus is empty")
        if k < 1 or max_rounds < 1 or max_searches < 1:
            raise ValueError("k, max_rounds and max_searches must be >= 1")
        self.docs = list(docs)
        self._index = {(d.title, d.text): i for i, d in enumerate(self.docs)}
        self.retriever = retriever or BM25Retriever(self.docs)
        self.outline, self.planner, self.extractor = outline, planner, extractor
        self.k, self.max_rounds, self.max_searches, self.seed = k, max_rounds, max_searches, seed

    def run(self) -> ResearchTrace:
        trace = ResearchTrace(outline=self.outline)
        issued: set[str] = set()
        section_of = {s.goal: s for s in self.outline.sections}
        for round_index in range(self.max_rounds):
            queries = self.planner.plan(trace.kg, self.outline, issued, round_index)
            queries = [q for q in queries if q not in issued][: self.max_searches - trace.searches]
            if not queries:
                break
            trace.rounds += 1
            for query in queries:
                issued.add(query)
                hits = self.retriever.search(query, self.k)
                ids = [self._index[(d.title, d.text)] for d in hits]
                new = []
                for doc_id, doc, triples in zip(ids, hits, self.extractor.extract(hits), strict=True):
                    for h, r, t in triples:
                        if trace.kg.add(h, r, t, Evidence(doc_id, doc.title, _snippet(doc.text, h, t))):
                            new.append((h, r, t))
                # a section gets the evidence of the queries made for it (its goal starts the query)
                for goal, section in section_of.items():
                    if query.startswith(goal):
                        section.evidence.update(ids)
                trace.queries.append(query)
                trace.retrieved.append(ids)
                trace.new_triples.append(new)
            self.outline.attach(trace.kg.communities(self.seed), trace.kg)
            for section in self.outline.sections:  # evidence of the relations now attached to the section
                for r in trace.kg.relations.values():
                    if r.head in section.entities or r.tail in section.entities:
                        section.evidence.update(e.doc_id for e in r.evidence)
            if trace.searches >= self.max_searches:
                break
        return trace


def _snippet(text: str, head: str, tail: str) -> str:
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        if head in sentence and tail in sentence:
            return sentence
    return text[:160]


def relation_recall(found: set[Triple] | KnowledgeGraph, truth: set[Triple]) -> float:
    """Fraction of the true relations found."""
    if not truth:
        raise ValueError("the ground truth is empty")
    triples = set(found.relations) if isinstance(found, KnowledgeGraph) else set(found)
    return len(triples & truth) / len(truth)


def recall_curve(trace: ResearchTrace, truth: set[Triple]) -> list[float]:
    """Relation recall after each search."""
    seen: set[Triple] = set()
    curve = []
    for new in trace.new_triples:
        seen.update(new)
        curve.append(len(seen & truth) / len(truth))
    return curve
