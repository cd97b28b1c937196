"""The two graphs of DualGraph — the outline (:class:`OutlineGraph`) and the knowledge graph
(:class:`KnowledgeGraph`) — and the gaps their structure shows (:func:`detect_gaps`, kinds in the table of
:mod:`~lightning_llm.evaluation.dualgraph`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import networkx as nx

__all__ = [
    "Evidence",
    "Gap",
    "GapKind",
    "KnowledgeGraph",
    "OutlineGraph",
    "OutlineSection",
    "Relation",
    "Triple",
    "detect_gaps",
]

Triple = tuple[str, str, str]
GapKind = Literal["weak_edge", "cross_community", "bridge", "outline"]


@dataclass(frozen=True)
class Evidence:
    """A document that states something: its index in the corpus, title and the supporting snippet."""

    doc_id: int
    title: str
    snippet: str


@dataclass
class Relation:
    """``head --relation--> tail`` with the documents that state it."""

    head: str
    relation: str
    tail: str
    evidence: list[Evidence] = field(default_factory=list)

    @property
    def triple(self) -> Triple:
        return (self.head, self.relation, self.tail)


class KnowledgeGraph:
    """Entities and evidenced relations. Topology questions (communities, bridges, hubs) are asked of the
    undirected entity graph, where an edge's weight is the number of documents behind it."""

    def __init__(self) -> None:
        self.relations: dict[Triple, Relation] = {}

    def add(self, head: str, relation: str, tail: str, evidence: Evidence) -> bool:
        """Add a relation or more evidence for it; returns whether the relation is new. Evidence from a
        document already recorded for the relation is not counted twice."""
        if not head or not tail or head == tail:
            raise ValueError(f"a relation needs two different entities, got {head!r} and {tail!r}")
        key = (head, relation, tail)
        new = key not in self.relations
        rel = self.relations.setdefault(key, Relation(head, relation, tail))
        if all(e.doc_id != evidence.doc_id for e in rel.evidence):
            rel.evidence.append(evidence)
        return new

    @property
    def entities(self) -> set[str]:
        return {e for r in self.relations.values() for e in (r.head, r.tail)}

    def graph(self) -> nx.Graph:
        g = nx.Graph()
        for r in self.relations.values():
            weight = len(r.evidence) + (g[r.head][r.tail]["weight"] if g.has_edge(r.head, r.tail) else 0)
            g.add_edge(r.head, r.tail, weight=weight)
        return g

    def communities(self, seed: int = 0) -> list[set[str]]:
        """Louvain communities (networkx, seeded), largest first, ties by their smallest member."""
        g = self.graph()
        if g.number_of_nodes() == 0:
            return []
        found = nx.algorithms.community.louvain_communities(g, weight="weight", seed=seed)
        return sorted((set(c) for c in found), key=lambda c: (-len(c), min(c)))

    def weak_relations(self, min_evidence: int = 2) -> list[Relation]:
        return sorted(
            (r for r in self.relations.values() if len(r.evidence) < min_evidence),
            key=lambda r: (len(r.evidence), r.triple),
        )

    def bridges(self) -> list[str]:
        """Articulation points: entities whose removal disconnects part of the graph, by degree."""
        g = self.graph()
        return sorted(nx.articulation_points(g), key=lambda n: (-g.degree(n), n))

    def hubs(self, members: set[str] | None = None) -> list[str]:
        """Entities by degree (highest first), optionally among ``members``."""
        g = self.graph()
        nodes = [n for n in g.nodes if members is None or n in members]
        return sorted(nodes, key=lambda n: (-g.degree(n), n))


@dataclass
class OutlineSection:
    """A section of the report: what to find (``goal``), words to search with, and what was found."""

    title: str
    goal: str
    keywords: list[str] = field(default_factory=list)
    evidence: set[int] = field(default_factory=set)
    entities: set[str] = field(default_factory=set)


class OutlineGraph:
    """The report outline as a tree (root → sections), with evidence per section."""

    def __init__(self, title: str, sections: Sequence[OutlineSection]) -> None:
        if not sections:
            raise ValueError("an outline needs at least one section")
        self.title = title
        self.sections = list(sections)
        self.tree = nx.DiGraph()
        self.tree.add_node(title)
        for s in self.sections:
            self.tree.add_edge(title, s.title)

    def attach(self, communities: Sequence[set[str]], kg: KnowledgeGraph) -> None:
        """Outline update: each KG community goes to the section holding most of its evidence documents."""
        docs_of = {e: set() for e in kg.entities}
        for r in kg.relations.values():
            for ev in r.evidence:
                docs_of[r.head].add(ev.doc_id)
                docs_of[r.tail].add(ev.doc_id)
        for s in self.sections:
            s.entities.clear()
        for community in communities:
            docs = set().union(*(docs_of[e] for e in community))
            best = max(self.sections, key=lambda s: (len(s.evidence & docs), -self.sections.index(s)))
            best.entities |= community

    def thin_sections(self, min_evidence: int) -> list[OutlineSection]:
        return [s for s in self.sections if len(s.evidence) < min_evidence]


@dataclass(frozen=True)
class Gap:
    """Something the graphs say is missing: its kind, the terms to search with, and why."""

    kind: GapKind
    terms: tuple[str, ...]
    reason: str

    @property
    def query(self) -> str:
        return " ".join(self.terms)


def detect_gaps(
    kg: KnowledgeGraph, outline: OutlineGraph, *, min_evidence: int = 2, seed: int = 0
) -> list[Gap]:
    """All gaps, in the table's order of kinds; within a kind, most urgent first."""
    gaps = [
        Gap("weak_edge", (r.head, r.tail), f"{r.head} {r.relation} {r.tail} has {len(r.evidence)} source(s)")
        for r in kg.weak_relations(min_evidence)
    ]
    communities = kg.communities(seed)
    g = kg.graph()
    label = {e: i for i, c in enumerate(communities) for e in c}
    linked = {frozenset((label[u], label[v])) for u, v in g.edges if label[u] != label[v]}
    for i in range(len(communities)):
        for j in range(i + 1, len(communities)):
            if frozenset((i, j)) not in linked:
                a, b = kg.hubs(communities[i])[0], kg.hubs(communities[j])[0]
                gaps.append(
                    Gap("cross_community", (a, b), f"no relation yet between communities {i} and {j}")
                )
    gaps += [Gap("bridge", (n,), f"{n} alone connects parts of the graph") for n in kg.bridges()]
    gaps += [
        Gap("outline", (s.goal, *s.keywords), f"section {s.title!r} has {len(s.evidence)} source(s)")
        for s in outline.thin_sections(min_evidence)
    ]
    return gaps
