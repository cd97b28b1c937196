r"""Reasoning graphs of logic-puzzle traces and their flow efficiency η (arXiv 2606.03883; METHODS.md).

A reasoning trace is turned into a DAG of *atomic claims* about the grid, each verified against the puzzle, and
the shape of that DAG is scored: a focused deduction spends every claim on the way to the answer, a meandering
one also wanders into wrong guesses and claims nothing uses.

Trace format
------------
One claim per line; cells are 1-based ``r{row}c{col}`` (as in the puzzle prompts), values ``1..n``::

    [1] r1c3!=2 <- 4 : r1c4 holds 2        elimination: r1c3 is not 2, because of claim 4
    [2] r1c3=1 <- 1,3 # only 1 is left     assignment: r1c3 is 1, because of claims 1 and 3
    [3] r2c2=4                             no dependencies: follows from the givens alone
    <answer>1234/3412/2143/4321</answer>

- ``[id]`` is a positive integer, unique in the trace; ``<- i,j`` lists the claims this one is derived from,
  which must appear on *earlier* lines (so the graph is acyclic by construction).
- Anything after ``:`` or ``#`` is the free-text reason, kept in :attr:`Claim.text` and never interpreted.
- Blank lines, lines starting with ``#`` and the optional ``<answer>...</answer>`` block are not claims. The
  answer is read leniently: the puzzle tasks' format (``12/21``) or numbers in reading order with any
  separators (:meth:`TraceParser.parse_answer`).

:class:`TraceParser` reads this format with strict regular expressions (never ``eval``); strict mode raises a
``ValueError`` naming the line, lenient mode skips what it cannot read and counts it. Free-form traces are
first rewritten into the format by an LLM (:class:`LLMClaimExtractor`, any backend of
:mod:`~lightning_llm.evaluation.dualgraph`), then parsed leniently.

Graph, verdicts, dead ends
--------------------------
:func:`verify_claims` checks each claim against the solution: an assignment ``r,c = v`` is true iff
:meth:`Puzzle.check_cell`, an elimination ``r,c != v`` iff the solution's value there is not ``v``. A claim is
*unsupported* when one of its dependencies is false or itself unsupported (it may still be true by luck).
:func:`build_reasoning_graph` makes a :class:`networkx.DiGraph` with a root node :data:`QUESTION_NODE` (the question:
givens and rules) and an edge from each dependency to the claim derived from it; claims without dependencies
hang off the root. The *answer claims* are the last assignment to each cell (what the trace finally says there);
the *minimal claim set* of the trace is the answer claims and all their ancestors, and every other claim is a
*dead end*: nothing that reaches the answer depends on it.

Efficiency η (one documented reading)
-------------------------------------
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

:func:`structure_stats` adds simple statistics (depth, branching, dead-end and false-claim fractions);
:class:`ReasoningEfficiency` averages η over traces as a torchmetrics metric; :func:`draw_reasoning_graph` draws
a graph layer by layer. :func:`focused_trace` and :func:`meandering_trace` write synthetic traces (a
single-step deduction, and the same deduction at the same length with dead ends) for tests and tutorial 11.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import networkx as nx
import numpy as np
import torch
from torchmetrics import Metric

from lightning_llm.datamodules.tasks.puzzles import Cell, Grid, Puzzle, format_grid
from lightning_llm.evaluation.dualgraph import CallableBackend, LLMBackend

if TYPE_CHECKING:
    from matplotlib.axes import Axes

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

QUESTION_NODE = "question"
"""The root node of every reasoning graph: the puzzle's givens and rules."""

ClaimKind = Literal["assign", "eliminate"]
CMin = Literal["ancestors", "empty_cells"] | int
DeadEnds = Literal["backtrack", "absorb"]

# ---------------------------------------------------------------------------------------------------- claims


@dataclass(frozen=True)
class Claim:
    """One atomic claim of a trace.

    Attributes:
        id: The trace's own label, a positive integer unique in the trace.
        kind: ``"assign"`` (the cell holds ``value``) or ``"eliminate"`` (it does not).
        cell: ``(row, col)``, 0-based.
        value: The value claimed (or ruled out).
        depends_on: Ids of the earlier claims this one is derived from.
        text: The free-text reason, if any.
    """

    id: int
    kind: ClaimKind
    cell: Cell
    value: int
    depends_on: tuple[int, ...] = ()
    text: str = ""

    @property
    def label(self) -> str:
        """``r1c2=4`` / ``r1c2!=3`` (1-based)."""
        op = "=" if self.kind == "assign" else "!="
        return f"r{self.cell[0] + 1}c{self.cell[1] + 1}{op}{self.value}"

    def format(self) -> str:
        """The claim as one line of the trace format."""
        line = f"[{self.id}] {self.label}"
        if self.depends_on:
            line += " <- " + ",".join(str(d) for d in self.depends_on)
        if self.text:
            line += f" : {self.text}"
        return line


def format_trace(claims: Iterable[Claim], answer: Grid | None = None) -> str:
    """Write claims (and optionally an answer grid, in the puzzle tasks' answer format ``12/21``) in the trace
    format; :meth:`TraceParser.parse` reads it back."""
    lines = [c.format() for c in claims]
    if answer is not None:
        lines.append(f"<answer>{format_grid(answer)}</answer>")
    return "\n".join(lines)


# The whole line must match: a claim with trailing junk is an error, not a claim. Values and ids are bounded
# in length so that a pathological line cannot produce huge integers.
_CLAIM = re.compile(
    r"""^\s*\[\s*(?P<id>\d{1,6})\s*\]\s*
        r(?P<row>\d{1,3})\s*c(?P<col>\d{1,3})\s*(?P<op>!=|=)\s*(?P<value>\d{1,3})
        \s*(?:<-\s*(?P<deps>\d{1,6}(?:\s*,\s*\d{1,6})*))?
        \s*(?:[:#]\s*(?P<text>.*?))?\s*$""",
    re.VERBOSE,
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


class TraceParser:
    """Reads the trace format of the module docstring into :class:`Claim` objects.

    Args:
        size: The grid side ``n``; when given, cells must lie in the grid and values in ``1..n``.
        strict: Raise ``ValueError`` (naming the 1-based line) on any line that is not a valid claim; otherwise
            skip such lines, and drop dependencies on unknown ids, counting both.

    Attributes:
        skipped: Lines skipped in lenient mode, summed over calls.
        dropped_dependencies: Unknown dependency ids dropped in lenient mode, summed over calls.
        errors: The reasons for what the last :meth:`parse` call skipped or dropped.
    """

    def __init__(self, size: int | None = None, *, strict: bool = True) -> None:
        if size is not None and size < 1:
            raise ValueError(f"size must be positive, got {size}")
        self.size, self.strict = size, strict
        self.skipped = 0
        self.dropped_dependencies = 0
        self.errors: list[str] = []

    def parse(self, text: str) -> list[Claim]:
        """The claims of ``text`` in trace order."""
        self.errors = []
        claims: list[Claim] = []
        seen: set[int] = set()
        body = _ANSWER.sub("", text)  # the answer block may span lines; it is not a claim
        for number, line in enumerate(body.splitlines(), start=1):
            stripped = line.strip()
            if not stripped or stripped.startswith(("#", "```")):
                continue
            claim = self._parse_line(number, line, seen)
            if claim is not None:
                claims.append(claim)
                seen.add(claim.id)
        return claims

    def parse_answer(self, text: str) -> Grid | None:
        """The grid in the last ``<answer>...</answer>`` block, or None if there is none or it does not have
        ``size × size`` values. Numbers are read in reading order; rows written as digit strings (``1234``) are
        split into digits."""
        found = _ANSWER.findall(text)
        if not found or self.size is None:
            return None
        n = self.size
        tokens = re.findall(r"\d+", found[-1])
        if len(tokens) != n * n and len(tokens) == n and all(len(t) == n for t in tokens) and n <= 9:
            tokens = [ch for t in tokens for ch in t]
        if len(tokens) != n * n:
            return None
        values = [int(t) for t in tokens]
        return tuple(tuple(values[r * n : (r + 1) * n]) for r in range(n))

    def _fail(self, number: int, line: str, reason: str) -> None:
        message = f"line {number}: {reason}: {line.strip()[:80]!r}"
        if self.strict:
            raise ValueError(message)
        self.errors.append(message)

    def _parse_line(self, number: int, line: str, seen: set[int]) -> Claim | None:
        m = _CLAIM.match(line)
        if m is None:
            self._fail(number, line, "not a claim (expected '[id] r<row>c<col>=<v>' or '!=<v>')")
            self.skipped += 1
            return None
        cid, row, col, value = (int(m.group(k)) for k in ("id", "row", "col", "value"))
        problem = None
        if cid < 1:
            problem = "claim ids must be positive"
        elif cid in seen:
            problem = f"duplicate claim id {cid}"
        elif row < 1 or col < 1 or (self.size is not None and (row > self.size or col > self.size)):
            problem = f"cell r{row}c{col} is outside the {self.size or '?'} x {self.size or '?'} grid"
        elif value < 1 or (self.size is not None and value > self.size):
            problem = f"value {value} is outside 1..{self.size or '?'}"
        if problem is not None:
            self._fail(number, line, problem)
            self.skipped += 1
            return None
        deps: list[int] = []
        for d in (int(x) for x in (m.group("deps") or "").replace(" ", "").split(",") if x):
            if d == cid:
                reason = f"claim {cid} depends on itself"
            elif d not in seen:
                reason = f"unknown dependency id {d} (claims may only depend on earlier claims)"
            else:
                if d not in deps:
                    deps.append(d)
                continue
            self._fail(number, line, reason)
            self.dropped_dependencies += 1
        kind: ClaimKind = "assign" if m.group("op") == "=" else "eliminate"
        return Claim(cid, kind, (row - 1, col - 1), value, tuple(deps), (m.group("text") or "").strip())


# ---------------------------------------------------------------------------------------------------- LLM extraction

_EXTRACT_PROMPT = """Rewrite the reasoning below as a list of atomic claims about the grid, one per line, exactly as:
[id] r<row>c<col>=<value> <- <ids of earlier claims it uses> : <short reason>
[id] r<row>c<col>!=<value> <- <ids of earlier claims it uses> : <short reason>
Rows and columns are 1-based; ids are 1, 2, 3, ... in order; omit "<- ..." for a claim that follows from the
givens alone. Write only claims the reasoning states, including wrong ones. No other text.

Puzzle ({size} x {size}, 0 = empty):
{grid}

Reasoning:
{trace}

Claims:"""


class LLMClaimExtractor:
    """Turns free-form traces into claims: an LLM rewrites each trace into the trace format, which is then
    parsed leniently (malformed lines are skipped and counted, never executed).

    Args:
        backend: An :class:`~lightning_llm.evaluation.dualgraph.LLMBackend` (``complete(list[str])``, e.g.
            :class:`~lightning_llm.evaluation.dualgraph.CallableBackend` around a model's ``generate``, or
            :class:`~lightning_llm.evaluation.dualgraph.OpenAICompatibleBackend`), or any ``str -> str``
            callable, which is wrapped into a ``CallableBackend``.
        template: The prompt, with ``{size}``, ``{grid}`` and ``{trace}`` fields.

    Attributes:
        skipped: Unparseable lines in the LLM's answers, summed over calls.
        dropped_dependencies: Dependencies on unknown claim ids dropped, summed over calls.
    """

    def __init__(self, backend: LLMBackend | Callable[[str], str], template: str = _EXTRACT_PROMPT) -> None:
        if not hasattr(backend, "complete"):
            if not callable(backend):
                raise TypeError("backend must have .complete(list[str]) or be a str -> str callable")
            fn = backend
            backend = CallableBackend(lambda prompts: [fn(p) for p in prompts])
        self.backend: LLMBackend = backend  # type: ignore[assignment]
        self.template = template
        self.skipped = 0
        self.dropped_dependencies = 0

    def extract(self, traces: Sequence[str], puzzles: Sequence[Puzzle]) -> list[list[Claim]]:
        """One list of claims per trace (batched through the backend)."""
        if len(traces) != len(puzzles):
            raise ValueError(f"got {len(traces)} traces for {len(puzzles)} puzzles")
        prompts = [
            self.template.format(
                size=p.size, grid="\n".join(" ".join(str(v) for v in row) for row in p.givens), trace=t
            )
            for t, p in zip(traces, puzzles, strict=True)
        ]
        out = []
        for answer, puzzle in zip(self.backend.complete(prompts), puzzles, strict=True):
            parser = TraceParser(puzzle.size, strict=False)
            out.append(parser.parse(answer))
            self.skipped += parser.skipped
            self.dropped_dependencies += parser.dropped_dependencies
        return out


# ---------------------------------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class ClaimVerdict:
    """The verifier's view of one claim: ``correct`` (true of the solution) and ``unsupported`` (derived, directly
    or through other claims, from a false claim)."""

    claim_id: int
    correct: bool
    unsupported: bool


def verify_claims(puzzle: Puzzle, claims: Sequence[Claim]) -> list[ClaimVerdict]:
    """Check each claim against the puzzle's solution (see the module docstring), in trace order."""
    n = puzzle.size
    bad: set[int] = set()  # false or unsupported: anything derived from these is unsupported
    out = []
    for claim in claims:
        r, c = claim.cell
        inside = 0 <= r < n and 0 <= c < n
        if claim.kind == "assign":
            correct = puzzle.check_cell(r, c, claim.value)
        else:
            correct = inside and puzzle.solution[r][c] != claim.value
        unsupported = any(d in bad for d in claim.depends_on)
        if not correct or unsupported:
            bad.add(claim.id)
        out.append(ClaimVerdict(claim.id, correct, unsupported))
    return out


# ---------------------------------------------------------------------------------------------------- graph


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


# ---------------------------------------------------------------------------------------------------- metric


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


# ---------------------------------------------------------------------------------------------------- drawing

_COLOURS = {"root": "#bdbdbd", "true": "#4daf4a", "false": "#e41a1c", "dead_end": "#ff9f1c"}


def draw_reasoning_graph(graph: nx.DiGraph, ax: Axes | None = None, *, labels: bool = True) -> Axes:
    """Draw a reasoning graph layer by layer (layer = longest dependency chain from the root).

    Colours: grey root, green true claims in the minimal set, orange true dead ends, red false claims (dead or
    not); unsupported claims get a black outline; answer claims are squares. Returns the axes.
    """
    import matplotlib.pyplot as plt  # only here: the module itself must import without matplotlib

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 5))
    layer: dict[Any, int] = {}
    for node in nx.topological_sort(graph):
        preds = list(graph.predecessors(node))
        layer[node] = 1 + max(layer[p] for p in preds) if preds else 0
    layered = graph.copy()
    nx.set_node_attributes(layered, layer, "layer")
    pos = nx.multipartite_layout(layered, subset_key="layer", align="horizontal")
    pos = {n: (x, -y) for n, (x, y) in pos.items()}  # root on top

    def colour(n: Any) -> str:
        d = graph.nodes[n]
        if n == QUESTION_NODE:
            return _COLOURS["root"]
        if not d["correct"]:
            return _COLOURS["false"]
        return _COLOURS["dead_end"] if d["dead_end"] else _COLOURS["true"]

    nx.draw_networkx_edges(graph, pos, ax=ax, arrows=True, arrowsize=8, width=0.8, edge_color="#777777")
    for shape, nodes in (
        ("o", [n for n in graph if n == QUESTION_NODE or not graph.nodes[n]["answer"]]),
        ("s", [n for n in graph if n != QUESTION_NODE and graph.nodes[n]["answer"]]),
    ):
        nx.draw_networkx_nodes(
            graph,
            pos,
            nodelist=nodes,
            node_shape=shape,
            node_color=[colour(n) for n in nodes],
            edgecolors=[
                "black" if n != QUESTION_NODE and graph.nodes[n]["unsupported"] else "none" for n in nodes
            ],
            node_size=260,
            ax=ax,
        )
    if labels:
        nx.draw_networkx_labels(
            graph, pos, labels={n: graph.nodes[n]["label"] for n in graph}, font_size=5, ax=ax
        )
    ax.set_axis_off()
    return ax


# ---------------------------------------------------------------------------------------------------- synthetic traces


@dataclass
class _Step:
    """One deduction: ``cell = value`` because each other value ``u`` is excluded (naked single) or because
    ``value`` is excluded from every other open cell ``y`` of a unit (hidden single). ``reasons`` maps each
    excluded (cell, value) pair to the cells whose values exclude it."""

    cell: Cell
    value: int
    rule: str
    reasons: list[tuple[Cell, int, list[Cell]]]


def _excluders(puzzle: Puzzle, grid: list[list[int]], cell: Cell, value: int) -> list[Cell] | None:
    """The filled cells that rule ``value`` out at ``cell``: one peer holding it, else the filled inequality
    neighbours (empty list: the inequality alone rules it out); None if nothing does."""
    holders = [p for p in sorted(puzzle.peers(cell)) if grid[p[0]][p[1]] == value]
    if holders:
        givens = [p for p in holders if puzzle.givens[p[0]][p[1]]]
        return [givens[0] if givens else holders[0]]  # cite a clue when one will do: the shorter derivation
    frozen = tuple(tuple(row) for row in grid)
    if value in puzzle.candidates(frozen, cell):
        return None
    return sorted({b if a == cell else a for a, b in puzzle.inequalities if cell in (a, b)} & _filled(grid))


def _filled(grid: list[list[int]]) -> set[Cell]:
    return {(r, c) for r, row in enumerate(grid) for c, v in enumerate(row) if v}


def _units(puzzle: Puzzle) -> list[list[Cell]]:
    n = puzzle.size
    units = [[(r, c) for c in range(n)] for r in range(n)] + [[(r, c) for r in range(n)] for c in range(n)]
    if puzzle.box is not None:
        br, bc = puzzle.box
        for r0 in range(0, n, br):
            for c0 in range(0, n, bc):
                units.append([(r, c) for r in range(r0, r0 + br) for c in range(c0, c0 + bc)])
    return units


def _deduce(puzzle: Puzzle, rng: random.Random) -> list[_Step]:
    """A single-step deduction of the solution: at each step a random naked single, else a random hidden
    single, else (puzzles that need lookahead) the most constrained cell with its solution value, justified by
    excluding its other candidates through its filled peers. Every step's claim is true."""
    n = puzzle.size
    grid = [list(row) for row in puzzle.givens]
    steps: list[_Step] = []
    while any(0 in row for row in grid):
        frozen = tuple(tuple(row) for row in grid)
        empty = [(r, c) for r in range(n) for c in range(n) if grid[r][c] == 0]
        options = {cell: puzzle.candidates(frozen, cell) for cell in empty}
        naked = [cell for cell in empty if len(options[cell]) == 1]
        step: _Step | None = None
        if naked:
            cell = rng.choice(naked)
            value = options[cell][0]
            reasons = [
                (cell, u, _excluders(puzzle, grid, cell, u) or []) for u in range(1, n + 1) if u != value
            ]
            step = _Step(cell, value, "naked single", reasons)
        else:
            hidden = []
            for unit in _units(puzzle):
                for value in range(1, n + 1):
                    spots = [c for c in unit if grid[c[0]][c[1]] == 0 and value in options[c]]
                    if len(spots) == 1 and value not in (grid[r][c] for r, c in unit):
                        hidden.append((spots[0], value, unit))
            if hidden:
                cell, value, unit = rng.choice(hidden)
                others = [y for y in unit if y != cell and grid[y[0]][y[1]] == 0]
                reasons = [(y, value, _excluders(puzzle, grid, y, value) or []) for y in others]
                step = _Step(cell, value, "hidden single", reasons)
        if step is None:
            cell = min(empty, key=lambda c: (len(options[c]), c))
            value = puzzle.solution[cell[0]][cell[1]]
            support = sorted(puzzle.peers(cell) & _filled(grid))
            reasons = [(cell, u, support) for u in range(1, n + 1) if u != value]
            step = _Step(cell, value, "lookahead", reasons)
        steps.append(step)
        grid[step.cell[0]][step.cell[1]] = step.value
    return steps


def _cellname(cell: Cell) -> str:
    return f"r{cell[0] + 1}c{cell[1] + 1}"


def _write(
    puzzle: Puzzle,
    steps: Sequence[_Step],
    keep: Sequence[bool],
    detours: dict[int, list[tuple[str, Cell, int]]] | None = None,
) -> list[Claim]:
    """Claims for ``steps``: for each step, its detours (dead ends inserted before it), the eliminations whose
    flag in ``keep`` is set, then the assignment, which depends on its kept eliminations and directly on the
    claims behind the dropped ones."""
    claims: list[Claim] = []
    owner: dict[Cell, int] = {}  # cell -> id of the claim that assigned it
    flags = iter(keep)
    for i, step in enumerate(steps):
        for kind, cell, value in (detours or {}).get(i, []):
            if kind == "guess":
                # A guess is not derived from anything, so it hangs off the root (the question).
                claims.append(Claim(len(claims) + 1, "assign", cell, value, (), "guess"))
                guess_id = len(claims)
            else:  # "consequence" of the guess just made, later abandoned
                claims.append(
                    Claim(len(claims) + 1, "eliminate", cell, value, (guess_id,), "if the guess holds")
                )
        deps: list[int] = []
        for target, value, excl in step.reasons:
            behind = tuple(dict.fromkeys(owner[x] for x in excl if x in owner))
            if next(flags):
                why = "held by " + ", ".join(_cellname(x) for x in excl) if excl else "inequality"
                claims.append(Claim(len(claims) + 1, "eliminate", target, value, behind, why))
                deps.append(len(claims))
            else:
                deps.extend(d for d in behind if d not in deps)
        claims.append(Claim(len(claims) + 1, "assign", step.cell, step.value, tuple(deps), step.rule))
        owner[step.cell] = len(claims)
    return claims


def focused_trace(puzzle: Puzzle, seed: int = 0, *, eliminations: bool = True) -> str:
    """A focused (single-step) deduction of ``puzzle`` in the trace format, with its answer.

    Each step fills one cell by a naked or hidden single (lookahead only where the puzzle needs it). With
    ``eliminations`` the trace states every elimination the step uses (``r1c2!=3 <- [claim that put 3 in a
    peer]``) and the assignment depends on them; without, the assignment depends directly on the claims that
    filled the cells it uses. Every claim is true and every claim is an ancestor of an answer claim, so under
    ``c_min="ancestors"`` its η is at least 1. ``seed`` breaks ties between available deductions.
    """
    steps = _deduce(puzzle, random.Random(seed))
    keep = [eliminations] * sum(len(s.reasons) for s in steps)
    return format_trace(_write(puzzle, steps, keep), puzzle.solution)


def meandering_trace(puzzle: Puzzle, seed: int = 0, *, dead_ends: int = 3, length: int | None = None) -> str:
    """The deduction of :func:`focused_trace` (same ``seed``, same answer) with ``dead_ends`` claims that lead
    nowhere, at a fixed total length.

    Dead ends are wrong guesses (``r2c3=1 : guess``: a value the givens leave open at the cell the next step
    fills, a false claim later overwritten by the deduced value; a guess hangs off the root), each followed
    where there is room by one consequence drawn from it (``r2c1!=1 <- guess`` at an empty peer: unsupported,
    and false when it rules out the true value). To keep the length, the trace then states
    fewer eliminations: a dropped elimination's assignment depends directly on the claims behind it.

    Args:
        puzzle: The puzzle.
        seed: Same seed as the focused trace to compare with; also places the dead ends.
        dead_ends: Number of dead-end claims (guesses and their consequences).
        length: Total number of claims; default the length of ``focused_trace(puzzle, seed)``.

    Raises:
        ValueError: If ``length`` cannot be met: it must lie between the number of deduction steps plus
            ``dead_ends`` and the focused length plus ``dead_ends``.
    """
    if dead_ends < 0:
        raise ValueError(f"dead_ends must be non-negative, got {dead_ends}")
    rng = random.Random(seed)
    steps = _deduce(puzzle, rng)
    n_elims = sum(len(s.reasons) for s in steps)
    length = len(steps) + n_elims if length is None else length
    keep_count = length - len(steps) - dead_ends
    if not 0 <= keep_count <= n_elims:
        raise ValueError(
            f"cannot write {length} claims with {dead_ends} dead ends: {len(steps)} assignments and 0..{n_elims} "
            f"eliminations fit lengths {len(steps) + dead_ends}..{len(steps) + n_elims + dead_ends}"
        )
    keep = [True] * keep_count + [False] * (n_elims - keep_count)
    rng.shuffle(keep)
    # Dead ends go before randomly chosen steps: a guess at the cell the step is about to fill (the
    # deduction then overwrites it), plus a consequence ruling the guessed value out of one of its peers.
    detours: dict[int, list[tuple[str, Cell, int]]] = {}
    left = dead_ends
    n = puzzle.size
    while left > 0:
        i = rng.randrange(len(steps))
        step = steps[i]
        # A plausible guess: a value the givens leave open at the cell (any wrong value if none is left).
        open_values = [v for v in puzzle.candidates(puzzle.givens, step.cell) if v != step.value]
        wrong = rng.choice(open_values or [v for v in range(1, n + 1) if v != step.value])
        branch = [("guess", step.cell, wrong)]
        if left >= 2:
            peers = sorted(puzzle.peers(step.cell))
            open_peers = [p for p in peers if puzzle.givens[p[0]][p[1]] == 0]
            branch.append(("consequence", rng.choice(open_peers or peers), wrong))
        detours.setdefault(i, []).extend(branch)
        left -= len(branch)
    return format_trace(_write(puzzle, steps, keep, detours), puzzle.solution)
