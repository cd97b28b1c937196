"""The FAST study's corpus harvest: both modes keep exactly the token budget, of the same text, and share the
held-out conversations."""

from __future__ import annotations

import torch

from lightning_llm.datamodules.activation_harvest import harvest_corpus, render_corpus, special_token_ids


def test_sequential_and_block_harvests_hold_the_same_tokens_and_held_out_set(tiny_backbone):
    model, tokenizer = tiny_backbone
    kwargs = dict(layer=1, num_tokens=300, num_val=3, max_length=256, block_size=64)
    sequential = harvest_corpus(model, tokenizer, mode="sequential", **kwargs)
    block = harvest_corpus(model, tokenizer, mode="block", **kwargs)
    dialogues = render_corpus(tokenizer, 256)
    stream = torch.cat(dialogues[:-3])[:300]
    special = torch.isin(stream, torch.tensor(sorted(special_token_ids(tokenizer))))
    for data in (sequential, block):
        assert data["train"].shape == (300, model.config.hidden_size)
        assert torch.equal(data["train_special"], special)  # the first 300 tokens of the same text
        assert data["val_tokens"] == sum(len(row) for row in dialogues[-3:])
    torch.testing.assert_close(sequential["val"]["activations"], block["val"]["activations"])
    # the first conversation's tokens sit at the same positions in both modes, so their activations agree
    first = len(dialogues[0])
    torch.testing.assert_close(sequential["train"][: min(first, 64)], block["train"][: min(first, 64)])
    # past the first block the block stream attends across a cut: the second block's opening differs
    assert first > 64 and not torch.allclose(sequential["train"][64], block["train"][64])
