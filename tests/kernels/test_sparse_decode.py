"""Correctness of the SAE decoder ``sparse_decode``, for both backends.

The reference is compared with the naive dense formula in float64 (autograd of a dense scatter), and the
Triton kernels (on CPU through ``TRITON_INTERPRET=1``, which ``tests/conftest.py`` sets when there is no CUDA)
with both the truth and the reference. The interpreter is slow, so the Triton cases are few and small, with
blocks forced to 16 so that several row and column tiles with ragged edges are exercised (N = 33 gives three
row tiles, the last with one row; d = 67 five column tiles, the last with 3 columns).
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.kernels import sparse_decode
from lightning_llm.kernels._dispatch import resolve_backend, triton_available
from lightning_llm.kernels.sparse_decode import _sparse_decode

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Max |ours - expected| as a fraction of max(|expected|, 1) over the tensor (``_assert_close``), for
# sparse_decode.
# float64 (reference only): summation order alone.
# float32: fp32 accumulation over at most k = 7 products (or a latent's share of the N·k pairs); observed
# <= 3.6e-7.
# bfloat16 / float16, unit roundoff u = 2^-8 / 2^-11: every side sees the same 16-bit inputs, a product of
# two 16-bit numbers is exact in fp32 and sums accumulate in fp32, so the errors are roundings to the input
# dtype, each at most u times the value rounded. The kernels and the backward scatters round once (<= u).
# The reference decoder with a bias rounds twice, the sum (at most |out| + |bias|) and then the output, as
# does the encoder's forward (the matmul, then the bias add): with |bias| <= max|out| that is <= 3u against
# the float64 truth, so 4u bounds every comparison, kernel against reference included: 2^-6 (bf16), 2^-9
# (fp16). Observed: <= 0.92u against the truth, <= 1.5u kernel against reference.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """``max|actual - expected| <= tol * max(|expected|, 1)``, with a readable message."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, 1.0)
    assert err <= tol * scale, f"{what}: max error {err:.3e}, scale {scale:.3e}, tolerance {tol:.1e}"


def _grads(outputs, upstream, inputs: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """``{name: d<outputs, upstream>/d input}`` for every input that requires grad."""
    params = {k: t for k, t in inputs.items() if t is not None and t.requires_grad}
    pairs = [(o, g) for o, g in zip(outputs, upstream, strict=True) if g is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], list(params.values()), [g for _, g in pairs])
    return dict(zip(params, grads, strict=True))


def _truth(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """float64 copies of ``tensors`` (same requires_grad; integer tensors unchanged)."""
    return {
        k: t
        if t is None or not t.is_floating_point()
        else t.detach().double().requires_grad_(t.requires_grad)
        for k, t in tensors.items()
    }


def _decode_inputs(lead, d, n_latents, k, dtype, *, with_bias=True, seed=0):
    """Tensors of one call (floating ones require grad) and an upstream gradient.

    Indices are drawn with replacement, so a row may repeat a latent and most latents recur across rows
    (the scatter-add's interesting case). Weight rows are scaled so that ``out`` has about unit variance.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "values": torch.randn(*lead, k, generator=gen),
        "indices": torch.randint(0, n_latents, (*lead, k), generator=gen),
        "weight": torch.randn(n_latents, d, generator=gen) / k**0.5,
        "bias": torch.randn(d, generator=gen) if with_bias else None,
    }
    grad_out = torch.randn(*lead, d, generator=gen).to(DEVICE, dtype)
    for name, t in tensors.items():
        if t is not None:
            t = t.to(DEVICE)
            tensors[name] = t.to(dtype).requires_grad_() if t.is_floating_point() else t
    return tensors, grad_out


def _naive_decode(values, indices, weight, bias):
    """The dense definition: scatter the sparse codes into ``(..., M)`` and multiply by ``weight``."""
    dense = torch.zeros(*values.shape[:-1], weight.shape[0], dtype=values.dtype, device=values.device)
    out = dense.scatter_add(-1, indices, values) @ weight
    return out if bias is None else out + bias


def _check_decode(tensors, grad_out, backend, block=None):
    """Run ``backend``; compare output and gradients with the float64 dense formula; return them."""
    dtype = tensors["values"].dtype
    out = _sparse_decode(*tensors.values(), _backend=backend, _block=block)
    assert out.dtype == dtype and out.shape == (*tensors["values"].shape[:-1], tensors["weight"].shape[1])
    got = {"out": out, **_grads([out], [grad_out], tensors)}
    t64 = _truth(tensors)
    want_out = _naive_decode(*t64.values())
    want = {"out": want_out, **_grads([want_out], [grad_out.double()], t64)}
    for name in want:
        assert got[name].dtype == dtype, name
        _assert_close(got[name], want[name], TOLERANCE[dtype], f"{backend} {name} ({dtype})")
    return got


# (leading shape, d, M, k, with bias)
DECODE_REFERENCE_CASES = [
    ((7,), 5, 13, 4, True),
    ((2, 3), 48, 13, 7, False),
    ((1,), 67, 96, 1, True),
    ((33,), 5, 96, 7, True),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", DECODE_REFERENCE_CASES, ids=lambda c: "N{}-d{}-M{}-k{}-b{:d}".format(*c))
def test_decode_reference_matches_dense_formula(case, dtype):
    lead, d, n_latents, k, with_bias = case
    tensors, grad_out = _decode_inputs(lead, d, n_latents, k, dtype, with_bias=with_bias)
    _check_decode(tensors, grad_out, "torch")


def test_decode_reference_gradcheck_and_double_backward():
    """float64 finite differences, first and second order (the backward is built from differentiable ops)."""
    tensors, _ = _decode_inputs((4,), 5, 6, 3, torch.float64)
    values, indices, weight, bias = tensors.values()

    def f(values, weight, bias):
        return sparse_decode(values, indices, weight, bias)

    assert torch.autograd.gradcheck(f, (values, weight, bias))
    assert torch.autograd.gradgradcheck(f, (values, weight, bias))


# (leading shape, d, M, k, with bias, dtype, forced block); None runs the default launch configuration.
DECODE_TRITON_CASES = [
    ((1,), 5, 13, 1, True, torch.float32, 16),
    ((33,), 67, 96, 7, True, torch.float32, 16),
    ((7,), 48, 13, 4, False, torch.float32, 16),
    ((3, 11), 67, 96, 4, True, torch.bfloat16, 16),
    ((33,), 48, 13, 7, True, torch.bfloat16, None),
    ((7,), 67, 96, 4, True, torch.float16, 16),
]


@pytest.mark.triton
@pytest.mark.parametrize(
    "case",
    DECODE_TRITON_CASES,
    ids=lambda c: "N{}-d{}-M{}-k{}-b{:d}-{}-blk{}".format(*c).replace("torch.", ""),
)
def test_decode_triton_matches_truth_and_reference(case):
    *shape, dtype, block = case
    lead, d, n_latents, k, with_bias = shape
    tensors, grad_out = _decode_inputs(lead, d, n_latents, k, dtype, with_bias=with_bias, seed=d + k)
    got = _check_decode(tensors, grad_out, "triton", block)
    want = _check_decode(tensors, grad_out, "torch")
    for name in got:
        _assert_close(got[name], want[name], TOLERANCE[dtype], f"triton vs reference {name}")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_decode_strided_inputs(backend):
    """A transposed weight, strided values/indices and a broadcast upstream gradient (strides 0, as
    ``out.sum(0)`` produces) give the contiguous results."""
    tensors, _ = _decode_inputs((6,), 20, 13, 3, torch.float32)
    values, indices, weight, bias = tensors.values()
    grad_out = torch.randn(20, generator=torch.Generator().manual_seed(1)).to(DEVICE).expand(6, 20)
    out = _sparse_decode(values, indices, weight, bias, _backend=backend, _block=16)
    want = {"out": out, **_grads([out], [grad_out.contiguous()], tensors)}
    w_t = weight.detach().T.contiguous().T.requires_grad_()  # strides (1, 13)
    wide_v = torch.zeros(6, 6, device=DEVICE)
    wide_v[:, ::2] = values.detach()
    v_s = wide_v[:, ::2].requires_grad_()  # strides (6, 2)
    i_s = indices.T.contiguous().T
    assert not (w_t.is_contiguous() or v_s.is_contiguous() or i_s.is_contiguous())
    out = _sparse_decode(v_s, i_s, w_t, bias, _backend=backend, _block=16)
    got = {"out": out, **_grads([out], [grad_out], {"values": v_s, "weight": w_t, "bias": bias})}
    for name in want:
        _assert_close(got[name], want[name], TOLERANCE[torch.float32], name)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_empty_token_dim(backend):
    tensors, _ = _decode_inputs((0, 3), 5, 13, 4, torch.float32)
    out = _sparse_decode(*tensors.values(), _backend=backend)
    assert out.shape == (0, 3, 5)
    grads = torch.autograd.grad(out.sum(), [tensors["values"], tensors["weight"], tensors["bias"]])
    assert grads[0].shape == (0, 3, 4) and not any(g.any() for g in grads[1:])


def test_opcheck():
    """torch.library's own consistency checks: fake tensors, schema, autograd registration, AOT dispatch."""
    tensors, grad_out = _decode_inputs((6,), 5, 13, 3, torch.float32)
    args = tuple(tensors.values())
    torch.library.opcheck(torch.ops.lightning_llm.sparse_decode, (*args, "torch", 0))
    torch.library.opcheck(torch.ops.lightning_llm.sae_gather_dot, (grad_out, *args[1:3], "torch", 0))


def _decode_kwargs(**changes):
    kwargs = {
        "values": torch.rand(4, 3),
        "indices": torch.randint(0, 6, (4, 3)),
        "weight": torch.randn(6, 5),
        "bias": torch.zeros(5),
    }
    return {**kwargs, **changes}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            _decode_kwargs(indices=torch.zeros(4, 2, dtype=torch.long)),
            ValueError,
            r"shape of values .* \(4, 3\), got \(4, 2\)",
        ),
        (_decode_kwargs(weight=torch.randn(6, 5, 1)), ValueError, r"weight must have shape \(M, d\)"),
        (
            _decode_kwargs(bias=torch.zeros(4)),
            ValueError,
            r"bias must have shape \(d,\) = \(5,\) .* got \(4,\)",
        ),
        (
            _decode_kwargs(values=torch.rand(4, 0), indices=torch.zeros(4, 0, dtype=torch.long)),
            ValueError,
            "k >= 1",
        ),
        (_decode_kwargs(values=torch.tensor(1.0), indices=torch.tensor(0)), ValueError, "0-d"),
        (_decode_kwargs(indices=torch.full((4, 3), 6)), ValueError, r"\[0, 6\), got values in \[6, 6\]"),
        (_decode_kwargs(indices=torch.tensor([[0, -1, 2]] * 4)), ValueError, r"got values in \[-1, 2\]"),
        (_decode_kwargs(indices=torch.zeros(4, 3, dtype=torch.int32)), TypeError, "int64"),
        (_decode_kwargs(weight=torch.randn(6, 5).half()), TypeError, "share a dtype"),
        (_decode_kwargs(values=torch.ones(4, 3, dtype=torch.int64)), TypeError, "dtype must be one of"),
    ],
)
def test_input_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        sparse_decode(**kwargs)


def test_dispatch_and_private_hooks():
    """CPU takes the reference; forcing Triton on fp64 or a bad backend fails clearly."""
    x = torch.zeros(2, 3)
    assert resolve_backend("sparse_decode", "auto", (x,), dtype=x.dtype) == "torch"
    assert resolve_backend("sparse_decode", "auto", (x.double(),), dtype=torch.float64) == "torch"
    if triton_available():
        with pytest.raises(TypeError, match="Triton kernel supports"):
            _sparse_decode(
                **_decode_kwargs(
                    values=torch.rand(4, 3).double(), weight=torch.randn(6, 5).double(), bias=None
                ),
                _backend="triton",
            )
    with pytest.raises(ValueError, match="_backend"):
        _sparse_decode(**_decode_kwargs(), _backend="cuda")
    if torch.cuda.is_available() and triton_available():
        assert resolve_backend("sparse_decode", "auto", (x.cuda(),), dtype=torch.bfloat16) == "triton"
        assert resolve_backend("sparse_decode", "auto", (x.cuda().double(),), dtype=torch.float64) == "torch"


@pytest.mark.gpu
def test_cuda_triton_path_matches_reference():
    """On CUDA ``auto`` runs the compiled Triton kernels; they match the reference at SAE-like sizes (bf16)."""
    n_tokens, d, n_latents, k = 512, 256, 4096, 32
    dtype = torch.bfloat16
    tensors, grad_out = _decode_inputs((n_tokens,), d, n_latents, k, dtype)
    assert resolve_backend("sparse_decode", "auto", tensors.values(), dtype=dtype) == "triton"
    got = _check_decode(tensors, grad_out, "auto")
    want = _check_decode(tensors, grad_out, "torch")
    for name in got:
        _assert_close(got[name], want[name], TOLERANCE[dtype], f"decode {name}")
