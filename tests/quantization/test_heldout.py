"""The real-model quantisation study's text: the shipped passage set and its held-out windows."""

from __future__ import annotations

import pytest
import torch

from lightning_llm.quantization.heldout import densify, held_out_windows, load_passages


def test_passages_are_distinct_prose_without_the_separator():
    passages = load_passages()
    assert len(passages) >= 100
    assert len(set(passages)) == len(passages)
    assert not any("===" in p or p.startswith("#") for p in passages)
    assert min(len(p.split()) for p in passages) >= 100


@pytest.mark.pretrained
def test_held_out_text_is_at_least_20k_smollm2_tokens(smollm2_dir):
    from lightning_llm.backbones.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    passages = load_passages()
    windows = held_out_windows(tokenizer, passages[4:], 512)
    assert windows.shape[1] == 512 and windows.numel() >= 20_000
    assert (
        int((windows == tokenizer.eos_token_id).sum()) >= len(passages[4:]) - 3
    )  # one EOS per passage (the tail is cut)
    calibration = held_out_windows(tokenizer, passages[:4], 256)
    assert calibration.shape[0] >= 2


def test_densify_keeps_the_dequantised_weights():
    from torch import nn

    from lightning_llm.quantization import TrellisLinear, dequantize

    lin = nn.Linear(64, 32)
    q = TrellisLinear.from_linear(lin, code="proteus", L=6)
    model = nn.Sequential(q)
    expected = dequantize(q.quantized_matrix())
    densify(model)
    assert isinstance(model[0], nn.Linear)
    assert torch.equal(model[0].weight, expected) and torch.equal(model[0].bias, lin.bias)
