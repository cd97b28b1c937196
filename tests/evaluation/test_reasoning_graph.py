"""Reasoning graphs: the trace format's parser, the LLM extractor (fake backend), the verifier, the DAG, η against
a hand computation, the claim that a focused trace scores higher than a meandering one of the same length, the
structure statistics, the metric (and its merge), and drawing."""

from __future__ import annotations

import math
import random

import matplotlib
import networkx as nx
import pytest
import torch

from lightning_llm.datamodules.tasks.puzzles import Puzzle
from lightning_llm.evaluation import (
    QUESTION_NODE,
    CallableBackend,
    Claim,
    LLMClaimExtractor,
    ReasoningEfficiency,
    TraceParser,
    build_reasoning_graph,
    draw_reasoning_graph,
    focused_trace,
    format_trace,
    meandering_trace,
    reasoning_efficiency,
    structure_stats,
    verify_claims,
    visitation,
)

# 3 x 3 Latin square: only r1c1 and r2c2 are empty once r1c2, r1c3, r2c1, r2c3 and row 3 are given.
SOLUTION3 = ((1, 2, 3), (2, 3, 1), (3, 1, 2))
PUZZLE3 = Puzzle("latin_square", ((0, 2, 3), (2, 0, 1), (3, 1, 2)), SOLUTION3)


def _puzzle(n: int, seed: int, box: tuple[int, int] | None = None) -> Puzzle:
    """A uniquely solvable puzzle: a permuted cyclic Latin square (or the standard box pattern), with cells
    removed in random order while the solution stays unique."""
    rng = random.Random(seed)
    if box is None:
        base = [[(r + c) % n for c in range(n)] for r in range(n)]
        rows, cols = rng.sample(range(n), n), rng.sample(range(n), n)
    else:
        br, bc = box
        base = [[(bc * (r % br) + r // br + c) % n for c in range(n)] for r in range(n)]
        rows, cols = list(range(n)), list(range(n))
    values = rng.sample(range(1, n + 1), n)
    solution = tuple(tuple(values[base[r][c]] for c in cols) for r in rows)
    family = "latin_square" if box is None else "mini_sudoku"
    givens = [list(row) for row in solution]
    for r, c in rng.sample([(r, c) for r in range(n) for c in range(n)], n * n):
        keep, givens[r][c] = givens[r][c], 0
        if len(Puzzle(family, tuple(map(tuple, givens)), solution, box=box).solve(limit=2)) != 1:
            givens[r][c] = keep
    return Puzzle(family, tuple(map(tuple, givens)), solution, box=box)


PUZZLES = [_puzzle(4, s) for s in range(4)] + [_puzzle(4, s, box=(2, 2)) for s in range(4, 7)]


def _graph(puzzle: Puzzle, text: str) -> nx.DiGraph:
    return build_reasoning_graph(puzzle, TraceParser(puzzle.size).parse(text))


def _chain(n: int) -> list[Claim]:
    return [Claim(i, "eliminate", (0, 0), 2, (i - 1,) if i > 1 else ()) for i in range(1, n)] + [
        Claim(n, "assign", (0, 0), 1, (n - 1,) if n > 1 else ())
    ]


# ---------------------------------------------------------------------------------------------------- parser


def test_parser_reads_the_documented_format():
    text = """# a comment
[1] r1c1!=2 <- : r1c2 is 2
[2] r1c1 != 3 # r1c3 is 3
[3] r1c1=1 <- 1, 2 : only 1 left

[4] r2c2=3<-3
<answer>1 2 3 / 2 3 1 / 3 1 2</answer>"""
    parser = TraceParser(3)
    with pytest.raises(ValueError, match="line 2"):  # "<-" needs at least one id
        parser.parse(text)
    claims = parser.parse(text.replace("<- :", ":"))
    assert [c.id for c in claims] == [1, 2, 3, 4]
    assert claims[0] == Claim(1, "eliminate", (0, 0), 2, (), "r1c2 is 2")
    assert claims[2].kind == "assign" and claims[2].depends_on == (1, 2) and claims[2].text == "only 1 left"
    assert claims[3].cell == (1, 1) and claims[3].depends_on == (3,)
    assert parser.parse_answer(text) == SOLUTION3
    assert TraceParser(3).parse_answer("<answer>123/231/312</answer>") == SOLUTION3
    assert TraceParser(3).parse_answer("<answer>1 2 3</answer>") is None
    # format_trace writes what parse reads
    assert parser.parse(format_trace(claims, SOLUTION3)) == claims


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[2] r1c1=1 <- 7", r"line 2: unknown dependency id 7"),
        ("[1] r1c1=1", r"line 2: duplicate claim id 1"),
        ("[2] r4c1=1", r"line 2: cell r4c1 is outside the 3 x 3 grid"),
        ("[2] r1c1=4", r"line 2: value 4 is outside 1..3"),
        ("[2] r1c1=1 <- 2", r"line 2: claim 2 depends on itself"),
        ("[2] r1c1 := 1", r"line 2: not a claim"),
        ("r1c1=1", r"line 2: not a claim"),
        ("[2] r1c1=1 <- 1 extra", r"line 2: not a claim"),
    ],
)
def test_parser_errors_name_the_line(line, message):
    with pytest.raises(ValueError, match=message):
        TraceParser(3).parse(f"[1] r1c2=2\n{line}")


def test_forward_references_are_unknown_and_lenient_mode_counts():
    with pytest.raises(ValueError, match="line 1: unknown dependency id 2"):
        TraceParser(3).parse("[1] r1c1=1 <- 2\n[2] r1c2=2")
    parser = TraceParser(3, strict=False)
    claims = parser.parse("I think r1c1 is 1.\n[1] r1c1=1 <- 9\n[2] r9c9=1\n[3] r1c2=2 <- 1\nso done")
    assert [(c.id, c.depends_on) for c in claims] == [(1, ()), (3, (1,))]
    assert parser.skipped == 3 and parser.dropped_dependencies == 1 and len(parser.errors) == 4
    assert "line 1" in parser.errors[0]


# ---------------------------------------------------------------------------------------------------- extractor


def test_llm_extractor_with_fake_backends():
    prompts: list[str] = []

    def fake(prompt: str) -> str:
        prompts.append(prompt)
        return "```\n[1] r1c1=1 : only 1 fits\nSure! here you go\n[2] r2c2=3 <- 1, 5\n```"

    extractor = LLMClaimExtractor(fake)
    (claims,) = extractor.extract(["first, r1c1 must be 1, then r2c2 is 3"], [PUZZLE3])
    assert [c.label for c in claims] == ["r1c1=1", "r2c2=3"] and claims[1].depends_on == (1,)
    assert extractor.skipped == 1 and extractor.dropped_dependencies == 1
    assert "first, r1c1 must be 1" in prompts[0] and "0 2 3" in prompts[0]  # the trace and the givens
    # the repo's batch backends are used as they are
    batch = CallableBackend(lambda ps: ["[1] r1c1=1"] * len(ps))
    assert [len(c) for c in LLMClaimExtractor(batch).extract(["a", "b"], [PUZZLE3, PUZZLE3])] == [1, 1]
    with pytest.raises(ValueError, match="2 traces for 1 puzzles"):
        LLMClaimExtractor(batch).extract(["a", "b"], [PUZZLE3])


# ---------------------------------------------------------------------------------------------------- verifier, graph


def test_verifier_flags_false_and_unsupported_claims():
    text = """[1] r1c1=3 : guess
[2] r2c2!=3 <- 1 : false, and derived from a false claim
[3] r2c2!=2 <- 1 : true by luck, but derived from a false claim
[4] r3c3!=1 <- 3
[5] r1c1!=2
[6] r1c1=1 <- 5"""
    verdicts = verify_claims(PUZZLE3, TraceParser(3).parse(text))
    assert [(v.correct, v.unsupported) for v in verdicts] == [
        (False, False),
        (False, True),
        (True, True),
        (True, True),  # unsupported propagates through claims
        (True, False),
        (True, False),
    ]


def test_graph_structure_answers_and_dead_ends():
    text = "[1] r1c1!=2\n[2] r1c1=3 : guess\n[3] r1c1=1 <- 1\n[4] r2c2=3 <- 3\n[5] r3c3!=1 <- 2"
    g = _graph(PUZZLE3, text)
    assert set(g.edges) == {(QUESTION_NODE, 1), (QUESTION_NODE, 2), (1, 3), (3, 4), (2, 5)}
    assert nx.is_directed_acyclic_graph(g)
    assert [n for n in g if n != QUESTION_NODE and g.nodes[n]["answer"]] == [
        3,
        4,
    ]  # the last assignment per cell
    assert [n for n in g if n != QUESTION_NODE and g.nodes[n]["dead_end"]] == [2, 5]
    assert g.nodes[2]["correct"] is False and g.nodes[5]["unsupported"] is True
    assert g.graph["solved"] and g.graph["empty_cells"] == 2
    assert not _graph(PUZZLE3, "[1] r1c1=1").graph["solved"]  # r2c2 never filled
    with pytest.raises(ValueError, match="unique"):
        build_reasoning_graph(PUZZLE3, [Claim(1, "assign", (0, 0), 1), Claim(1, "assign", (1, 1), 3)])


# ---------------------------------------------------------------------------------------------------- η


def test_eta_on_a_three_claim_chain_and_a_hand_computed_graph():
    chain = build_reasoning_graph(PUZZLE3, _chain(3))
    assert visitation(chain) == pytest.approx({1: 1 / 3, 2: 1 / 3, 3: 1 / 3})
    assert reasoning_efficiency(chain) == pytest.approx(1.0)  # log 3 / log 3
    assert reasoning_efficiency(chain, c_min="empty_cells") == pytest.approx(math.log(2) / math.log(3))
    assert reasoning_efficiency(chain, c_min=5) == pytest.approx(math.log(5) / math.log(3))

    # root -> 1 -> 2 (answer r1c1=1), plus a dead end 1 -> 3. Backtracking: at claim 1 the walker goes to 2
    # or 3 with 1/2 each, and from 3 chooses again at 1, so visits are 1, 1, 1: H = log 3, η = log 2 / log 3.
    # Absorbing at every leaf: visits 1, 1/2, 1/2 and p = (1/2, 1/4, 1/4), H = 1.5 log 2, η = 2/3.
    claims = [
        Claim(1, "eliminate", (0, 0), 2),
        Claim(2, "assign", (0, 0), 1, (1,)),
        Claim(3, "eliminate", (1, 1), 1, (1,)),
    ]
    g = build_reasoning_graph(PUZZLE3, claims)
    assert visitation(g) == pytest.approx({1: 1 / 3, 2: 1 / 3, 3: 1 / 3})
    assert reasoning_efficiency(g) == pytest.approx(math.log(2) / math.log(3))
    assert visitation(g, dead_ends="absorb") == pytest.approx({1: 0.5, 2: 0.25, 3: 0.25})
    assert reasoning_efficiency(g, dead_ends="absorb") == pytest.approx(2 / 3)
    # The fundamental matrix by hand for the backtracking chain over (root, 1, 2, 3): N = (I - Q)^{-1}.
    q = torch.zeros(4, 4, dtype=torch.float64)
    q[0, 1] = 1.0  # root -> 1
    q[1, 2] = q[1, 3] = 0.5  # 1 -> 2 | 3; 2 -> done (absorbed)
    q[3, 2] = q[3, 3] = 0.5  # 3 is a dead end: choose again at 1
    n = torch.linalg.inv(torch.eye(4, dtype=torch.float64) - q)
    p = n[0, 1:] / n[0, 1:].sum()
    assert list(visitation(g).values()) == pytest.approx(p.tolist())

    # edge cases
    single = build_reasoning_graph(PUZZLE3, [Claim(1, "assign", (0, 0), 1)])
    assert reasoning_efficiency(single) == 1.0
    no_answer = build_reasoning_graph(
        PUZZLE3, [Claim(1, "eliminate", (0, 0), 2), Claim(2, "eliminate", (0, 0), 3)]
    )
    assert reasoning_efficiency(no_answer) == 0.0 and sum(visitation(no_answer).values()) == pytest.approx(
        1.0
    )
    assert math.isnan(reasoning_efficiency(build_reasoning_graph(PUZZLE3, [])))
    with pytest.raises(ValueError, match="c_min"):
        reasoning_efficiency(chain, c_min="all")
    with pytest.raises(ValueError, match="dead_ends"):
        reasoning_efficiency(chain, dead_ends="restart")


def test_linear_beats_dead_ends_at_equal_length_on_crafted_chains():
    """A 12-claim chain (η = 1) against 12-claim traces whose useful chain is shorter and whose other claims are
    dead ends: off the root, off the first, middle and last claims, and a dead branch of three claims."""
    linear = reasoning_efficiency(build_reasoning_graph(PUZZLE3, _chain(12)))
    assert linear == pytest.approx(1.0)
    for parents in ([0, 0], [1, 1, 1], [5], [9, 9], [3, -1, -1], [1, 4, 7, 0]):
        m = 12 - len(parents)
        claims = _chain(m)
        for parent in parents:  # -1: continue the previous dead end
            dep = claims[-1].id if parent == -1 else parent
            claims.append(Claim(len(claims) + 1, "eliminate", (1, 1), 1, (dep,) if dep else ()))
        g = build_reasoning_graph(PUZZLE3, claims)
        assert sum(g.nodes[n]["dead_end"] for n in g if n != QUESTION_NODE) == len(parents)
        assert reasoning_efficiency(g) < linear - 0.01, parents


@pytest.mark.parametrize("puzzle", PUZZLES, ids=range(len(PUZZLES)))
def test_focused_beats_meandering_at_equal_length_and_accuracy(puzzle):
    parser = TraceParser(puzzle.size)
    focused = parser.parse(focused_trace(puzzle, seed=0))
    dead = max(2, round(0.15 * len(focused)))
    meandering = parser.parse(meandering_trace(puzzle, seed=0, dead_ends=dead))
    assert len(meandering) == len(focused)
    gf, gm = build_reasoning_graph(puzzle, focused), build_reasoning_graph(puzzle, meandering)
    assert gf.graph["solved"] and gm.graph["solved"]
    assert all(gf.nodes[n]["correct"] and not gf.nodes[n]["dead_end"] for n in gf if n != QUESTION_NODE)
    assert sum(gm.nodes[n]["dead_end"] for n in gm if n != QUESTION_NODE) == dead
    assert any(not gm.nodes[n]["correct"] for n in gm if n != QUESTION_NODE)  # the wrong guesses are flagged
    assert reasoning_efficiency(gf) >= 1.0 - 1e-9  # no dead ends: H <= log(#claims) = log|C_min|
    assert reasoning_efficiency(gf) > reasoning_efficiency(gm)


def test_trace_generators_are_seeded_and_checked():
    puzzle = PUZZLES[0]
    assert focused_trace(puzzle, 3) == focused_trace(puzzle, 3)
    parser = TraceParser(puzzle.size)
    assert all(c.kind == "assign" for c in parser.parse(focused_trace(puzzle, 0, eliminations=False)))
    short = parser.parse(meandering_trace(puzzle, 0, dead_ends=2, length=len(puzzle.empty_cells()) + 2))
    assert (
        sum(c.kind == "eliminate" for c in short) == 1
    )  # the only elimination left is a guess's consequence
    with pytest.raises(ValueError, match="cannot write"):
        meandering_trace(puzzle, 0, dead_ends=2, length=3)


def test_structure_stats():
    text = "[1] r1c1!=2\n[2] r1c1=3 : guess\n[3] r1c1=1 <- 1\n[4] r2c2=3 <- 1,3\n[5] r3c3!=1 <- 2"
    stats = structure_stats(_graph(PUZZLE3, text))
    assert stats.n_claims == 5 and stats.depth == 3  # root -> 1 -> 3 -> 4
    assert stats.branching == pytest.approx((2 + 2 + 1 + 1) / 4)  # root, 1, 2, 3 have dependents
    assert stats.dead_end_fraction == pytest.approx(2 / 5)
    assert stats.false_fraction == pytest.approx(1 / 5) and stats.unsupported_fraction == pytest.approx(1 / 5)
    assert stats.solved


# ---------------------------------------------------------------------------------------------------- metric, drawing


@pytest.mark.filterwarnings("ignore:The ``compute`` method:UserWarning")  # the hand-merged copy never updates
def test_metric_update_compute_and_merge():
    puzzles = PUZZLES[:2]
    traces = [focused_trace(p, 0) for p in puzzles]
    expected = [reasoning_efficiency(_graph(p, t)) for p, t in zip(puzzles, traces, strict=True)]
    metric = ReasoningEfficiency(return_stats=True)
    metric.update([traces[0], "no claims here"], [puzzles[0], puzzles[0]])
    other = ReasoningEfficiency(return_stats=True)
    other.update([traces[1]], [puzzles[1]])
    assert all(metric._reductions[name] is not None for name in metric._defaults)  # summed across processes
    # what DDP's sum-reduction does: add the states of the two processes
    merged = ReasoningEfficiency(return_stats=True)
    for name in merged._defaults:
        setattr(merged, name, getattr(metric, name) + getattr(other, name))
    out = merged.compute()
    assert out["eta"].item() == pytest.approx(sum(expected) / 2)
    assert out["traces"].item() == 2 and out["empty"].item() == 1
    assert out["solved"].item() == 1.0 and out["dead_end_fraction"].item() == 0.0
    metric.merge_state(other)
    assert metric.compute()["eta"].item() == pytest.approx(sum(expected) / 2)
    plain = ReasoningEfficiency()
    assert math.isnan(plain.compute().item())
    plain.update(traces[:1], puzzles[:1])
    assert plain.compute().item() == pytest.approx(expected[0])


def test_draw_runs_headless():
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    puzzle = PUZZLES[0]
    ax = draw_reasoning_graph(_graph(puzzle, meandering_trace(puzzle, 0, dead_ends=3)))
    assert len(ax.collections) >= 2  # edges and two node shapes
    plt.close("all")
