"""KV eviction on the real model: SmolLM2-135M-Instruct finds a needle in natural English prose (padded batch)."""

from __future__ import annotations

import pytest
import torch

from lightning_llm.datamodules.needle import encode_chat_prompts, first_number_score
from lightning_llm.datamodules.tasks.long_context import NeedleTask
from lightning_llm.eviction import FullCache, SnapKV, generate_with_budget, record_prefill

pytestmark = pytest.mark.pretrained


def test_smollm2_reads_prose_needles_in_a_padded_batch_and_batching_changes_no_answer(smollm2):
    torch.set_num_threads(1)
    model, tokenizer = smollm2
    examples = [
        NeedleTask(haystack_words=words, depth=depth, filler="prose").generate(1, seed)[0]
        for seed, (words, depth) in enumerate([(120, 0.2), (100, 0.5), (80, 0.8)])
    ]
    encoded = encode_chat_prompts(tokenizer, examples)  # under NEEDLE_SYSTEM_PROMPT
    length, eos = max(map(len, encoded)), tokenizer.eos_token_id
    ids = torch.full((len(encoded), length), eos)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(encoded):
        ids[row, length - len(seq) :], mask[row, length - len(seq) :] = torch.tensor(seq), 1
    assert len({len(seq) for seq in encoded}) == len(encoded)  # really padded
    prefill = record_prefill(model, ids, mask)
    kwargs = {"max_new_tokens": 10, "eos_token_id": eos, "pad_token_id": eos}
    full = generate_with_budget(model, ids, mask, policy=FullCache(), budget=None, prefill=prefill, **kwargs)
    texts = tokenizer.batch_decode(full.sequences[:, length:], skip_special_tokens=True)
    assert [first_number_score(text, ex) for text, ex in zip(texts, examples, strict=True)] == [1.0] * 3, (
        texts
    )
    snap = generate_with_budget(model, ids, mask, policy=SnapKV(), budget=64, prefill=prefill, **kwargs)
    for row, seq in enumerate(encoded):
        alone = generate_with_budget(model, torch.tensor([seq]), policy=SnapKV(), budget=64, **kwargs)
        new = alone.sequences[0, len(seq) :]
        assert torch.equal(snap.sequences[row, length : length + len(new)], new)
