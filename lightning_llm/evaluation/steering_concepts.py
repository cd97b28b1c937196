"""Real concepts for steering a chat model: contrast pairs, neutral prompts, keyword detectors, steered scoring.

Per concept (``ocean``, ``food``, ``music``: :data:`CONCEPTS`) :func:`contrast_pairs` draws seeded pairs from
fixed sentence templates with one slot (``"I keep thinking about {}."``); the positive fills it with one of the
concept's phrases (``"the sea and its waves"``), the negative with one of a shared list of concept-free phrases
(``"the train timetable"``), the same template on both sides. :func:`concept_detector` is the concept's keyword
detector (:class:`~lightning_llm.evaluation.RegexConceptDetector`). :func:`steer_and_score` greedily answers
chat prompts (:func:`chat_prompts` of :data:`NEUTRAL_PROMPTS`) under
:class:`~lightning_llm.callbacks.ActivationSteering` and scores the answers' tokens under the unsteered model.
:func:`crh_differences` gives the per-sample differences of the CRH geometry
(:class:`~lightning_llm.evaluation.CylindricalAnalysis`): ``d_q = h_ℓ(q ⊕ y⁺_q) − h_ℓ(q ⊕ y⁻_q)`` at the last
token, with ``y±_q`` an assistant reply from a per-sample template whose slot holds a concept phrase or a
concept-free one. ``experiments/steering_smollm2.py`` runs the study on SmolLM2.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

import torch

from lightning_llm.backbones import apply_chat_template, stop_token_ids
from lightning_llm.callbacks import ActivationSteering
from lightning_llm.callbacks.steering import last_token_hidden
from lightning_llm.evaluation.steering import RegexConceptDetector

__all__ = [
    "CONCEPTS",
    "NEUTRAL_PROMPTS",
    "chat_prompts",
    "concept_detector",
    "contrast_pairs",
    "crh_differences",
    "steer_and_score",
]

#: ``concept -> (phrases that express it, detector words)``; a detector word matches as a whole word, with an
#: optional plural/verb suffix (``s``, ``es``, ``ing``, ``ed``).
CONCEPTS: dict[str, tuple[list[str], list[str]]] = {
    "ocean": (
        [
            "the ocean",
            "the sea and its waves",
            "the beach at high tide",
            "sailing on the open sea",
            "whales in the deep ocean",
            "coral reefs under the sea",
            "the salty sea breeze",
            "waves crashing on the shore",
        ],
        "ocean sea seashore seaside wave beach tide coral whale marine sail sailor shore coast surf "
        "underwater dolphin reef island boat ship".split(),
    ),
    "food": (
        [
            "delicious food",
            "fresh bread and cheese",
            "cooking a big dinner",
            "a warm bowl of pasta",
            "the taste of tomato soup",
            "baking a chocolate cake",
            "fresh fruit and vegetables",
            "a tasty home-made meal",
        ],
        "food meal dish cook cooking bake baking bread cheese pasta soup cake fruit vegetable delicious "
        "tasty taste recipe eat eating dinner lunch breakfast flavor flavour kitchen pizza chocolate".split(),
    ),
    "music": (
        [
            "music",
            "playing the guitar",
            "a song on the piano",
            "the band's new album",
            "singing a melody",
            "the orchestra's concert",
            "drums and rhythm",
            "a beautiful symphony",
        ],
        "music musical musician song sing singing singer melody guitar piano band album concert orchestra "
        "drum rhythm tune lyric symphony violin jazz choir".split(),
    ),
}

#: Concept-free fillers (the negatives of every concept).
NEUTRAL_PHRASES = [
    "the train timetable",
    "a list of phone numbers",
    "the new parking rules",
    "filling in the tax forms",
    "the office printer",
    "a meeting agenda",
    "the monthly calendar",
    "sorting old paperwork",
]

#: Sentence templates of the contrast pairs (one slot).
PAIR_TEMPLATES = [
    "I keep thinking about {}.",
    "Yesterday we talked for hours about {}.",
    "The whole article was about {}.",
    "Her favourite topic is {}.",
    "My notes are full of {}.",
    "Today's lesson covered {}.",
    "He wrote a long letter about {}.",
    "All I want to discuss is {}.",
]

#: Assistant-reply templates of the CRH samples (one slot), used round-robin over the prompts.
REPLY_TEMPLATES = [
    "Sure! Let me start with {}.",
    "That reminds me of {}.",
    "Good question. I would think about {}.",
    "Here is my answer: it is all about {}.",
]

#: Concept-neutral user prompts (the first ``--prompts`` are the steering prompts, ``--crh-prompts`` the CRH samples).
NEUTRAL_PROMPTS = [
    "Tell me about your day.",
    "What should I do this weekend?",
    "Describe a good morning routine.",
    "Write a sentence about a chair.",
    "Give me one tip for studying.",
    "What is a nice way to say thank you?",
    "Describe your favourite colour.",
    "How do I stay organised at work?",
    "Write a short note to a friend.",
    "What makes a good story?",
    "Tell me something interesting.",
    "How can I sleep better?",
    "Describe a quiet afternoon.",
    "What is a good hobby to start?",
    "Write one sentence about the city.",
    "How should I plan my week?",
    "What do you like about mornings?",
    "Give me advice for a job interview.",
    "Describe an old house.",
    "What is the best way to learn a language?",
    "Write a short poem about time.",
    "How do I write a good email?",
    "Tell me about a famous invention.",
    "What should I pack for a trip?",
    "Describe a busy street.",
    "How do I make new friends?",
    "What is your favourite season and why?",
    "Write a sentence about a clock.",
    "How can I be more patient?",
    "Describe the view from a window.",
    "What is a good habit to build?",
    "Tell me a fun fact about numbers.",
]


def concept_detector(concept: str) -> RegexConceptDetector:
    """Keyword detector of ``concept``: any of its words as a whole word (optional ``s/es/ing/ed``), any case."""
    words = "|".join(sorted(CONCEPTS[concept][1], key=len, reverse=True))
    return RegexConceptDetector(rf"\b(?:{words})(?:s|es|ing|ed)?\b", re.IGNORECASE)


def contrast_pairs(concept: str, n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` ``(with concept, without)`` sentences: a seeded template, concept phrase and neutral phrase each."""
    rng = random.Random(f"{concept}-{seed}")
    phrases = CONCEPTS[concept][0]
    out = []
    for _ in range(n):
        template = rng.choice(PAIR_TEMPLATES)
        out.append((template.format(rng.choice(phrases)), template.format(rng.choice(NEUTRAL_PHRASES))))
    return out


def chat_prompts(tokenizer: Any, prompts: Sequence[str]) -> list[str]:
    """Each prompt as one user turn in the tokenizer's chat template, ready for the assistant's reply."""
    return [
        apply_chat_template(tokenizer, [{"role": "user", "content": p}], add_generation_prompt=True)
        for p in prompts
    ]


@torch.no_grad()
def steer_and_score(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    vector: torch.Tensor | None,
    layer: int,
    multiplier: float,
    max_new_tokens: int,
) -> dict[str, Any]:
    """Greedy answers of ``prompts`` steered by ``multiplier · vector`` at ``layer`` (all positions), and their
    token NLL under the unsteered model.

    ``vector`` is ``[hidden]``, ``[len(prompts), hidden]`` (one per prompt) or ``None`` (unsteered). One
    left-padded batch. The scored tokens of an answer are those before its first end-of-sequence token.
    Returns ``{"texts", "nll_sum", "tokens", "per_prompt_tokens"}``.
    """
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(list(prompts), return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    stops = stop_token_ids(tokenizer, model)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=stops,
    )
    if vector is None or multiplier == 0:
        ids = model.generate(**enc, **kwargs)
    else:
        with ActivationSteering(vector, layer=layer, multiplier=multiplier).attach(model):
            ids = model.generate(**enc, **kwargs)
    width = enc["input_ids"].shape[1]
    new = ids[:, width:]
    eos = torch.tensor(sorted({*stops, tokenizer.pad_token_id} - {None}), dtype=torch.long)
    is_end = torch.isin(new, eos)
    keep = (is_end.cumsum(-1) == 0).long()  # tokens before the first end-of-sequence token
    mask = torch.cat([enc["attention_mask"], keep], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, width - 1 : -1]
    nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), new, reduction="none")
    texts = tokenizer.batch_decode(
        torch.where(keep.bool(), new, tokenizer.pad_token_id), skip_special_tokens=True
    )
    return {
        "texts": texts,
        "nll_sum": float((nll * keep).sum()),
        "tokens": int(keep.sum()),
        "per_prompt_tokens": keep.sum(-1).tolist(),
    }


def crh_differences(
    model: Any, tokenizer: Any, concept: str, chats: Sequence[str], layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, pre)``: ``[N, D]`` per-sample differences ``h(q ⊕ y⁺_q) − h(q ⊕ y⁻_q)`` and ``[N, D]`` the prompt's
    own last-token state (the pre-response features for the sector predictability), both at ``layer``."""
    phrases = CONCEPTS[concept][0]
    pos, neg = [], []
    for i, chat in enumerate(chats):
        template = REPLY_TEMPLATES[i % len(REPLY_TEMPLATES)]
        pos.append(chat + template.format(phrases[i % len(phrases)]))
        neg.append(
            chat + template.format(NEUTRAL_PHRASES[(i + i // len(NEUTRAL_PHRASES)) % len(NEUTRAL_PHRASES)])
        )
    d = last_token_hidden(model, tokenizer, pos, layer) - last_token_hidden(model, tokenizer, neg, layer)
    return d, last_token_hidden(model, tokenizer, list(chats), layer)
