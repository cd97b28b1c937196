"""Top-activating contexts of a planted SAE feature, feature judges, and SAE steering on the tiny backbone."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_llm.callbacks import ActivationSteering
from lightning_llm.evaluation import (
    FeatureContext,
    HeuristicFeatureJudge,
    LLMFeatureJudge,
    SAESteering,
    feature_quality,
    sae_steering_vector,
    top_activating_contexts,
)
from lightning_llm.sae import SparseAutoencoder

TEXTS = [
    "the cat sees the fire and the cat runs",
    "a fox is hot today",
    "my cat likes the sea",
    "water and stars over the hills",
    "one small cat, two big dogs",
    "the owl is cold",
    "she reads a book by the cat",
    "birds sing in the morning light",
]
LAYER = 0


def hand_sae(W_enc: Tensor, b_enc: Tensor, W_dec: Tensor, b_dec: Tensor) -> SparseAutoencoder:
    """A hand-set ReLU SAE: ``f = relu((x - b_dec) W_enc + b_enc)``, ``x̂ = f W_dec + b_dec``."""
    return SparseAutoencoder.from_weights(W_enc.T, b_enc, W_dec, b_dec)


@pytest.fixture(scope="module")
def model_tok(tiny_backbone):
    model, tokenizer = tiny_backbone
    return copy.deepcopy(
        model
    ).eval(), tokenizer  # hooks are removed in every test, but never risk the session's


@pytest.fixture(scope="module")
def corpus(model_tok):
    _, tok = model_tok
    return tok(TEXTS, return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def cat_id(model_tok):
    (token,) = model_tok[1](" cat")["input_ids"]
    return token


@pytest.fixture(scope="module")
def planted(model_tok, corpus, cat_id):
    """An SAE whose feature 0 fires exactly on the " cat" tokens (a linear separator of layer-0 states),
    features 1..7 random directions."""
    model, _ = model_tok
    with torch.no_grad():
        hidden = model(**corpus, output_hidden_states=True).hidden_states[LAYER + 1]
    real = corpus["attention_mask"].bool()
    states, is_cat = hidden[real], corpus["input_ids"][real] == cat_id
    direction = states[is_cat].mean(0) - states[~is_cat].mean(0)
    direction = direction / direction.norm()
    score = states @ direction
    low, high = score[~is_cat].max(), score[is_cat].min()
    assert low < high, "the planted feature needs ' cat' states to be linearly separable"
    g = torch.Generator().manual_seed(0)
    d, m = states.shape[1], 8
    W_dec = torch.randn(m, d, generator=g)
    W_dec = W_dec / W_dec.norm(dim=1, keepdim=True)
    W_enc = W_dec.T.clone()
    W_enc[:, 0] = 100 * direction
    b_enc = torch.zeros(m)
    b_enc[0] = -100 * (low + high) / 2
    return hand_sae(W_enc, b_enc, W_dec, torch.zeros(d))


def test_planted_feature_returns_exactly_its_token(model_tok, corpus, planted, cat_id):
    model, tok = model_tok
    n_cats = int((corpus["input_ids"][corpus["attention_mask"].bool()] == cat_id).sum())
    everything = top_activating_contexts(
        model, tok, planted, LAYER, corpus["input_ids"], corpus["attention_mask"], features=[0], k=50
    )
    contexts = everything[0]
    assert len(contexts) == n_cats == 5
    assert all(c.token_id == cat_id and c.token == " cat" for c in contexts)
    assert all(corpus["input_ids"][c.sequence_index, c.position] == cat_id for c in contexts)
    assert [c.activation for c in contexts] == sorted((c.activation for c in contexts), reverse=True)
    assert all("[[ cat]]" in c.context_text for c in contexts)
    # k respected, and batching does not change the result
    top3 = top_activating_contexts(
        model, tok, planted, LAYER, corpus["input_ids"], corpus["attention_mask"], [0], k=3, batch_size=3
    )[0]
    assert top3 == contexts[:3]


def test_context_window_and_all_features(model_tok, corpus, planted):
    model, tok = model_tok
    result = top_activating_contexts(
        model, tok, planted, LAYER, corpus["input_ids"], corpus["attention_mask"], k=4, window=1
    )
    assert sorted(result) == list(range(planted.d_sae))
    assert all(1 <= len(c) <= 4 for c in result.values())
    c = result[1][0]
    ids = corpus["input_ids"][c.sequence_index].tolist()
    assert c.context_text.count("[[") == 1
    left = tok.decode(ids[max(0, c.position - 1) : c.position])
    assert c.context_text.startswith(left + "[[" + c.token + "]]")
    with pytest.raises(ValueError, match="features"):
        top_activating_contexts(
            model, tok, planted, LAYER, corpus["input_ids"], corpus["attention_mask"], [99]
        )


def test_heuristic_judge_and_feature_quality(model_tok, corpus, planted):
    model, tok = model_tok
    contexts = top_activating_contexts(
        model, tok, planted, LAYER, corpus["input_ids"], corpus["attention_mask"], [0, 1], k=10
    )
    judge = HeuristicFeatureJudge()
    assert judge.score(0, contexts[0]) == 1.0
    assert judge.score(1, contexts[1]) < 0.5
    quality = feature_quality(judge, {**contexts, 5: []})
    assert quality["scores"][0] == 1.0 and set(quality["scores"]) == {0, 1}
    assert quality["high_quality_share"] == 0.5
    assert quality["judged"] == 2 and quality["skipped"] == 1


def _ctx(text: str, activation: float = 1.0) -> FeatureContext:
    return FeatureContext(activation, " cat", text, 0, 0, 1)


def test_llm_judge_parses_a_strict_score_line_only():
    prompts: list[str] = []
    replies = iter(
        [
            "The excerpts are all about cats.\nSCORE: 4",
            "score:5",
            "I'd say 4",
            "SCORE: 7",
            "SCORE: 3\nSCORE: 4",
            "SCORE: 3.5",
            "__import__('os').system('echo hi')",
        ]
    )

    def generate(prompt: str) -> str:
        prompts.append(prompt)
        return next(replies)

    judge = LLMFeatureJudge(generate)
    contexts = [_ctx("the [[ cat]] {sat}\nhere", 2.5), _ctx("a [[ cat]]")]
    assert judge.score(3, contexts) == 0.75
    assert "1. (activation 2.5) the [[ cat]] {sat}\\nhere" in prompts[0] and "2. " in prompts[0]
    assert judge.score(3, contexts) == 1.0
    assert [judge.score(3, contexts) for _ in range(5)] == [0.0] * 5
    assert judge.unparsed == 5
    strict = LLMFeatureJudge(lambda prompt: "no score here", unparsed_score=None)
    with pytest.raises(ValueError, match="SCORE"):
        strict.score(0, contexts)
    with pytest.raises(ValueError, match="contexts"):
        LLMFeatureJudge(generate, template="no placeholder")


def _logits(model, enc) -> Tensor:
    with torch.no_grad():
        return model(**enc).logits


def test_sae_steering_is_activation_steering_along_decoder_rows(model_tok, planted):
    model, tok = model_tok
    enc = tok(["the cat sees the fire"], return_tensors="pt")
    plain = _logits(model, enc)
    with SAESteering(planted, 3, layer=1, alpha=0.0).attach(model):
        assert torch.equal(_logits(model, enc), plain)
    steering = SAESteering(planted, 3, layer=1, alpha=4.0, scale=2.0)
    assert isinstance(steering, ActivationSteering) and isinstance(steering, Callback)
    with steering.attach(model):
        steered = _logits(model, enc)
    with ActivationSteering(planted.W_dec[3].detach() / 2.0, layer=1, multiplier=4.0).attach(model):
        reference = _logits(model, enc)
    assert torch.equal(steered, reference) and not torch.equal(steered, plain)
    assert not steering.active  # hooks removed on exit
    # several features with their own weights: sum_k a_k W_dec[k] / c
    vector = sae_steering_vector(planted, {1: 0.5, 2: -1.5}, scale=2.0)
    expected = (0.5 * planted.W_dec[1] - 1.5 * planted.W_dec[2]).detach() / 2.0
    torch.testing.assert_close(vector, expected, rtol=1e-6, atol=1e-7)
    multi = SAESteering(planted, {1: 0.5, 2: -1.5}, layer=1, scale=2.0)
    multi.alpha = 3.0
    with multi.attach(model):
        steered = _logits(model, enc)
    with ActivationSteering(vector, layer=1, multiplier=3.0).attach(model):
        assert torch.equal(_logits(model, enc), steered)
    with pytest.raises(ValueError, match="out of range"):
        SAESteering(planted, 42, layer=1)
