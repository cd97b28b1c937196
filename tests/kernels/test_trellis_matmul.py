"""Correctness of ``trellis_matmul`` (x Ŵᵀ with Ŵ decoded from packed trellis bits).

The reference path is compared with ``x @ dequantize(qm)ᵀ`` (decode-then-matmul with the quantizer's own
decoder) for every code, several row counts ``M`` and feature counts that are not multiples of the 256-weight
tile (the quantizer zero-pads the flattened matrix). The Triton kernel (``TRITON_INTERPRET=1`` on CPU, set by
``tests/conftest.py``) is compared with the reference; the interpreter is slow, so its shapes are small, with
the N/K block forced to 16 so that several tiles with ragged edges are exercised. Most matrices use a small
trellis (L = 8, fast Viterbi); one case per code checks L = 16.

Tolerances: max |ours − expected| as a fraction of max(|expected|, 1). fp32: both sides are fp32 matmuls of the
same decoded values in a different order (and the scales applied before vs after the sum), over at most 70
products, plus two orthogonal transforms: 1e-5 (observed ≤ 3e-6). 16-bit ``x``: every path upcasts ``x`` and
computes in fp32, then rounds once to the output dtype, so kernel and reference are at most one ulp apart at a
rounding boundary: 2u, i.e. 2^-7 (bf16), 2^-10 (fp16).
"""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_llm.kernels import trellis_matmul
from lightning_llm.quantization import dequantize, quantize_matrix

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _assert_close(actual, expected, tol, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = (actual.double() - expected.double()).abs().max().item()
    scale = max(expected.abs().max().item(), 1.0)
    assert err <= tol * scale, f"{what}: max error {err:.3e}, scale {scale:.3e}, tolerance {tol:.1e}"


@functools.cache
def _qm(code: str, shape: tuple[int, int], L: int = 8, V: int = 1, seed: int = 0):
    W = torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 17))
    return quantize_matrix(W, code=code, L=L, V=V, seed=seed, proxy_tiles=1)


def _call(x, qm, **kw):
    """Reference and kernel calls take ``x``'s device (the Triton tests put ``x`` on ``DEVICE``)."""
    return trellis_matmul(
        x,
        qm.packed.to(x.device),
        qm.scales.to(x.device),
        qm.shape,
        qm.code,
        qm.code_params,
        L=qm.L,
        k=qm.bits,
        V=qm.V,
        tile=qm.tile,
        seed_out=qm.seed_out,
        seed_in=qm.seed_in,
        incoherence=qm.incoherence,
        **kw,
    )


def _x(M, n, dtype=torch.float32, seed=1):
    return torch.randn(M, n, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("code", ["qtip-1mad", "proteus", "qtip-3inst", "rtn"])
@pytest.mark.parametrize("shape", [(20, 36), (33, 70)])
@pytest.mark.parametrize("M", [1, 3, 17])
def test_reference_equals_decode_then_matmul(code, shape, M):
    qm = _qm(code, shape)
    x = _x(M, shape[1])
    expected = x @ dequantize(qm).t()
    _assert_close(_call(x, qm, _backend="torch"), expected, TOL[torch.float32], f"{code} {shape} M={M}")


@pytest.mark.parametrize("code", ["qtip-1mad", "proteus"])
def test_reference_L16_and_V2(code):
    for L, V in ((16, 1), (8, 2)):
        qm = _qm(code, (12, 40), L=L, V=V)
        x = _x(5, 40)
        _assert_close(_call(x, qm), x @ dequantize(qm).t(), TOL[torch.float32], f"{code} L={L} V={V}")


def test_compiled_backend_equals_reference():
    """``_backend="compiled"`` (torch.compile of the decode with tensor constants) is bit-exact with the eager
    reference: the same integer arithmetic and the same fp32 ops. 3INST / RTN fall back to the reference."""
    for code, V, shape in (("proteus", 1, (33, 70)), ("qtip-1mad", 2, (20, 36)), ("qtip-3inst", 1, (20, 36))):
        qm = _qm(code, shape, V=V)
        x = _x(3, shape[1])
        assert torch.equal(_call(x, qm, _backend="compiled"), _call(x, qm, _backend="torch")), (code, V)


def test_set_trellis_backend_on_a_model():
    from torch import nn

    from lightning_llm.quantization import TrellisLinear, set_trellis_backend

    model = nn.Sequential(
        TrellisLinear(_qm("proteus", (33, 70))), nn.ReLU(), TrellisLinear(_qm("proteus", (20, 33), seed=1))
    )
    x = _x(4, 70)
    with torch.no_grad():
        eager = model[2](model[0](x))
        set_trellis_backend(model, "compiled")
        assert model[0].backend == model[2].backend == "compiled"
        assert torch.equal(model[2](model[0](x)), eager)
    with pytest.raises(ValueError, match="backend"):
        set_trellis_backend(model, "gpu")


def test_leading_dims_dtype_and_no_incoherence():
    W = torch.randn(9, 24, generator=torch.Generator().manual_seed(3))
    qm = quantize_matrix(W, code="qtip-1mad", L=8, incoherence=False)
    x = _x(6, 24).view(2, 3, 24)
    y = _call(x, qm)
    assert y.shape == (2, 3, 9)
    _assert_close(y, x @ dequantize(qm).t(), TOL[torch.float32])
    yb = _call(x.bfloat16(), qm)
    assert yb.dtype == torch.bfloat16
    _assert_close(yb, y, 2**-7)


def test_errors():
    qm = _qm("qtip-1mad", (20, 36))
    with pytest.raises(ValueError, match="in_features"):
        _call(_x(2, 35), qm)
    with pytest.raises(ValueError, match="_backend"):
        _call(_x(2, 36), qm, _backend="cuda")
    qm3 = _qm("qtip-3inst", (20, 36))
    with pytest.raises(ValueError, match="Triton kernel supports"):
        _call(_x(2, 36), qm3, _backend="triton")


def test_opcheck_fake():
    qm = _qm("proteus", (20, 36))
    from lightning_llm.kernels.trellis_matmul import code_constants

    cid, c0, c1, a, b = code_constants(qm.code, qm.code_params)
    args = (_x(3, 36), qm.packed, qm.scales, 20, cid, c0, c1, a, b, qm.L, qm.bits, qm.V, qm.tile, "torch", 0)
    torch.library.opcheck(
        torch.ops.lightning_llm.trellis_matmul.default, args, test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.triton
@pytest.mark.parametrize("code", ["qtip-1mad", "proteus"])
@pytest.mark.parametrize("V", [1, 2])
def test_triton_equals_reference_fp32(code, V):
    qm = _qm(code, (20, 36), V=V)
    for M in (1, 3, 17):
        x = _x(M, 36, seed=M).to(DEVICE)
        ref = _call(x, qm, _backend="torch")
        _assert_close(
            _call(x, qm, _backend="triton", _block=16), ref, TOL[torch.float32], f"{code} V={V} M={M}"
        )


@pytest.mark.triton
@pytest.mark.parametrize("code", ["qtip-1mad", "proteus"])
def test_triton_L16_ragged(code):
    qm = _qm(code, (33, 70), L=16)
    x = _x(17, 70).to(DEVICE)
    ref = _call(x, qm, _backend="torch")
    _assert_close(_call(x, qm, _backend="triton", _block=16), ref, TOL[torch.float32], code)
    _assert_close(ref.cpu(), x.cpu() @ dequantize(qm).t(), TOL[torch.float32], code)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_inputs(dtype):
    qm = _qm("proteus", (20, 36))
    x = _x(3, 36, dtype).to(DEVICE)
    out = _call(x, qm, _backend="triton", _block=16)
    assert out.dtype == dtype
    _assert_close(out, _call(x, qm, _backend="torch"), TOL[dtype], str(dtype))
