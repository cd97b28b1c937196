"""The reasoning DAG of a trace.

:func:`build_reasoning_graph` makes a :class:`networkx.DiGraph` with a root node :data:`QUESTION_NODE` (the question:
givens and rules) and an edge from each dependency to the claim derived from it; claims without dependencies
hang off the root. Each claim carries its verdict (:func:`~lightning_llm.evaluation.reasoning_graph.verify_claims`).
The *answer claims* are the last assignment to each cell (what the trace finally says there); the *minimal claim
set* of the trace is the answer claims and all their ancestors, and every other claim is a *dead end*: nothing
that reaches the answer depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from lightning_llm.datamodules.tasks.puzzles import Cell, Grid, Puzzle
from lightning_llm.evaluation.reasoning_graph.parse import Claim
from lightning_llm.evaluation.reasoning_graph.verify import verify_claims

__all__ = ["QUESTION_NODE", "build_reasoning_graph"]

QUESTION_NODE = "question"
"""The root node of every reasoning graph: the puzzle's givens and rules."""


def _answer_claims(claims: Sequence[Claim]) -> set[int]:
    last: dict[Cell, int] = {}
    for claim in claims:
        if claim.kind == "assign":
            last[claim.cell] = claim.id
    return set(last.values())


def _final_grid(puzzle: Puzzle, claims: Sequence[Claim]) -> Grid:
    grid = [list(row) for row in puzzle.givens]
    n = puzzle.size
    for claim in claims:
        r, c = claim.cell
        if claim.kind == "assign" and 0 <= r < n and 0 <= c < n and puzzle.givens[r][c] == 0:
            grid[r][c] = claim.value
    return tuple(tuple(row) for row in grid)


def build_reasoning_graph(puzzle: Puzzle, claims: Sequence[Claim], answer: Grid | None = None) -> nx.DiGraph:
    """The reasoning DAG of a trace.

    Nodes: :data:`QUESTION_NODE` and one node per claim id, with attributes ``kind``, ``cell``, ``value``, ``label``,
    ``text``, ``correct``, ``unsupported``, ``answer`` (the last assignment to its cell), ``dead_end`` (not in
    the minimal claim set) and ``order`` (position in the trace). Edges go from each dependency to the claim
    derived from it, and from the root to every claim without dependencies.

    Graph attributes: ``size``, ``empty_cells`` (of the puzzle) and ``solved`` — whether the final grid is the
    solution: ``answer`` if given (the trace's ``<answer>`` block), else the givens completed by the last
    assignment to each cell.
    """
    ids = [c.id for c in claims]
    if len(set(ids)) != len(ids):
        raise ValueError("claim ids must be unique")
    known = set(ids)
    verdicts = {v.claim_id: v for v in verify_claims(puzzle, claims)}
    answers = _answer_claims(claims)
    g = nx.DiGraph()
    g.add_node(QUESTION_NODE, kind="root", label=QUESTION_NODE, order=-1)
    for i, claim in enumerate(claims):
        v = verdicts[claim.id]
        g.add_node(
            claim.id,
            kind=claim.kind,
            cell=claim.cell,
            value=claim.value,
            label=claim.label,
            text=claim.text,
            correct=v.correct,
            unsupported=v.unsupported,
            answer=claim.id in answers,
            order=i,
        )
        deps = [d for d in claim.depends_on if d in known and d != claim.id]
        for d in deps:
            g.add_edge(d, claim.id)
        if not deps:
            g.add_edge(QUESTION_NODE, claim.id)
    if not nx.is_directed_acyclic_graph(g):
        raise ValueError("the claims' dependencies form a cycle")
    needed = set(answers)
    for a in answers:
        needed |= nx.ancestors(g, a)
    needed.discard(QUESTION_NODE)
    for cid in ids:
        g.nodes[cid]["dead_end"] = cid not in needed
    final = answer if answer is not None else _final_grid(puzzle, claims)
    g.graph.update(size=puzzle.size, empty_cells=len(puzzle.empty_cells()), solved=puzzle.is_solution(final))
    return g
