r"""DualGraph memory for deep research (microsoft/DKI_LLM; docs/methods.md §17).

A research agent keeps two graphs and lets their *structure* decide what to search next:

- the **outline graph** — the report's sections, each with a search goal, keywords and the evidence gathered
  for it;
- the **knowledge graph** — entities and typed relations, each relation with the evidence (documents) that
  states it.

Each round: the planner turns *gaps* into queries → search → extract relations from the retrieved documents →
update the knowledge graph → detect communities → update the outline (attach communities to sections) → detect
new gaps. Gaps come from the knowledge graph's topology and from the outline:

============== ==========================================================================================
gap            query
============== ==========================================================================================
weak edge      a relation with fewer than ``min_evidence`` documents: both entity names
cross-community two communities with no relation between them: their hub entities (highest degree)
bridge         an articulation point of the graph (one entity holding two parts together): its name
outline        a section with fewer than ``min_evidence`` documents: its goal and keywords
============== ==========================================================================================

:class:`QueryQuota` caps each kind per round (the authors balance gap types with quotas; the numbers here are
ours, "(unverified)", and parameters). Queries already issued are never repeated. The loop stops after
``max_rounds`` rounds, after ``max_searches`` searches, or when the planner has nothing new to ask.

Pieces are swappable: the search backend is any :class:`~lightning_llm.envs.search.Retriever` (BM25 over an
offline corpus by default), the extractor and the planner are deterministic for tests or LLM-backed
(:class:`LLMBackend`: any causal LM's ``generate`` via :class:`CallableBackend`, or an OpenAI-compatible HTTP
endpoint via :class:`OpenAICompatibleBackend`). LLM output is only *parsed* (one item per line, strict
formats); malformed lines are dropped and counted, never executed. :func:`write_report` writes a report whose
every citation is checked against the evidence actually held.

:func:`synthetic_research_world` builds a ground-truth knowledge graph with communities and an offline corpus
stating its relations, so that relation recall per search can be measured (tutorial 13).

Modules:

- :mod:`~lightning_llm.evaluation.dualgraph.graphs`: the outline and knowledge graphs, gap detection;
- :mod:`~lightning_llm.evaluation.dualgraph.backends`: LLM backends (a ``generate`` function, an HTTP server);
- :mod:`~lightning_llm.evaluation.dualgraph.extractors`: relations from documents;
- :mod:`~lightning_llm.evaluation.dualgraph.planners`: the round's queries, from the gaps or from the outline;
- :mod:`~lightning_llm.evaluation.dualgraph.researcher`: the loop, and relation recall;
- :mod:`~lightning_llm.evaluation.dualgraph.report`: the cited report;
- :mod:`~lightning_llm.evaluation.dualgraph.world`: the synthetic research world.
"""

from lightning_llm.evaluation.dualgraph.backends import CallableBackend, LLMBackend, OpenAICompatibleBackend
from lightning_llm.evaluation.dualgraph.extractors import DeterministicExtractor, Extractor, LLMExtractor
from lightning_llm.evaluation.dualgraph.graphs import (
    Evidence,
    Gap,
    KnowledgeGraph,
    OutlineGraph,
    OutlineSection,
    Relation,
    detect_gaps,
)
from lightning_llm.evaluation.dualgraph.planners import (
    DeterministicPlanner,
    LLMPlanner,
    OutlineOnlyPlanner,
    Planner,
    QueryQuota,
)
from lightning_llm.evaluation.dualgraph.report import Report, write_report
from lightning_llm.evaluation.dualgraph.researcher import (
    DualGraphResearcher,
    ResearchTrace,
    recall_curve,
    relation_recall,
)
from lightning_llm.evaluation.dualgraph.world import ResearchWorld, synthetic_research_world

__all__ = [
    "CallableBackend",
    "DeterministicExtractor",
    "DeterministicPlanner",
    "DualGraphResearcher",
    "Evidence",
    "Extractor",
    "Gap",
    "KnowledgeGraph",
    "LLMBackend",
    "LLMExtractor",
    "LLMPlanner",
    "OpenAICompatibleBackend",
    "OutlineGraph",
    "OutlineOnlyPlanner",
    "OutlineSection",
    "Planner",
    "QueryQuota",
    "Relation",
    "Report",
    "ResearchTrace",
    "ResearchWorld",
    "detect_gaps",
    "recall_curve",
    "relation_recall",
    "synthetic_research_world",
    "write_report",
]
