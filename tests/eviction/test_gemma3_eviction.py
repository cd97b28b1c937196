"""KV eviction on Gemma-3-270M (hybrid: 15 sliding-window layers of 512 tokens, 3 global), a prompt past the window."""

from __future__ import annotations

import pytest
import torch

from lightning_llm.eviction import SnapKV, generate_with_budget

pytestmark = pytest.mark.pretrained

NEW = 6


@pytest.fixture(scope="module")
def long_prompt(gemma3):
    _, tokenizer = gemma3
    facts = [
        f"Note {i}: the locker with number {100 + 7 * i} holds a {c} umbrella."
        for i, c in enumerate(["red", "blue", "green", "grey", "black", "white"] * 8)
    ]
    text = " ".join(facts) + " Question: which colour is the umbrella in locker 107? Answer:"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.shape[1] > 512 + 64  # past the sliding window
    return ids


def test_generation_under_a_budget_on_gemma3(gemma3, long_prompt):
    model, _ = gemma3
    length = long_prompt.shape[1]
    ref = model.generate(
        long_prompt, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    unbudgeted = generate_with_budget(
        model, long_prompt, policy=SnapKV(), budget=2048, max_new_tokens=NEW, output_logits=True
    )
    assert torch.equal(unbudgeted.sequences, ref.sequences)
    torch.testing.assert_close(unbudgeted.logits, torch.stack(ref.logits, dim=1), rtol=1e-4, atol=1e-4)

    out = generate_with_budget(model, long_prompt, policy=SnapKV(), budget=128, max_new_tokens=NEW)
    seen = length + NEW - 1
    types = model.config.layer_types
    for kind, st in zip(types, out.cache_stats, strict=True):
        assert st.seen == seen
        assert st.kept == (128 if kind == "full_attention" else 511)
    # 3 global layers at the budget + 15 sliding layers at their window; 1 KV head of 256 dims, fp32 keys + values
    assert out.peak_cache_bytes == (3 * 128 + 15 * 511) * 2 * 1 * 256 * 4
    assert out.peak_cache_bytes < unbudgeted.peak_cache_bytes
