r"""The flow efficiency η of a reasoning graph (one documented reading) and its structure statistics.

Graphs come from :func:`~lightning_llm.evaluation.reasoning_graph.build_reasoning_graph`, which marks the
minimal claim set and the dead ends.

The paper scores the concentration of the logical flow with the structural entropy of an absorbing Markov chain
on the graph, relative to the minimal claim set; its exact formula is not verified here. This module implements
the following reading (:func:`visitation`, :func:`reasoning_efficiency`):

1. A walker starts at the root and at each node moves along a uniformly chosen out-edge (to a claim derived
   from the current one). The last claims of the minimal set (those without a successor in it) also have an
   edge to a virtual absorbing state :math:`\Omega`, "done". A dead end without out-edges sends the walker back
   to where its dead branch left the minimal set (root included), which chooses again (``dead_ends="backtrack"``,
   the default). With :math:`Q` the transitions among the root and the claims (all transient),

   .. math:: N = (I - Q)^{-1} .

2. The visitation of claim :math:`j` is :math:`N_{\mathrm{root},j}`, the expected number of visits; the root is
   not counted. Normalising over the claims gives :math:`p_j`, and

   .. math:: H = -\sum_j p_j \log p_j, \qquad \eta = \frac{\log |C_{\min}|}{H} .

3. :math:`|C_{\min}|` is a parameter: ``"ancestors"`` (default) is the size of the trace's own minimal claim
   set, the answer claims and their ancestors; ``"empty_cells"`` is the number of empty cells, the fewest
   assignments that can state the solution at all; an ``int`` is used as given.

Why backtracking: in the plain reading (``dead_ends="absorb"``: every leaf absorbing, :math:`p \propto
N_{\mathrm{root}}` together with the absorption probabilities of the leaves) a walker that enters a dead end
stops, so dead ends near the root *concentrate* the visitation on the first claims and *raise* η: on random
chains with dead-end trees, a third to a half score at or above a dead-end-free chain of the same length
(tutorial 11: 51% of 500; with backtracking, none). Restarting from the root
instead does not help: the restarts are independent copies of the same walk and scale every visit alike.
With backtracking, when each dead branch is a tree entered from one claim, the walker's path through the
minimal set is distributed as it would be without the dead ends, and a dead branch entered from claim :math:`v`
draws visitation of at most :math:`N_{\mathrm{root},v}` divided by :math:`v`'s number of useful out-edges.

What η measures and what it does not:

- **It is not bounded by 1.** :math:`H \le \log(\#\text{claims})`, with equality iff the visitation is
  uniform (a chain, a star), so under ``"ancestors"`` a trace without dead ends has :math:`\eta \ge 1`, with
  equality for a chain; branching lets the walk skip parallel claims, concentrates :math:`p` and pushes η above
  1. A trace with dead ends has :math:`|C_{\min}|` below its number of claims while its dead ends draw
  visitation, which pulls η down: a chain of :math:`m` claims with dead-end branches (trees, each entered from
  one claim) has uniform-or-lighter dead-end visitation, hence :math:`H > \log m` and :math:`\eta < 1`, below a
  chain of the same total length. On general DAGs this is not a theorem: a dead end hanging off a heavily
  visited claim can carry more than the average visitation and lower :math:`H`, and two traces of one length
  also differ in how parallel their useful claims are. Tutorial 11 measures how often a focused trace beats a
  meandering one of the same length; the differences are small (a few hundredths), because
  :math:`\log|C_{\min}|` moves slowly.
- η compares traces *of one puzzle and similar length*; it is not an absolute score, and across puzzles it also
  moves with how parallel the puzzle's deductions are. ``"empty_cells"`` makes the numerator the same for both
  traces, so only :math:`H` separates them, and then a focused trace does *not* reliably score higher.
- It sees only the graph: how claims depend on each other, not whether a dependency really entails its claim
  (the verifier checks each claim's truth, not the inference), and not the number of tokens spent.
- Edge cases: one claim that is its own minimal set scores 1 (:math:`0/0`); no answer claim (no assignment)
  scores 0; an empty trace has no η (NaN).

:func:`structure_stats` adds simple statistics (depth, branching, dead-end and false-claim fractions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import networkx as nx
import numpy as np

from lightning_llm.evaluation.reasoning_graph.graph import QUESTION_NODE

__all__ = ["CMin", "DeadEnds", "StructureStats", "reasoning_efficiency", "structure_stats", "visitation"]

CMin = Literal["ancestors", "empty_cells"] | int
DeadEnds = Literal["backtrack", "absorb"]


def _claims_of(graph: nx.DiGraph) -> list[Any]:
    return sorted((n for n in graph.nodes if n != QUESTION_NODE), key=lambda n: graph.nodes[n]["order"])


def _branch_points(graph: nx.DiGraph, leaf: Any) -> list[Any]:
    """Where the dead region holding ``leaf`` was entered: the non-dead predecessors (root or minimal-set
    claims) of ``leaf`` and of its dead ancestors."""
    region = {leaf} | {
        a for a in nx.ancestors(graph, leaf) if a != QUESTION_NODE and graph.nodes[a]["dead_end"]
    }
    entries = {
        p
        for y in region
        for p in graph.predecessors(y)
        if p == QUESTION_NODE or not graph.nodes[p]["dead_end"]
    }
    return sorted(entries, key=lambda n: graph.nodes[n]["order"])


def visitation(graph: nx.DiGraph, *, dead_ends: DeadEnds = "backtrack") -> dict[Any, float]:
    r"""The normalised visitation :math:`p_j` of each claim by the absorbing walk from the root (module
    docstring), in trace order; empty for a graph without claims.

    Every claim is a transient state and a virtual state :math:`\Omega` ("done") is the only absorbing one;
    with :math:`Q` the transitions among the root and the claims, the visits are row root of
    :math:`N = (I - Q)^{-1}`, divided by their sum over the claims (the root is not counted).

    Args:
        graph: From :func:`build_reasoning_graph`.
        dead_ends: ``"backtrack"``: the minimal-set claims without a minimal-set successor get an extra edge to
            :math:`\Omega`, and a dead end without out-edges sends the walker back to a uniformly chosen branch
            point of its dead region (:func:`_branch_points`), which picks one of its own out-edges again
            (the branch is abandoned; the branch point is not counted twice). ``"absorb"``: every claim without
            out-edges goes to :math:`\Omega` (the plain reading, in which a walk that enters a dead end stops
            there). Both agree on graphs without dead ends.
    """
    if dead_ends not in ("backtrack", "absorb"):
        raise ValueError(f"dead_ends must be 'backtrack' or 'absorb', got {dead_ends!r}")
    claims = _claims_of(graph)
    if not claims:
        return {}
    useful = {n for n in claims if not graph.nodes[n]["dead_end"]}
    if not useful:
        dead_ends = "absorb"  # nothing reaches an answer, so nothing to backtrack towards
    states = [QUESTION_NODE, *claims]
    index = {n: i for i, n in enumerate(states)}
    q = np.zeros((len(states), len(states)))

    def out_edges(node: Any) -> tuple[list[Any], int]:
        # A node's choices: its dependents, plus "done" for a last claim of the minimal set (backtrack mode).
        succ = list(graph.successors(node))
        done = int(dead_ends == "backtrack" and node in useful and not any(s in useful for s in succ))
        return succ, len(succ) + done

    for node in states:
        succ, degree = out_edges(node)
        if succ or degree:
            for s in succ:  # uniform over out-edges; the "done" share leaves Q (absorption)
                q[index[node], index[s]] += 1.0 / degree
        elif dead_ends == "backtrack" and node not in useful:
            entries = _branch_points(graph, node)
            for b in entries:
                b_succ, b_degree = out_edges(b)
                for s in b_succ:
                    q[index[node], index[s]] += 1.0 / (len(entries) * b_degree)
        # else: absorbed after this visit
    # Row root of N = (I - Q)^{-1}: solve x (I - Q) = e_root rather than invert.
    e_root = np.zeros(len(states))
    e_root[0] = 1.0
    visits = np.linalg.solve((np.eye(len(states)) - q).T, e_root)[1:]
    visits = np.clip(visits, 0.0, None)  # round-off on never-visited claims
    total = float(visits.sum())
    return {n: float(v) / total for n, v in zip(claims, visits, strict=True)}


def _c_min_size(graph: nx.DiGraph, c_min: CMin) -> int:
    if isinstance(c_min, bool) or not isinstance(c_min, (int, str)):
        raise ValueError(f"c_min must be 'ancestors', 'empty_cells' or an int, got {c_min!r}")
    if isinstance(c_min, int):
        if c_min < 0:
            raise ValueError(f"c_min must be non-negative, got {c_min}")
        return c_min
    if c_min == "ancestors":
        return sum(not graph.nodes[n]["dead_end"] for n in graph.nodes if n != QUESTION_NODE)
    if c_min == "empty_cells":
        return int(graph.graph["empty_cells"])
    raise ValueError(f"c_min must be 'ancestors', 'empty_cells' or an int, got {c_min!r}")


def reasoning_efficiency(
    graph: nx.DiGraph, *, c_min: CMin = "ancestors", dead_ends: DeadEnds = "backtrack"
) -> float:
    r"""η = log|C_min| / H with :math:`H = -\sum_j p_j \log p_j` over the :func:`visitation` (module
    docstring).

    Args:
        graph: From :func:`build_reasoning_graph`.
        c_min: ``"ancestors"`` (the answer claims and their ancestors), ``"empty_cells"`` (the puzzle's empty
            cells) or an explicit size.
        dead_ends: ``"backtrack"`` or ``"absorb"``, see :func:`visitation`.

    Returns:
        η (not bounded by 1); 1.0 when :math:`H = 0` (a single claim) and :math:`|C_{\min}| \le 1`, infinity when
        :math:`H = 0` and a larger ``c_min`` is asked for, 0.0 when :math:`|C_{\min}| = 0`, NaN for a graph
        without claims.
    """
    p = visitation(graph, dead_ends=dead_ends)
    if not p:
        return float("nan")
    size = _c_min_size(graph, c_min)
    if size == 0:
        return 0.0
    h = -sum(x * math.log(x) for x in p.values() if x > 0)
    if h <= 1e-12:
        return 1.0 if size <= 1 else float("inf")
    return math.log(size) / h


@dataclass(frozen=True)
class StructureStats:
    """Shape of a reasoning graph.

    Attributes:
        n_claims: Claims (the root excluded).
        depth: Longest dependency chain from the root, in claims.
        branching: Mean out-degree of the nodes that have dependents (root included).
        dead_end_fraction: Claims outside the minimal claim set (not ancestors of any answer claim).
        false_fraction: Claims false of the solution.
        unsupported_fraction: Claims derived from a false claim.
        solved: Whether the trace's final grid is the solution.
    """

    n_claims: int
    depth: int
    branching: float
    dead_end_fraction: float
    false_fraction: float
    unsupported_fraction: float
    solved: bool


def structure_stats(graph: nx.DiGraph) -> StructureStats:
    """:class:`StructureStats` of a graph from :func:`build_reasoning_graph`."""
    claims = _claims_of(graph)
    n = len(claims)
    internal = [d for _, d in graph.out_degree() if d > 0]

    def frac(key: str, want: bool = True) -> float:
        return sum(bool(graph.nodes[c][key]) == want for c in claims) / n if n else 0.0

    return StructureStats(
        n_claims=n,
        depth=nx.dag_longest_path_length(graph) if n else 0,
        branching=float(np.mean(internal)) if internal else 0.0,
        dead_end_fraction=frac("dead_end"),
        false_fraction=frac("correct", want=False),
        unsupported_fraction=frac("unsupported"),
        solved=bool(graph.graph.get("solved", False)),
    )
