"""The steering study's helpers: contrast pairs, concept detectors, steered answers and their perplexity."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_llm.evaluation.steering_concepts import (
    CONCEPTS,
    NEUTRAL_PHRASES,
    PAIR_TEMPLATES,
    concept_detector,
    contrast_pairs,
    steer_and_score,
)


def test_contrast_pairs_differ_only_in_the_slot_and_are_seeded():
    pairs = contrast_pairs("food", 24, seed=3)
    assert pairs == contrast_pairs("food", 24, seed=3)
    assert pairs != contrast_pairs("food", 24, seed=4)
    for positive, negative in pairs:
        template = next(t for t in PAIR_TEMPLATES if positive.startswith(t.split("{}")[0]))
        head, tail = template.split("{}")
        assert positive.endswith(tail) and negative.startswith(head) and negative.endswith(tail)
        assert positive[len(head) : len(positive) - len(tail)] in CONCEPTS["food"][0]
        assert negative[len(head) : len(negative) - len(tail)] in NEUTRAL_PHRASES


@pytest.mark.parametrize("concept", sorted(CONCEPTS))
def test_detector_flags_every_positive_phrase_and_no_neutral_one(concept):
    detect = concept_detector(concept)
    assert all(detect(CONCEPTS[concept][0]))
    assert not any(detect(NEUTRAL_PHRASES))


def test_detector_matches_whole_words_with_inflections_only():
    detect = concept_detector("ocean")
    assert detect(["Waves everywhere", "we went SAILING", "two whales"]) == [True, True, True]
    assert detect(["a new season", "the seamstress", "the tides"]) == [False, False, True]


def test_steered_scores_match_one_prompt_at_a_time(tiny_backbone):
    """Left-padded batch scoring gives each answer the NLL it gets alone; multiplier 0 is unsteered."""
    model, tokenizer = tiny_backbone
    model.eval()
    prompts = ["Q: what does the cat see?\nA:", "Q: and what does the very old grey wolf see?\nA:"]
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    plain = steer_and_score(model, tokenizer, prompts, None, 1, 0.0, max_new_tokens=6)
    assert steer_and_score(model, tokenizer, prompts, vector, 1, 0.0, max_new_tokens=6) == plain
    steered = steer_and_score(model, tokenizer, prompts, vector, 1, 8.0, max_new_tokens=6)
    assert steered["texts"] != plain["texts"]
    alone = [steer_and_score(model, tokenizer, [p], vector, 1, 8.0, max_new_tokens=6) for p in prompts]
    assert [a["texts"][0] for a in alone] == steered["texts"]
    assert sum(a["tokens"] for a in alone) == steered["tokens"] <= 12
    assert math.isclose(sum(a["nll_sum"] for a in alone), steered["nll_sum"], rel_tol=1e-4)
