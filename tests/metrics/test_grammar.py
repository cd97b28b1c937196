"""Grammar KL: zero for the exact distribution, the model tables line up with the model's logits, n-gram
baselines are proper distributions fitted from counts, and the metric reduces as a sum."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_llm.metrics.grammar import GrammarKL, NGramModel, grammar_kl, model_next_token_logprobs
from lightning_llm.text.pcfg import PCFG


@pytest.fixture(scope="module")
def grammar() -> PCFG:
    return PCFG.random(5, 4, levels=3, binary_mass=0.7, seed=0)


def test_kl_of_the_exact_distribution_is_zero_and_positive_otherwise(grammar):
    sentences = grammar.sample(6, max_length=8, seed=0)
    exact = grammar.next_token_logprobs(sentences, max_length=8)
    for table in exact:
        torch.testing.assert_close(grammar_kl(table, table), torch.zeros(len(table), dtype=torch.float64))
        uniform = torch.full_like(table, -math.log(table.shape[1]))
        assert (grammar_kl(table, uniform) >= -1e-12).all()
        assert grammar_kl(table, uniform).sum() > 0
    # Mass a model puts outside the grammar's symbols counts against it (no renormalisation).
    table = exact[0]
    assert (grammar_kl(table, table - math.log(2)) - math.log(2)).abs().max() < 1e-12


def test_metric_sums_over_updates(grammar):
    sentences = grammar.sample(8, max_length=8, seed=1)
    metric = GrammarKL(grammar, max_length=8)
    exact = metric.grammar_logprobs(sentences)
    shifted = [t.roll(1, dims=-1) for t in exact]
    kl = torch.cat([grammar_kl(e, s) for e, s in zip(exact, shifted, strict=True)])
    metric.update(shifted[:3], sentences[:3])
    metric.update(shifted[3:], sentences[3:])
    assert metric.compute().item() == pytest.approx(kl.mean().item(), rel=1e-12)
    metric.reset()
    metric.update(exact, sentences)
    assert metric.compute().item() == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="2 model tables for 3 sentences"):
        metric.update(exact[:2], sentences[:3])


def test_model_tables_are_the_logits_at_the_right_positions(tiny_backbone):
    model, _ = tiny_backbone
    token_ids, bos, eos = [67, 68, 69], 2, 2
    sentences = [[0, 2, 1], [1], [2, 2, 0, 0, 1]]
    tables = model_next_token_logprobs(
        model, sentences, token_ids=token_ids, bos_id=bos, eos_id=eos, batch_size=2
    )
    for sentence, table in zip(sentences, tables, strict=True):
        ids = torch.tensor([[bos, *(token_ids[w] for w in sentence)]])
        with torch.no_grad():
            logprobs = model(input_ids=ids).logits[0].float().log_softmax(-1)
        expected = logprobs[:, [*token_ids, eos]].double()
        torch.testing.assert_close(table, expected, rtol=1e-5, atol=1e-5)


def test_ngram_counts_and_normalisation():
    sentences = [[0, 1], [0, 1], [1]]
    bigram = NGramModel(2, num_terminals=2, smoothing=0.5).fit(sentences)
    (table,) = bigram.next_token_logprobs([[0, 1]])
    torch.testing.assert_close(table.exp().sum(-1), torch.ones(3, dtype=torch.float64))
    # After bos: "0" twice, "1" once, eos never -> (2.5, 1.5, 0.5) / 4.5.
    torch.testing.assert_close(table[0].exp(), torch.tensor([2.5, 1.5, 0.5], dtype=torch.float64) / 4.5)
    # After "1": eos three times -> (0.5, 0.5, 3.5) / 4.5.
    torch.testing.assert_close(table[2].exp(), torch.tensor([0.5, 0.5, 3.5], dtype=torch.float64) / 4.5)
    with pytest.raises(ValueError, match="smoothing must be > 0"):
        NGramModel(2, 2, smoothing=0)


def test_ngram_approaches_a_regular_grammar(grammar):
    """A grammar whose only binary rules are S -> X S (right-branching: a Markov chain) is an n-gram source."""
    chain = PCFG.from_rules(
        [("S", ("A", "S"), 0.6), ("S", ("x",), 0.4), ("A", ("x",), 0.5), ("A", ("y",), 0.5)]
    )
    train = chain.sample(4000, max_length=30, seed=0)
    test = chain.sample(20, max_length=30, seed=1)
    exact = chain.next_token_logprobs(test, max_length=30)
    unigram = NGramModel(1, chain.num_terminals).fit(train).next_token_logprobs(test)
    trigram = NGramModel(3, chain.num_terminals).fit(train).next_token_logprobs(test)
    kl_uni = torch.cat([grammar_kl(e, m) for e, m in zip(exact, unigram, strict=True)]).mean()
    kl_tri = torch.cat([grammar_kl(e, m) for e, m in zip(exact, trigram, strict=True)]).mean()
    assert kl_tri < 0.02 < kl_uni
