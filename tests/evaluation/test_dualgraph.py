"""DualGraph: graph schemas, gap detection, quotas, strict LLM parsing, the offline loop, cited reports, and the
claim — gap-driven queries recover more true relations per search than outline-only queries."""

from __future__ import annotations

import io
import json
import re
import urllib.request

import numpy as np
import pytest

from lightning_llm.envs.search import Doc
from lightning_llm.evaluation import (
    CallableBackend,
    DeterministicExtractor,
    DeterministicPlanner,
    DualGraphResearcher,
    Evidence,
    KnowledgeGraph,
    LLMExtractor,
    LLMPlanner,
    OpenAICompatibleBackend,
    OutlineGraph,
    OutlineOnlyPlanner,
    OutlineSection,
    QueryQuota,
    detect_gaps,
    recall_curve,
    relation_recall,
    synthetic_research_world,
    write_report,
)


def _ev(i: int) -> Evidence:
    return Evidence(i, f"doc {i}", "")


def _two_triangles() -> KnowledgeGraph:
    """Two well-evidenced triangles joined through one bridge entity ``C`` -- ``D``, one weak edge."""
    kg = KnowledgeGraph()
    for h, t in (("A", "B"), ("B", "C"), ("A", "C"), ("D", "E"), ("E", "F"), ("D", "F")):
        kg.add(h, "binds", t, _ev(1))
        kg.add(h, "binds", t, _ev(2))
    kg.add("C", "activates", "D", _ev(3))  # one source only, and the only link between the triangles
    return kg


def test_knowledge_graph_merges_evidence_and_rejects_self_loops():
    kg = KnowledgeGraph()
    assert kg.add("A", "binds", "B", _ev(1)) is True
    assert kg.add("A", "binds", "B", _ev(1)) is False  # same document: not counted twice
    assert kg.add("A", "binds", "B", _ev(2)) is False
    assert [e.doc_id for e in kg.relations[("A", "binds", "B")].evidence] == [1, 2]
    with pytest.raises(ValueError, match="two different entities"):
        kg.add("A", "binds", "A", _ev(3))


def test_gap_detection_on_a_hand_built_graph():
    kg = _two_triangles()
    kg.add("X", "binds", "Y", _ev(4))  # a third, disconnected component
    kg.add("X", "binds", "Y", _ev(5))
    outline = OutlineGraph(
        "t", [OutlineSection("S", "s goal", ["k"], evidence={1, 2}), OutlineSection("T", "t goal")]
    )
    gaps = detect_gaps(kg, outline, min_evidence=2)
    by_kind = {
        k: [g for g in gaps if g.kind == k] for k in ("weak_edge", "cross_community", "bridge", "outline")
    }
    assert [g.terms for g in by_kind["weak_edge"]] == [("C", "D")]
    assert {"C", "D"} <= {g.terms[0] for g in by_kind["bridge"]}
    # {X, Y} is linked to neither triangle: two missing cross-community links at least
    assert sum("X" in g.terms or "Y" in g.terms for g in by_kind["cross_community"]) >= 2
    assert [g.terms[0] for g in by_kind["outline"]] == ["t goal"]  # the section without evidence


def test_planner_respects_quotas_and_never_repeats_a_query():
    kg = _two_triangles()
    kg.add("X", "binds", "Y", _ev(4))
    outline = OutlineGraph("t", [OutlineSection("S", "s goal", ["k1", "k2"])])
    planner = DeterministicPlanner(QueryQuota(weak_edge=1, cross_community=1, bridge=0, outline=1))
    first = planner.plan(kg, outline, set(), 0)
    assert len(first) == 3 and len(set(first)) == 3
    assert first[-1] == "s goal"
    second = planner.plan(kg, outline, set(first), 1)
    assert not set(second) & set(first)
    assert "s goal k1" in second  # the outline gap moves on to its next keyword
    with pytest.raises(ValueError, match=r"QueryQuota\.bridge"):
        QueryQuota(bridge=-1)


def test_outline_only_planner_exhausts_its_language():
    outline = OutlineGraph("t", [OutlineSection("A", "a", ["x"]), OutlineSection("B", "b", ["y"])])
    planner = OutlineOnlyPlanner(per_round=3)
    issued: set[str] = set()
    rounds = []
    while queries := planner.plan(KnowledgeGraph(), outline, issued, len(rounds)):
        rounds.append(queries)
        issued |= set(queries)
    assert rounds == [["a", "b", "a x"], ["b y"]]


def test_llm_output_is_parsed_strictly():
    docs = [Doc("d", "Kalo binds Rute. Nothing else.")]
    answers = [
        "Kalo | binds | Rute\nnonsense\nKalo | eats | Rute\nKalo | binds | Ghost\nimport os | binds | Rute"
    ]
    extractor = LLMExtractor(CallableBackend(lambda prompts: answers), ["binds"])
    assert extractor.extract(docs) == [[("Kalo", "binds", "Rute")]]
    assert extractor.dropped == 4  # malformed, unknown relation, entity not in the text, code-looking entity

    planner = LLMPlanner(
        CallableBackend(lambda prompts: ["query: kalo rute\nrm -rf /\nQUERY: marine\nquery: kalo rute"])
    )
    outline = OutlineGraph("t", [OutlineSection("S", "s goal")])
    assert planner.plan(KnowledgeGraph(), outline, {"marine"}, 0) == ["kalo rute"]
    assert planner.dropped == 1
    silent = LLMPlanner(CallableBackend(lambda prompts: ["I cannot help"]))
    assert silent.plan(KnowledgeGraph(), outline, set(), 0) == ["s goal"]  # falls back to the gap planner

    with pytest.raises(ValueError, match="answered 0 of 1"):
        CallableBackend(lambda prompts: []).complete(["x"])


def test_openai_compatible_backend_speaks_the_chat_completions_protocol(monkeypatch):
    seen = {}

    def fake_urlopen(request, timeout):
        seen["url"], seen["body"] = request.full_url, json.loads(request.data)
        seen["auth"] = request.get_header("Authorization")
        reply = {"choices": [{"message": {"role": "assistant", "content": "query: kalo"}}]}
        return io.BytesIO(json.dumps(reply).encode())

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    backend = OpenAICompatibleBackend("http://localhost:8000/v1/", "m", api_key="k")
    assert backend.complete(["hello"]) == ["query: kalo"]
    assert seen["url"] == "http://localhost:8000/v1/chat/completions"
    assert seen["body"]["messages"] == [{"role": "user", "content": "hello"}] and seen["body"]["model"] == "m"
    assert seen["auth"] == "Bearer k"
    monkeypatch.setattr(urllib.request, "urlopen", lambda request, timeout: io.BytesIO(b'{"error": "x"}'))
    with pytest.raises(ValueError, match="unexpected response"):
        backend.complete(["hello"])
    with pytest.raises(ValueError, match="http"):
        OpenAICompatibleBackend("localhost:8000", "m")


def _run(world, planner, searches=16, seed=0):
    researcher = DualGraphResearcher(
        world.docs,
        world.outline(),
        planner,
        DeterministicExtractor(world.relations),
        max_searches=searches,
        seed=seed,
    )
    return researcher.run()


def test_whole_loop_runs_offline_and_deterministically():
    world = synthetic_research_world(0)
    a, b = _run(world, DeterministicPlanner()), _run(world, DeterministicPlanner())
    assert a.queries == b.queries and a.new_triples == b.new_triples
    assert a.searches == 16 and a.rounds >= 3
    assert set(a.kg.relations) <= world.truth  # the extractor never invents relations
    assert all(len(ids) <= 3 for ids in a.retrieved)
    curve = recall_curve(a, world.truth)
    assert curve == sorted(curve) and curve[-1] == relation_recall(a.kg, world.truth)
    assert any(s.entities for s in a.outline.sections)  # communities were attached to sections


def test_report_cites_only_evidence_it_holds():
    world = synthetic_research_world(1)
    trace = _run(world, DeterministicPlanner())
    report = write_report(trace.kg, trace.outline)
    cited = {int(n) for n in re.findall(r"\[(\d+)\]", report.markdown.split("## References")[0])}
    assert cited and cited == set(report.references)
    held = {e.doc_id for r in trace.kg.relations.values() for e in r.evidence}
    assert {ev.doc_id for ev in report.references.values()} <= held

    def liar(prompts):  # cites one real and one invented source
        return [f"Facts [1] and fiction [{999 + i}]." for i, _ in enumerate(prompts)]

    written = write_report(trace.kg, trace.outline, CallableBackend(liar))
    assert "[999]" not in written.markdown and written.invalid_citations >= 1
    assert set(written.references) <= set(report.references) | {1}


def test_gap_driven_queries_recover_more_relations_per_search_than_outline_only():
    """At the same number of searches (16: all the outline-only planner has to ask), over three worlds."""
    gains = []
    for seed in (0, 1, 2):
        world = synthetic_research_world(seed)
        gap = relation_recall(_run(world, DeterministicPlanner(), seed=seed).kg, world.truth)
        outline = _run(world, OutlineOnlyPlanner(), seed=seed)
        assert outline.searches == 16
        gains.append(gap - relation_recall(outline.kg, world.truth))
    # observed: +0.08 .. +0.21 recall (of 52 relations) at 16 searches
    assert min(gains) > 0.03 and float(np.mean(gains)) > 0.07


def test_bad_inputs_fail_clearly():
    with pytest.raises(ValueError, match="corpus is empty"):
        DualGraphResearcher(
            [],
            OutlineGraph("t", [OutlineSection("S", "s")]),
            OutlineOnlyPlanner(),
            DeterministicExtractor(["x"]),
        )
    with pytest.raises(ValueError, match="at least one section"):
        OutlineGraph("t", [])
    with pytest.raises(ValueError, match="num_communities"):
        synthetic_research_world(0, num_communities=1)
    with pytest.raises(ValueError, match="ground truth is empty"):
        relation_recall(set(), set())
