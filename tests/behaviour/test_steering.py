"""Behaviour: steering along the CRH axis of a synthetic concept raises its frequency monotonically in L.

A deep copy of the tiny backbone is fine-tuned (plain torch loop, AdamW, 250 steps of 16 texts) on
``"Q: what does the <animal> see?\\nA: the <animal> sees the X, the Y, the Z."``. With a per-animal probability
(0.05 ... 0.4) a response is in *fire mode*: each slot is ``fire`` with probability 0.8, so "fire already said"
predicts more fire and the model gets an internal fire feature; otherwise the slots are drawn from five other
objects. The CRH difference vectors are read at layer 1, at the last token of a response prefix with and
without the concept, ``d_q = h_1(q + " the <animal> sees the fire, the") - h_1(q + " ... the <other>, the")``,
and the axis is their mean. Steering adds ``L · â`` (in units of the axis norm ``|a|``) at every position
while the model greedily answers each of the 24 prompts (12 new tokens); the concept frequency is the fraction
of answers containing ``fire``.

Measured on 2 CPU cores (seed 0, ~20 s idle; transformers 5.24, torch CPU): mean cos θ_q = 0.985, |a| = 17.6
(the residual's norm at that layer is ≈ 33); concept frequency at L = 0, 0.1, 0.2, 0.3, 0.4 (x |a|) =
0.04, 0.08, 0.33, 0.79, 1.00 (finer: 0.05 -> 0.08, 0.15 -> 0.25, 0.5 -> 1.0; at 1.5 |a| the text starts to
break and it falls back to 0.92, so the grid stays below that).
"""

from __future__ import annotations

import copy
import itertools
import random

import lightning as L
import pytest
import torch

from lightning_llm.callbacks import train_steering_vector
from lightning_llm.callbacks.steering import last_token_hidden
from lightning_llm.evaluation import CylindricalAnalysis, RegexConceptDetector, steered_generations

ANIMALS = "cat fox dog bird fish frog owl bear wolf deer goat lamb duck crow mole seal hare lion mouse horse snake whale tiger eagle".split()
OTHERS = ["water", "river", "stars", "sea", "city"]
CONCEPT = "fire"
LAYER = 1
GRID = (0.0, 0.1, 0.2, 0.3, 0.4)  # L in units of the axis norm
STEPS, BATCH, LR = 250, 16, 2e-3


def _prompt(animal: str) -> str:
    return f"Q: what does the {animal} see?\nA:"


def _response(animal: str, fire: bool, rng: random.Random) -> str:
    slots = [
        (CONCEPT if rng.random() < 0.8 else rng.choice(OTHERS)) if fire else rng.choice(OTHERS)
        for _ in range(3)
    ]
    if fire and CONCEPT not in slots:
        slots[0] = CONCEPT
    return f" the {animal} sees the " + ", the ".join(slots) + "."


def _train(model, tokenizer, seed: int = 0):
    rng = random.Random(seed)
    p_fire = {a: 0.05 + 0.35 * i / (len(ANIMALS) - 1) for i, a in enumerate(ANIMALS)}
    texts = []
    for _ in range(3000):
        animal = rng.choice(ANIMALS)
        texts.append(_prompt(animal) + _response(animal, rng.random() < p_fire[animal], rng) + "\n")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    for _ in range(STEPS):
        enc = tokenizer(rng.sample(texts, BATCH), return_tensors="pt", padding=True)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        model(**enc, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.eval()


def contrast_pairs() -> list[tuple[str, str]]:
    return [
        (
            _prompt(a) + f" the {a} sees the {CONCEPT}, the",
            _prompt(a) + f" the {a} sees the {OTHERS[i % 5]}, the",
        )
        for i, a in enumerate(ANIMALS)
    ]


@pytest.fixture(scope="module")
def trained(tiny_backbone):
    L.seed_everything(0)
    model, tokenizer = tiny_backbone
    return _train(copy.deepcopy(model), tokenizer), tokenizer


def test_axis_steering_raises_concept_frequency_monotonically(trained):
    model, tokenizer = trained
    pairs = contrast_pairs()
    pos = last_token_hidden(model, tokenizer, [p for p, _ in pairs], LAYER)
    neg = last_token_hidden(model, tokenizer, [n for _, n in pairs], LAYER)
    analysis = CylindricalAnalysis(pos - neg)
    axis = train_steering_vector(model, tokenizer, pairs, LAYER)
    torch.testing.assert_close(axis.double(), analysis.axis, atol=1e-4, rtol=1e-4)
    detector = RegexConceptDetector(rf"\b{CONCEPT}\b")
    prompts = [_prompt(a) for a in ANIMALS]
    unit = analysis.axis_unit.float()
    norm = float(analysis.axis.norm())
    freq = []
    for length in GRID:
        texts = steered_generations(
            model, tokenizer, prompts, unit, LAYER, multiplier=length * norm, max_new_tokens=12
        )
        hits = detector(texts)
        freq.append(sum(hits) / len(hits))
    print(f"|a| = {norm:.2f}, mean cos θ = {float(analysis.cos_theta.mean()):.3f}, frequency vs L: {freq}")
    assert all(b >= a for a, b in itertools.pairwise(freq)), freq
    assert freq[-1] - freq[0] >= 0.5, freq
    assert freq[0] <= 0.25, freq
