"""PCFG: inside, next-token distributions, length mass and Viterbi against brute-force enumeration; sampling;
grammar files."""

from __future__ import annotations

import functools
import json
import math
from collections import Counter, defaultdict

import pytest
import torch

from lightning_llm.text.pcfg import PCFG

# S -> S S is ambiguous (Catalan-many parses), A/B give two parse labels for the same words.
_RULES = [
    ("S", ("A", "B"), 0.4),
    ("S", ("S", "S"), 0.15),
    ("S", ("x",), 0.45),
    ("A", ("A", "B"), 0.3),
    ("A", ("x",), 0.4),
    ("A", ("y",), 0.3),
    ("B", ("S", "A"), 0.2),
    ("B", ("y",), 0.5),
    ("B", ("z",), 0.3),
]


def _grammars() -> list[PCFG]:
    return [
        PCFG.from_rules(_RULES),
        PCFG.random(
            4,
            3,
            binary_rules=5,
            terminal_rules=2,
            binary_mass=0.4,
            start_binary_mass=0.7,
            levels=None,
            seed=3,
        ),
        PCFG.random(5, 4, levels=3, binary_mass=0.7, start_binary_mass=1.0, binary_rules=3, seed=1),
    ]


def _enumerate(grammar: PCFG, max_length: int) -> dict[tuple[int, ...], float]:
    """P(w) of every sentence of up to max_length words, by summing over all derivations (plain recursion)."""
    n, v = grammar.num_nonterminals, grammar.num_terminals
    strings: dict[tuple[int, int], dict[tuple[int, ...], float]] = {}
    for length in range(1, max_length + 1):
        for a in range(n):
            table: dict[tuple[int, ...], float] = defaultdict(float)
            if length == 1:
                for w in range(v):
                    table[(w,)] += float(grammar.emission[a, w])
            for b in range(n):
                for c in range(n):
                    p = float(grammar.binary[a, b, c])
                    for k in range(1, length):
                        for left, pl in strings[(b, k)].items():
                            for right, pr in strings[(c, length - k)].items():
                                table[left + right] += p * pl * pr
            strings[(a, length)] = {s: p for s, p in table.items() if p > 0}
    out: dict[tuple[int, ...], float] = {}
    for length in range(1, max_length + 1):
        out.update(strings[(grammar.start, length)])
    return out


@pytest.mark.parametrize("grammar", _grammars(), ids=["rules", "random", "layered"])
def test_inside_equals_enumeration(grammar):
    sentences = _enumerate(grammar, 5)
    words = [list(s) for s in sentences]
    ours = grammar.log_prob(words)
    exact = torch.tensor([math.log(sentences[tuple(w)]) for w in words], dtype=torch.float64)
    torch.testing.assert_close(ours, exact, rtol=0, atol=1e-12)
    # Spans of the chart are inside probabilities of their own non-terminal too (here: every prefix span).
    chart = grammar.log_inside(words[:5])
    assert chart.shape[-1] == grammar.num_nonterminals


@pytest.mark.parametrize("grammar", _grammars(), ids=["rules", "random", "layered"])
def test_length_probabilities_equal_enumeration(grammar):
    sentences = _enumerate(grammar, 5)
    by_length = Counter()
    for s, p in sentences.items():
        by_length[len(s)] += p
    ours = grammar.log_length_probs(5).exp()
    assert ours[0] == 0
    for length in range(1, 6):
        assert ours[length].item() == pytest.approx(by_length[length], abs=1e-12)


@pytest.mark.parametrize("grammar", _grammars(), ids=["rules", "random", "layered"])
@pytest.mark.parametrize("cap", [4, 5])
def test_next_token_distribution_equals_enumeration(grammar, cap):
    sentences = _enumerate(grammar, cap)
    words = sorted(sentences, key=lambda s: (-sentences[s], s))[:12]
    tables = grammar.next_token_logprobs([list(w) for w in words], max_length=cap, batch_size=5)
    eos = grammar.num_terminals
    for w, table in zip(words, tables, strict=True):
        assert table.shape == (len(w) + 1, grammar.num_terminals + 1)
        torch.testing.assert_close(table.exp().sum(-1), torch.ones(len(w) + 1, dtype=torch.float64))
        for t in range(len(w) + 1):
            prefix = w[:t]
            mass = sum(p for s, p in sentences.items() if s[:t] == prefix)
            expected = torch.zeros(grammar.num_terminals + 1, dtype=torch.float64)
            for s, p in sentences.items():
                if s[:t] == prefix:
                    expected[s[t] if len(s) > t else eos] += p / mass
            torch.testing.assert_close(table[t].exp(), expected, rtol=0, atol=1e-12)


def test_next_token_at_the_cap_is_end_of_sentence():
    grammar = PCFG.from_rules(_RULES)
    (table,) = grammar.next_token_logprobs([[0, 1, 2]], max_length=3)
    assert table[3, -1].exp().item() == pytest.approx(1.0)


def test_next_token_rejects_impossible_prefix_and_long_sentences():
    grammar = PCFG.from_rules([("S", ("A", "A"), 1.0), ("A", ("x",), 1.0)])
    with pytest.raises(ValueError, match="not a prefix"):
        grammar.next_token_logprobs([[0, 0, 0]], max_length=4)
    with pytest.raises(ValueError, match="longer than max_length"):
        grammar.next_token_logprobs([[0, 0]], max_length=1)


def _best_parse(grammar: PCFG, words: tuple[int, ...]) -> float:
    @functools.cache
    def best(a: int, i: int, j: int) -> float:
        if j - i == 1:
            p = float(grammar.emission[a, words[i]])
            return math.log(p) if p > 0 else -math.inf
        scores = [
            math.log(p) + best(b, i, k) + best(c, k, j)
            for b in range(grammar.num_nonterminals)
            for c in range(grammar.num_nonterminals)
            if (p := float(grammar.binary[a, b, c])) > 0
            for k in range(i + 1, j)
        ]
        return max(scores, default=-math.inf)

    return best(grammar.start, 0, len(words))


@pytest.mark.parametrize("grammar", _grammars(), ids=["rules", "random", "layered"])
def test_viterbi_is_the_best_parse(grammar):
    sentences = list(_enumerate(grammar, 5))[:20]
    parses = grammar.viterbi([list(s) for s in sentences], batch_size=7)
    for words, (logp, nodes) in zip(sentences, parses, strict=True):
        assert logp == pytest.approx(_best_parse(grammar, words), abs=1e-12)
        # The nodes form a tree over the sentence whose rule probabilities multiply to the parse probability.
        assert nodes[0].start == 0 and nodes[0].end == len(words) and nodes[0].label == grammar.start
        spans = {(c.start, c.end): c.label for c in nodes}
        total = 0.0
        for c in nodes:
            if c.end - c.start == 1:
                total += math.log(float(grammar.emission[c.label, words[c.start]]))
                continue
            (k,) = [k for k in range(c.start + 1, c.end) if (c.start, k) in spans and (k, c.end) in spans]
            total += math.log(float(grammar.binary[c.label, spans[(c.start, k)], spans[(k, c.end)]]))
        assert total == pytest.approx(logp, abs=1e-12)


def test_sampling_is_seeded_capped_and_follows_the_capped_distribution():
    grammar = PCFG.from_rules(_RULES)
    samples = grammar.sample(20000, max_length=4, seed=0)
    assert samples == grammar.sample(20000, max_length=4, seed=0)
    assert samples != grammar.sample(20000, max_length=4, seed=1)
    assert max(map(len, samples)) <= 4 and min(map(len, samples)) >= 1
    exact = _enumerate(grammar, 4)
    total = sum(exact.values())
    counts = Counter(map(tuple, samples))
    for sentence, p in sorted(exact.items(), key=lambda kv: -kv[1])[:8]:
        expected = p / total
        # Binomial standard error at n = 20000 is at most 0.0036: 5 sigma.
        assert counts[sentence] / len(samples) == pytest.approx(expected, abs=0.018)


def test_layered_grammar_is_bounded_by_its_depth():
    grammar = PCFG.random(7, 5, levels=4, binary_mass=1.0, start_binary_mass=1.0, seed=0)
    lengths = {len(s) for s in grammar.sample(500, max_length=64, seed=0)}
    assert lengths == {8}  # every symbol above the last level branches: a full binary tree of depth 3


def test_from_rules_rejects_what_is_not_a_cnf_distribution():
    with pytest.raises(ValueError, match="not in Chomsky normal form"):
        PCFG.from_rules([("S", ("A",), 1.0), ("A", ("x",), 1.0)])
    with pytest.raises(ValueError, match="two non-terminals"):
        PCFG.from_rules([("S", ("x", "y"), 1.0)])
    with pytest.raises(ValueError, match="one terminal or two non-terminals"):
        PCFG.from_rules([("S", ("S", "S", "S"), 0.5), ("S", ("x",), 0.5)])
    with pytest.raises(ValueError, match=r"sum to 0\.800000"):
        PCFG.from_rules([("S", ("x",), 0.8)])
    grammar = PCFG.from_rules([("S", ("x",), 2.0), ("S", ("y",), 2.0)], normalize=True)
    assert grammar.emission.tolist() == [[0.5, 0.5]]


def test_json_round_trip_and_errors(tmp_path):
    grammar = PCFG.random(4, 3, levels=3, seed=2)
    path = tmp_path / "g.json"
    grammar.save_json(path)
    again = PCFG.from_json(path)
    torch.testing.assert_close(again.binary, grammar.binary)
    torch.testing.assert_close(again.emission, grammar.emission)
    assert again.nonterminals == grammar.nonterminals and again.terminals == grammar.terminals
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"start": "S", "rules": [{"lhs": "S", "rhs": ["x"]}]}))
    with pytest.raises(ValueError, match=r"bad\.json: rule 0 needs the keys"):
        PCFG.from_json(bad)
    bad.write_text(json.dumps({"start": "S", "rules": [{"lhs": "S", "rhs": ["S"], "prob": 1.0}]}))
    with pytest.raises(ValueError, match=r"bad\.json: rule 0"):
        PCFG.from_json(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json: cannot read"):
        PCFG.from_json(bad)
