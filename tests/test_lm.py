"""The two log-prob paths of ``lightning_llm.lm``: the fused kernel and the plain path (the model's own logits,
chunked over positions), chosen from the model."""

from __future__ import annotations

import pytest
import torch

from lightning_llm.kernels import entropy_dynamics_reference
from lightning_llm.lm import (
    check_fused_compatible,
    head_logits,
    logprob_path,
    position_ids_from_mask,
    target_logprobs,
)

VOCAB = 96


def _llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
        **overrides,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _gemma2(softcap: float = 3.0):
    """A random-init Gemma 2 whose logits reach well past the soft cap (head scaled up), so capping matters."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        sliding_window=8,
        final_logit_softcapping=softcap,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 11), generator=gen)
    attention = torch.ones_like(ids)
    attention[0, :3] = 0  # left padding
    attention[2, :1] = 0
    target = torch.zeros_like(ids, dtype=torch.bool)
    target[:, 5:] = True
    target[1, 9:] = False
    return ids, attention, target & attention.bool()


def _reference(model, ids, attention, target, temperature):
    """log_softmax of the model's own logits at the targets, and the entropy, the dynamics terms."""
    logits = model(
        input_ids=ids, attention_mask=attention, position_ids=position_ids_from_mask(attention)
    ).logits
    z = logits.float()[:, :-1][target[:, 1:]] / temperature
    y = ids[:, 1:][target[:, 1:]]
    log_p = torch.log_softmax(z, dim=-1)
    s, n = entropy_dynamics_reference(z)
    return (
        log_p.gather(1, y[:, None]).squeeze(1),
        -(log_p.exp() * log_p).sum(-1),
        s.gather(1, y[:, None]).squeeze(1),
        n,
    )


def _grads(model, outputs):
    model.zero_grad()
    (outputs[0].sum() + 0.3 * outputs[1].sum()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_path_is_chosen_from_the_model():
    assert logprob_path(_llama()) == "fused"
    assert logprob_path(_gemma2()) == "plain"
    assert logprob_path(_llama(logit_scale=0.5)) == "plain"
    biased = _llama()
    biased.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB))
    assert logprob_path(biased) == "plain"
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        check_fused_compatible(_gemma2())


def test_plain_path_equals_fused_path_with_gradients():
    """Where both apply (a plain linear head, fp32) the plain path gives the fused kernel's values and grads."""
    model = _llama()
    ids, attention, target = _batch()
    kwargs = dict(temperature=0.7, with_dynamics=True)
    fused = target_logprobs(model, ids, attention, target, path="fused", chunk_size=4, **kwargs)
    fused_grads = _grads(model, fused)
    plain = target_logprobs(model, ids, attention, target, path="plain", chunk_size=4, **kwargs)
    plain_grads = _grads(model, plain)
    assert fused[0].shape == (int(target[:, 1:].sum()),)
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fused_grads.keys() == plain_grads.keys() and "lm_head.weight" in plain_grads
    for name, grad in fused_grads.items():
        torch.testing.assert_close(plain_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_plain_path_is_exact_on_a_soft_capped_model():
    model = _gemma2()
    ids, attention, target = _batch()
    reference = _reference(model, ids, attention, target, 0.7)
    ref_grads = _grads(model, reference)
    plain = target_logprobs(model, ids, attention, target, chunk_size=3, temperature=0.7, with_dynamics=True)
    plain_grads = _grads(model, plain)
    for a, b in zip(plain, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(plain_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    # the fused kernel, which ignores the cap, is far off here: the test sees the capping
    fused = target_logprobs(model, ids, attention, target, path="fused", temperature=0.7)
    assert (fused[0] - reference[0]).abs().max() > 0.5


def test_plain_path_holds_one_chunk_of_logits_at_a_time():
    """The head sees at most ``chunk_size`` positions per call, in forward and in the backward recompute."""
    model = _gemma2()
    ids, attention, target = _batch()
    rows: list[int] = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: rows.append(out.shape[-2]))
    try:
        logprobs, entropy = target_logprobs(model, ids, attention, target, chunk_size=4)
        forward_calls = len(rows)
        (logprobs.sum() + entropy.sum()).backward()
    finally:
        handle.remove()
    n = int(target[:, 1:].sum())
    assert forward_calls == -(-n // 4) and len(rows) == 2 * forward_calls  # recomputed once in backward
    assert max(rows) == 4


def test_head_logits_is_the_models_own_forward():
    model = _gemma2()
    ids, attention, _ = _batch()
    out = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    hidden = out.hidden_states[-1][attention.bool()]
    torch.testing.assert_close(head_logits(model, hidden), out.logits[attention.bool()], rtol=1e-6, atol=1e-6)
    assert type(model.get_decoder()).__name__ == "Gemma2Model"  # restored after the call
