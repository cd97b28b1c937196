"""ActivationSteering hooks, and steering vectors trained from contrast pairs, on the tiny backbone."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_llm.callbacks import ActivationSteering, train_steering_vector
from lightning_llm.callbacks.steering import _pca_vector, decoder_layers, last_token_hidden

PAIRS = [
    ("the cat sees the fire", "the cat sees the sea"),
    ("a fox runs to the fire, the", "a fox runs to the water"),
    ("the owl is hot", "the owl is cold today"),
    ("fire", "water and stars"),
]


@pytest.fixture(scope="module")
def model_tok(tiny_backbone):
    model, tokenizer = tiny_backbone
    return copy.deepcopy(
        model
    ).eval(), tokenizer  # hooks are removed in every test, but never risk the session's


def _encode(tokenizer, texts):
    return tokenizer(texts, return_tensors="pt", padding=True)


def _hook_counts(model):
    """Forward (pre-)hooks on the backbone and each layer (transformers 5 keeps its own output-capturing ones)."""
    modules = [model.model, *model.model.layers]
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules]


def _hidden(model, enc):
    with torch.no_grad():
        return model(**enc, output_hidden_states=True).hidden_states


def test_decoder_layers_found_directly_and_through_a_wrapper(model_tok):
    model, _ = model_tok
    assert decoder_layers(model) is model.model.layers
    wrapper = nn.Module()
    wrapper.model = model
    assert decoder_layers(wrapper) is model.model.layers
    with pytest.raises(ValueError, match="cannot find the decoder layers"):
        decoder_layers(nn.Linear(2, 2))


@pytest.mark.parametrize("positions", ["all", "prompt"])
def test_vector_reaches_the_residual_exactly(model_tok, positions):
    model, tok = model_tok
    enc = _encode(tok, ["the cat sees the fire"])
    layer, mult = 1, 2.5
    v = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    plain = _hidden(model, enc)
    with ActivationSteering(v, layer=layer, multiplier=mult, positions=positions).attach(model):
        steered = _hidden(model, enc)
    # hidden_states[i] is the input of layer i: untouched up to and including layer `layer`'s input
    for i in range(layer + 1):
        assert torch.equal(steered[i], plain[i])
    diff = steered[layer + 1] - plain[layer + 1]
    torch.testing.assert_close(diff, (mult * v).expand_as(diff), atol=1e-5, rtol=0)


def test_prompt_steers_only_the_prompt_pass_of_generate(model_tok):
    model, tok = model_tok
    enc = _encode(tok, ["the cat sees the"])
    prompt_len = enc["input_ids"].shape[1]
    layer = 2
    v = 3.0 * torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=4, do_sample=False, output_hidden_states=True, return_dict_in_generate=True)
    with torch.no_grad():
        plain = model.generate(**enc, **gen)
        with ActivationSteering(v, layer=layer, positions="prompt").attach(model):
            steered = model.generate(**enc, **gen)
    # step 0 of generate is the prompt pass: every prompt position gets exactly v
    d0 = steered.hidden_states[0][layer + 1] - plain.hidden_states[0][layer + 1]
    assert steered.hidden_states[0][layer + 1].shape[1] == prompt_len
    torch.testing.assert_close(d0, v.expand_as(d0), atol=1e-5, rtol=0)
    # a decode step on the same (steered) prompt cache: "prompt" adds nothing, "all" adds exactly v at layer
    # `layer`, so the two agree up to that layer's input and differ by v at its output
    token = steered.sequences[:, prompt_len : prompt_len + 1]
    steps = {}
    for positions in ("prompt", "all"):
        with torch.no_grad(), ActivationSteering(v, layer=layer, positions=positions).attach(model):
            cache = model(**enc, use_cache=True).past_key_values  # a prompt pass: steered in both modes
            steps[positions] = model(
                input_ids=token, past_key_values=cache, use_cache=True, output_hidden_states=True
            ).hidden_states
    assert torch.equal(steps["all"][layer], steps["prompt"][layer])
    d = steps["all"][layer + 1] - steps["prompt"][layer + 1]
    torch.testing.assert_close(d, v.expand_as(d), atol=1e-4, rtol=0)


def test_model_bit_identical_after_removal_also_on_exception(model_tok):
    model, tok = model_tok
    enc = _encode(tok, ["the cat sees the fire", "a fox"])
    hooks_before = _hook_counts(model)
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(**enc).logits
    v = torch.ones(model.config.hidden_size)
    steering = ActivationSteering({0: v, 3: -v}, multiplier=5.0)
    with pytest.raises(RuntimeError, match="boom"):
        with steering.attach(model):
            assert steering.active
            with torch.no_grad():
                assert not torch.equal(model(**enc).logits, before)
            raise RuntimeError("boom")
    assert not steering.active
    assert _hook_counts(model) == hooks_before
    with torch.no_grad():
        after = model(**enc).logits
    assert torch.equal(after, before)
    assert before_state.keys() == model.state_dict().keys()
    assert all(torch.equal(before_state[k], t) for k, t in model.state_dict().items())
    # a vector of the wrong size fails inside the forward: the hooks still come off
    with pytest.raises(ValueError, match="hidden size"):
        with ActivationSteering(torch.ones(7), layer=1).attach(model):
            pass
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, before)


def test_clear_errors(model_tok):
    model, _ = model_tok
    hidden = model.config.hidden_size
    with pytest.raises(ValueError, match="out of range"):
        ActivationSteering(torch.ones(hidden), layer=99).register(model)
    with pytest.raises(ValueError, match="size 5"):
        ActivationSteering(torch.ones(5), layer=0).register(model)
    with pytest.raises(ValueError, match="needs `layer`"):
        ActivationSteering(torch.ones(hidden))
    with pytest.raises(ValueError, match=r"\[batch, hidden\]"):
        ActivationSteering(torch.ones(2, 3, hidden), layer=0)
    with pytest.raises(ValueError, match="disagrees"):
        ActivationSteering({0: torch.ones(hidden)}, layer=1)
    with pytest.raises(ValueError, match="positions"):
        ActivationSteering(torch.ones(hidden), layer=0, positions="response")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no model bound"):
        with ActivationSteering(torch.ones(hidden), layer=0):
            pass
    with pytest.raises(ValueError, match="out of range"):
        train_steering_vector(model, None, PAIRS, layer=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="method"):
        train_steering_vector(model, None, PAIRS, layer=0, method="mean")  # type: ignore[arg-type]


def test_dtype_cast(model_tok):
    model, tok = model_tok
    enc = _encode(tok, ["the cat"])
    v = torch.randn(model.config.hidden_size, dtype=torch.float64)
    plain = _hidden(model, enc)
    with ActivationSteering(v, layer=0).attach(model):
        steered = _hidden(model, enc)
    assert steered[1].dtype == torch.float32
    torch.testing.assert_close(steered[1] - plain[1], v.float().expand_as(plain[1]), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------- Lightning


class _Wrapper(L.LightningModule):
    """A minimal LightningModule holding the HF model as ``.model`` (as CausalLMModule does)."""

    def __init__(self, model: nn.Module, layer: int) -> None:
        super().__init__()
        self.model = model
        self.layer = layer

    def _hidden(self, batch):
        return self.model(**batch, output_hidden_states=True).hidden_states[self.layer + 1]

    def validation_step(self, batch, batch_idx):
        self.log("val/h", self._hidden(batch).mean())

    def predict_step(self, batch, batch_idx):
        return self._hidden(batch)


def test_callback_in_validate_and_predict(model_tok, quiet_trainer):
    model, tok = model_tok
    enc = _encode(tok, ["the cat sees the fire", "a fox runs"])
    batches = [{"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}]
    loader = DataLoader(batches, batch_size=None)
    layer = 1
    v = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    module = _Wrapper(model, layer)
    plain = quiet_trainer().predict(module, loader)[0]
    steering = ActivationSteering(v, layer=layer, multiplier=2.0)
    steered = quiet_trainer(callbacks=[steering]).predict(module, loader)[0]
    torch.testing.assert_close(steered - plain, (2.0 * v).expand_as(plain), atol=1e-5, rtol=0)
    assert not steering.active
    metrics_plain = quiet_trainer(limit_val_batches=1).validate(module, loader, verbose=False)[0]
    metrics = quiet_trainer(callbacks=[steering], limit_val_batches=1).validate(
        module, loader, verbose=False
    )[0]
    assert metrics["val/h"] == pytest.approx(metrics_plain["val/h"] + 2.0 * float(v.mean()), abs=1e-4)
    assert not steering.active
    with torch.no_grad():
        assert torch.equal(module._hidden(batches[0]), plain)


def test_callback_removes_hooks_on_exception(model_tok, quiet_trainer):
    model, tok = model_tok
    enc = _encode(tok, ["the cat"])

    class Failing(_Wrapper):
        def predict_step(self, batch, batch_idx):
            raise RuntimeError("predict failed")

    steering = ActivationSteering(torch.ones(model.config.hidden_size), layer=0, positions="prompt")
    hooks_before = _hook_counts(model)
    loader = DataLoader([dict(enc)], batch_size=None)
    with pytest.raises(RuntimeError, match="predict failed"):
        quiet_trainer(callbacks=[steering]).predict(Failing(model, 0), loader)
    assert not steering.active
    assert _hook_counts(model) == hooks_before


# ------------------------------------------------------------------------------------ training vectors


def test_last_token_hidden_matches_hf_hidden_states(model_tok):
    model, tok = model_tok
    texts = [p for p, _ in PAIRS]
    got = last_token_hidden(model, tok, texts, layer=1, batch_size=3)
    for i, text in enumerate(texts):
        ref = _hidden(model, _encode(tok, [text]))[2][0, -1]
        torch.testing.assert_close(got[i], ref, atol=1e-5, rtol=1e-5)


def test_diffmean_equals_hand_computation(model_tok):
    model, tok = model_tok
    layer = 2
    vec = train_steering_vector(model, tok, PAIRS, layer=layer, batch_size=2)
    diffs = []
    for pos, neg in PAIRS:
        hp = _hidden(model, _encode(tok, [pos]))[layer + 1][0, -1]
        hn = _hidden(model, _encode(tok, [neg]))[layer + 1][0, -1]
        diffs.append(hp - hn)
    torch.testing.assert_close(vec, torch.stack(diffs).mean(0), atol=1e-5, rtol=1e-5)


def test_left_and_right_padding_give_the_same_vector(model_tok):
    model, tok = model_tok
    tok = copy.deepcopy(tok)
    tok.padding_side = "right"
    right = train_steering_vector(model, tok, PAIRS, layer=1, batch_size=4)
    tok.padding_side = "left"
    left = train_steering_vector(model, tok, PAIRS, layer=1, batch_size=4)
    torch.testing.assert_close(left, right, atol=1e-5, rtol=1e-5)


def test_pca_sign_and_scale(model_tok):
    # synthetic: the differences share a direction; PCA must point along the mean and carry its projection
    g = torch.Generator().manual_seed(0)
    direction = torch.nn.functional.normalize(torch.randn(16, generator=g), dim=0)
    diffs = (
        torch.randn(40, 1, generator=g).abs().add(1.0) * direction
        - 0.0
        + 0.01 * torch.randn(40, 16, generator=g)
    )
    vec = _pca_vector(diffs)
    mean = diffs.mean(0)
    assert float(vec @ mean) > 0
    assert torch.nn.functional.cosine_similarity(vec, direction, dim=0) > 0.999
    w = torch.nn.functional.normalize(vec, dim=0)
    torch.testing.assert_close(vec, (mean @ w) * w)
    # the flipped data gives the flipped vector: the sign follows the mean difference, not the SVD's choice
    torch.testing.assert_close(_pca_vector(-diffs), -vec)
    # on the model: the pca vector is the mean difference's projection on the first singular direction
    model, tok = model_tok
    pca = train_steering_vector(model, tok, PAIRS, layer=1, method="pca")
    mean_model = train_steering_vector(model, tok, PAIRS, layer=1)
    assert float(pca @ mean_model) > 0
    assert pca.norm() <= mean_model.norm() + 1e-5


def test_per_row_vectors(model_tok):
    model, tok = model_tok
    enc = _encode(tok, ["the cat sees the fire", "a fox"])
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(2, model.config.hidden_size, generator=g)
    plain = _hidden(model, enc)
    with ActivationSteering(rows, layer=0, multiplier=0.5).attach(model):
        steered = _hidden(model, enc)
    diff = steered[1] - plain[1]
    torch.testing.assert_close(diff, (0.5 * rows)[:, None, :].expand_as(diff), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="per-row"):
        with ActivationSteering(rows, layer=0).attach(model):
            model(**_encode(tok, ["one text"]))
