"""KV eviction on a hybrid sliding-window/global model (Gemma 3 layout): random-init, 5 sliding : 1 global layers.

Sliding-window layers keep their own window (``sliding_window - 1`` tokens, as transformers' cache does); the
policy evicts only in the global layer; the accounting counts both.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.eviction import H2O, FullCache, SnapKV, StreamingLLM, generate_with_budget, record_prefill

PROMPT, WINDOW, NEW = 30, 8, 6
LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
HEAD_DIM, KV_HEADS = 16, 1
GLOBAL = LAYERS.index("full_attention")


@pytest.fixture(scope="module")
def hybrid():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYERS),
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        sliding_window=WINDOW,
        layer_types=LAYERS,
        max_position_embeddings=256,
        query_pre_attn_scalar=HEAD_DIM,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return Gemma3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 500, (1, PROMPT), generator=torch.Generator().manual_seed(0))


def _bytes(slots: int) -> int:
    return slots * 2 * KV_HEADS * HEAD_DIM * 4  # (k, v) x Hkv x D x fp32


@pytest.mark.parametrize("policy", [FullCache(), StreamingLLM(), H2O(), SnapKV()], ids=repr)
def test_budget_above_the_prompt_is_transformers_own_generation(hybrid, prompt, policy):
    ref = hybrid.generate(
        prompt, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    out = generate_with_budget(
        hybrid, prompt, policy=policy, budget=64, max_new_tokens=NEW, output_logits=True
    )
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.logits, torch.stack(ref.logits, dim=1), rtol=1e-5, atol=1e-5)
    seen = PROMPT + NEW - 1
    for i, st in enumerate(out.cache_stats):
        kept = seen if i == GLOBAL else WINDOW - 1
        assert (st.seen, st.kept, st.evicted, st.peak_kept) == (seen, kept, seen - kept, kept), i
    assert out.peak_cache_bytes == 5 * _bytes(WINDOW - 1) + _bytes(seen)


@pytest.mark.parametrize(
    "policy", [StreamingLLM(2, 4), H2O(2, 4), SnapKV(2, 4, observation_window=4)], ids=repr
)
def test_small_budget_evicts_only_in_the_global_layer(hybrid, prompt, policy):
    budget = 12
    out = generate_with_budget(
        hybrid, prompt, policy=policy, budget=budget, max_new_tokens=NEW, output_logits=True
    )
    seen = PROMPT + NEW - 1
    for i, st in enumerate(out.cache_stats):
        kept = budget if i == GLOBAL else WINDOW - 1
        assert (st.seen, st.kept, st.evicted, st.peak_kept) == (seen, kept, seen - kept, kept), i
    assert out.peak_cache_bytes == 5 * _bytes(WINDOW - 1) + _bytes(budget)
    # a recorded prefill replays into the hybrid cache exactly as the prefill forward would have filled it
    replayed = generate_with_budget(
        hybrid,
        prompt,
        policy=policy,
        budget=budget,
        max_new_tokens=NEW,
        output_logits=True,
        prefill=record_prefill(hybrid, prompt),
    )
    assert torch.equal(replayed.sequences, out.sequences)
    torch.testing.assert_close(replayed.logits, out.logits, rtol=1e-5, atol=1e-5)
    assert [s.kept for s in replayed.cache_stats] == [s.kept for s in out.cache_stats]


def test_eviction_reaches_the_global_layers_attention(hybrid, prompt):
    """A budget of exactly the prompt keeps every token (identical logits); 8 tokens fewer change them."""

    def logits(policy, budget):
        return generate_with_budget(
            hybrid, prompt, policy=policy, budget=budget, max_new_tokens=2, output_logits=True
        ).logits[:, 1]

    full = logits(FullCache(), None)
    torch.testing.assert_close(logits(StreamingLLM(2, 4), PROMPT), full, rtol=0, atol=0)
    assert (logits(StreamingLLM(2, 4), PROMPT - 8) - full).abs().max() > 1e-4


def test_what_hybrid_models_refuse(hybrid, prompt):
    mask = torch.ones_like(prompt).index_fill_(1, torch.tensor([0]), 0)
    with pytest.raises(
        NotImplementedError, match="left-padded batches are not supported on models with sliding"
    ):
        generate_with_budget(hybrid, prompt, mask, policy=H2O(), budget=32, max_new_tokens=1)
    with pytest.raises(
        NotImplementedError, match="left-padded batches are not supported on models with sliding"
    ):
        record_prefill(hybrid, prompt, mask)
    with pytest.raises(NotImplementedError, match="latent memory"):
        generate_with_budget(
            hybrid, prompt, policy=H2O(), budget=32, max_new_tokens=1, memory=lambda *a: None
        )

    class AllSliding(torch.nn.Module):
        config = type(hybrid.config).from_dict(
            {**hybrid.config.to_dict(), "layer_types": ["sliding_attention"] * 6}
        )

    with pytest.raises(ValueError, match="every layer is sliding-window"):
        generate_with_budget(AllSliding(), prompt, policy=H2O(), budget=32, max_new_tokens=1)


def test_attention_policies_refuse_attention_softcapping(prompt):
    """Gemma 2 caps its attention logits; H2O/SnapKV would score an uncapped softmax, so they refuse it."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        attn_logit_softcapping=50.0,
    )
    model = Gemma2ForCausalLM(config).eval()
    with pytest.raises(ValueError, match="soft-capping"):
        generate_with_budget(model, prompt, policy=SnapKV(2, 4), budget=16, max_new_tokens=1)
    ref = model.generate(prompt, max_new_tokens=3, do_sample=False)
    out = generate_with_budget(model, prompt, policy=StreamingLLM(2, 4), budget=64, max_new_tokens=3)
    assert torch.equal(out.sequences, ref)  # a score-free policy runs, sliding layers included
