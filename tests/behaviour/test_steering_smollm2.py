"""Behaviour on the real model: a diffmean "ocean" vector at SmolLM2's middle layer raises the concept's rate.

The vector is trained from 32 template contrast pairs (``lightning_llm.evaluation.steering_concepts.contrast_pairs``,
seed 0) at layer 15 of 30 and added at every position while SmolLM2-135M-Instruct greedily answers the first 8
neutral chat prompts of the study (24 new tokens); the rate is the fraction of answers the study's ocean keyword
detector flags, fluency the perplexity of the answers under the unsteered model.

Measured (2 shared CPU cores, one torch thread; 34 s under a load of ~10): at multiplier 0 the rate is 0/8
with perplexity 2.44; at multiplier 4 it is 3/8 with perplexity 17.2. At 8 the text breaks (perplexity in the
hundreds and the rate falls back, see ``benchmarks/results/steering_smollm2.json``), so the test steers at 4.
Margins: the rate must rise by at least 2/8 (one prompt below the measurement) and the steered perplexity stay
above the unsteered one and below 40 (2.3x the measurement).
"""

from __future__ import annotations

import math

import pytest

from lightning_llm.callbacks import train_steering_vector
from lightning_llm.evaluation.steering_concepts import (
    NEUTRAL_PROMPTS,
    chat_prompts,
    concept_detector,
    contrast_pairs,
    steer_and_score,
)

pytestmark = pytest.mark.pretrained
LAYER = 15


def test_ocean_vector_raises_concept_rate_and_text_stays_scorable(smollm2):
    model, tokenizer = smollm2
    side = tokenizer.padding_side
    vector = train_steering_vector(model, tokenizer, contrast_pairs("ocean", 32, 0), LAYER)
    assert tokenizer.padding_side == side
    chats = chat_prompts(tokenizer, NEUTRAL_PROMPTS[:8])
    detector = concept_detector("ocean")
    measured = {}
    for multiplier in (0.0, 4.0):
        out = steer_and_score(model, tokenizer, chats, vector, LAYER, multiplier, max_new_tokens=24)
        rate = sum(detector(out["texts"])) / len(chats)
        measured[multiplier] = (rate, math.exp(out["nll_sum"] / out["tokens"]))
    (rate0, ppl0), (rate4, ppl4) = measured[0.0], measured[4.0]
    assert rate4 - rate0 >= 2 / 8, measured
    assert ppl0 < ppl4 < 40.0, measured
