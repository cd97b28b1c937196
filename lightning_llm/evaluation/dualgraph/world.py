"""A synthetic research world: a ground-truth knowledge graph with topic communities, an offline corpus that
states it, and an outline to start from, so that relation recall per search can be measured (tutorial 13)."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from lightning_llm.envs.search import Doc
from lightning_llm.evaluation.dualgraph.graphs import (
    Evidence,
    KnowledgeGraph,
    OutlineGraph,
    OutlineSection,
    Triple,
)

__all__ = ["ResearchWorld", "synthetic_research_world"]


@dataclass
class ResearchWorld:
    """A ground-truth knowledge graph, a corpus that states it, an outline to start from."""

    truth: set[Triple]
    docs: list[Doc]
    topics: list[str]
    community_of: dict[str, int]
    relations: tuple[str, ...]

    def outline(self) -> OutlineGraph:
        """A fresh outline: one section per topic, goal "<topic> research", generic keywords."""
        return OutlineGraph(
            "a survey of the field",
            [OutlineSection(t.title(), f"{t} research", list(_KEYWORDS)) for t in self.topics],
        )

    def truth_graph(self) -> KnowledgeGraph:
        kg = KnowledgeGraph()
        for i, (h, r, t) in enumerate(sorted(self.truth)):
            kg.add(h, r, t, Evidence(-1 - i, "truth", ""))
        return kg


_KEYWORDS = ("mechanisms", "findings", "review")
_TOPICS = ("marine", "solar", "forest", "quantum", "desert", "arctic", "volcanic", "urban")
_RELATIONS = ("regulates", "inhibits", "binds", "activates", "precedes")
_SYLLABLES = ("ka", "lo", "mi", "ru", "te", "sa", "vo", "ni", "ze", "pa", "do", "li", "fe", "gu", "ro", "xa")


def synthetic_research_world(
    seed: int = 0,
    *,
    num_communities: int = 4,
    entities_per_community: int = 8,
    intra_relations: int = 12,
    inter_relations: int = 4,
    overview_docs: int = 2,
    distractor_docs: int = 8,
) -> ResearchWorld:
    """A seeded research world: topic communities of entities, dense relations inside a topic, a few across.

    The corpus (design, stated so that results can be judged):

    - one **relation document** per true relation: "``<Head> <relation> <Tail>.``" plus a sentence naming its
      topic(s) once (cross-community relations name both topics);
    - ``overview_docs`` **overview documents** per topic: the topic word and the outline's generic keywords
      many times, and one relation of the topic's best-connected entities each — what a topic query finds first;
    - ``distractor_docs`` documents with topic words and no relation.

    So a topic query (the outline's) ranks overviews and distractors first, and the rest of what it finds is
    whichever relation documents BM25 prefers for that topic word; a query naming entities finds documents about
    those entities. Nothing makes topic queries fail by construction: they do find relations, only with
    diminishing returns.
    """
    if num_communities < 2 or num_communities > len(_TOPICS):
        raise ValueError(f"num_communities must be in 2..{len(_TOPICS)}")
    if entities_per_community < 3:
        raise ValueError("entities_per_community must be >= 3")
    rng = random.Random(seed)
    topics = list(_TOPICS[:num_communities])
    names: set[str] = set()
    members: list[list[str]] = []
    for _ in topics:
        group = []
        while len(group) < entities_per_community:
            name = "".join(rng.choice(_SYLLABLES) for _ in range(3)).capitalize()
            if name not in names:
                names.add(name)
                group.append(name)
        members.append(group)
    community_of = {e: i for i, g in enumerate(members) for e in g}
    truth: set[Triple] = set()
    pairs: set[frozenset[str]] = set()

    def relate(h: str, t: str) -> bool:
        if h == t or frozenset((h, t)) in pairs:
            return False
        pairs.add(frozenset((h, t)))
        truth.add((h, rng.choice(_RELATIONS), t))
        return True

    for group in members:
        for a, b in itertools.pairwise(group):  # a path keeps the topic connected
            relate(a, b)
        while (
            sum(1 for h, _, t in truth if community_of[h] == community_of[t] == members.index(group))
            < intra_relations
        ):
            relate(*rng.sample(group, 2))
    cross = 0
    while cross < inter_relations:
        i, j = rng.sample(range(num_communities), 2)
        cross += relate(rng.choice(members[i]), rng.choice(members[j]))

    docs: list[Doc] = []
    for h, r, t in sorted(truth):
        ti, tj = topics[community_of[h]], topics[community_of[t]]
        keyword = rng.choice(_KEYWORDS)
        context = f"From {ti} research on {keyword}." if ti == tj else f"It links {ti} and {tj} research."
        docs.append(Doc(f"On {h} and {t}", f"{h} {r} {t}. {context} Further work is needed."))
    for c, topic in enumerate(topics):
        degree = {e: sum(e in (h, t) for h, _, t in truth) for e in members[c]}
        hubs = sorted(members[c], key=lambda e: (-degree[e], e))[:2]
        hub_rels = sorted(x for x in truth if x[0] in hubs and community_of[x[2]] == c)
        for k in range(overview_docs):
            rel = hub_rels[k % len(hub_rels)] if hub_rels else None
            stated = f" {rel[0]} {rel[1]} {rel[2]}." if rel else ""
            docs.append(
                Doc(
                    f"{topic.title()} research review {k + 1}",
                    f"A review of {topic} research: {topic} mechanisms, {topic} findings and open {topic} "
                    f"questions.{stated} The {topic} field grows.",
                )
            )
    for k in range(distractor_docs):
        topic = topics[k % num_communities]
        docs.append(
            Doc(f"News {k + 1}", f"A {topic} research meeting discussed {topic} funding and mechanisms.")
        )
    rng.shuffle(docs)
    return ResearchWorld(truth, docs, topics, community_of, _RELATIONS)
