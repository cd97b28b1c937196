"""TrellisLinear, quantize_model and safetensors save / load on the embedded tiny backbone.

Quantising the whole tiny model at L = 16 takes minutes, so the model tests use L = 6 with 1MAD and large
Viterbi chunks (≈ 3 s for its 28 linear layers); one layer-level test covers Proteus (MUL-BAL) at L = 8.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_llm.quantization import (
    TrellisLinear,
    dequantize,
    load_quantized,
    quantize_matrix,
    quantize_model,
    save_quantized,
)


@pytest.mark.parametrize("code", ["proteus", "qtip-1mad", "rtn"])
def test_trellis_linear_equals_dequantized_matmul(code):
    torch.manual_seed(0)
    lin = nn.Linear(40, 21, bias=True)
    q = TrellisLinear.from_linear(lin, code=code, L=8, seed=3, proxy_tiles=1)
    x = torch.randn(2, 5, 40)
    expected = x @ dequantize(q.quantized_matrix()).t() + lin.bias.detach()
    out = q(x)
    assert out.shape == (2, 5, 21)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert q.packed.dtype == torch.uint8 and q.packed.numel() * 8 == q.packed.shape[0] * 256 * 2
    # the module's buffers reproduce the QuantizedMatrix it was built from
    qm = quantize_matrix(lin.weight.detach(), code=code, L=8, seed=3, proxy_tiles=1)
    assert torch.equal(q.packed, qm.packed) and torch.equal(q.scales, qm.scales)


def test_half_precision_model_keeps_fp32_scales():
    torch.manual_seed(1)
    lin = nn.Linear(24, 10)
    q = TrellisLinear.from_linear(lin, code="qtip-1mad", L=6)
    x = torch.randn(4, 24)
    y32 = q(x)
    q = q.to(torch.bfloat16)
    assert q.scales.dtype == torch.float32 and q.code_floats.dtype == torch.float64
    assert q.packed.dtype == torch.uint8 and q.bias.dtype == torch.bfloat16
    yb = q(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y32, rtol=2**-7, atol=2**-6)


def test_no_bias_and_errors():
    lin = nn.Linear(16, 8, bias=False)
    q = TrellisLinear.from_linear(lin, code="qtip-1mad", L=6)
    assert q.bias is None and q(torch.randn(3, 16)).shape == (3, 8)
    with pytest.raises(ValueError, match="method"):
        quantize_model(nn.Sequential(lin), method="gptq")


@pytest.fixture(scope="module")
def quantized_tiny(_isolated_home):
    from lightning_llm.backbones import load_backbone

    model, tok = load_backbone("tiny")  # a fresh copy: quantize_model works in place
    quantize_model(model, method="qtip-1mad", L=6, chunk_tiles=4096)
    return model.eval(), tok


def test_quantize_model_replaces_decoder_linears(quantized_tiny):
    model, _ = quantized_tiny
    kinds = {type(m) for n, m in model.named_modules() if n.endswith(("q_proj", "down_proj", "gate_proj"))}
    assert kinds == {TrellisLinear}
    assert not [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    assert isinstance(model.get_input_embeddings(), nn.Embedding)
    assert model.trellis_quantization["method"] == "qtip-1mad"


def test_forward_generate_and_round_trip(quantized_tiny, tmp_path):
    model, tok = quantized_tiny
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.isfinite(logits).all()
    assert gen.shape == (1, ids.shape[1] + 4)
    save_quantized(model, tmp_path)
    assert {"config.json", "model.safetensors", "quantization.json"} <= {p.name for p in tmp_path.iterdir()}
    record = json.loads((tmp_path / "quantization.json").read_text())
    assert len(record["layers"]) == 28 and record["method"] == "qtip-1mad"
    loaded = load_quantized(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)
        assert torch.equal(loaded.generate(ids, max_new_tokens=4, do_sample=False), gen)
