"""Correctness of ``lora_linear`` against a float64 naive formula, for both backends.

The PyTorch reference and the Triton kernel (on CPU through ``TRITON_INTERPRET=1``, which
``tests/conftest.py`` sets when there is no CUDA) are each compared with
``x Wᵀ + bias + s·((x Aᵀ) ⊙ c) Bᵀ`` evaluated in float64 with autograd, and with each other. The interpreter
is slow, so the Triton cases are few and small, with blocks forced to 16 so that several row, column and
reduction tiles with ragged edges are exercised.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_llm.kernels import lora_linear
from lightning_llm.kernels._dispatch import triton_available
from lightning_llm.kernels.lora_linear import MAX_TRITON_RANK, _lora_linear

# The package re-exports the function under the module's own name, so `import ... as` would give the function.
ll = importlib.import_module("lightning_llm.kernels.lora_linear")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Max |ours - expected| as a fraction of max(|expected|, 1) over the tensor (``_assert_close``).
# float64 (reference only): summation order alone.
# float32: fp32 accumulation over at most 64 products; observed <= 4.6e-7.
# bfloat16 / float16, unit roundoff u = 2^-8 / 2^-11: every error is a rounding to the input dtype of a
# term about as large as the output, at most u times the scale each. Against the float64 truth the kernel
# rounds twice (the rank-r factor s·(t ⊙ c) before its product with B, and the output) and the reference
# four times (also the base product x Wᵀ and the LoRA product). Kernel against reference: the shared factor
# rounding cancels, leaving the reference's two product roundings and both output roundings. So 4u bounds
# every comparison: 2^-6 ≈ 1.6e-2 (bf16), 2^-9 ≈ 2.0e-3 (fp16). Gradients have the same structure (dx is
# the same op; dA and dB round their rank-r factor and their result). Observed: bf16 <= 7.1e-3 (1.8u),
# fp16 <= 8.9e-4 (1.8u).
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}
SCALE = 2.0  # alpha / r, so the LoRA branch is as large as the base output and its errors are visible
NAMES = ("x", "weight", "A", "B", "column_scale", "bias")


def _inputs(
    lead: tuple[int, ...],
    n_in: int,
    n_out: int,
    rank: int,
    dtype: torch.dtype,
    *,
    with_c: bool = True,
    with_bias: bool = True,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor | None], torch.Tensor]:
    """Tensors of one call (all requiring grad; c in fp32, or fp64 for fp64) and an upstream gradient.

    ``W`` and ``A`` are scaled so ``x Wᵀ`` and ``x Aᵀ`` have unit variance, ``B`` so ``(x Aᵀ) Bᵀ`` does.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor | None] = {
        "x": torch.randn(*lead, n_in, generator=gen),
        "weight": torch.randn(n_out, n_in, generator=gen) / n_in**0.5,
        "A": torch.randn(rank, n_in, generator=gen) / n_in**0.5,
        "B": torch.randn(n_out, rank, generator=gen) / rank**0.5,
        "column_scale": 0.5 + torch.rand(rank, generator=gen) if with_c else None,
        "bias": torch.randn(n_out, generator=gen) if with_bias else None,
    }
    grad_y = torch.randn(*lead, n_out, generator=gen).to(DEVICE, dtype)
    c_dtype = torch.promote_types(dtype, torch.float32)
    for name, t in tensors.items():
        if t is not None:
            tensors[name] = t.to(DEVICE, c_dtype if name == "column_scale" else dtype).requires_grad_()
    return tensors, grad_y


def _truth(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """float64 copies of ``tensors`` (same requires_grad), to evaluate the naive formula on."""
    return {
        k: None if t is None else t.detach().double().requires_grad_(t.requires_grad)
        for k, t in tensors.items()
    }


def _naive(x, weight, A, B, column_scale, bias) -> torch.Tensor:
    """The definition: ``x Wᵀ + bias + s·((x Aᵀ) ⊙ c) Bᵀ``."""
    t = x @ A.T
    if column_scale is not None:
        t = t * column_scale
    y = x @ weight.T + SCALE * t @ B.T
    return y + bias if bias is not None else y


def _outputs(
    y: torch.Tensor, grad_y: torch.Tensor, tensors: dict[str, torch.Tensor | None]
) -> dict[str, torch.Tensor]:
    """``{"y": y, name: d<y, grad_y>/d tensor}`` for every tensor that requires grad."""
    params = {k: t for k, t in tensors.items() if t is not None and t.requires_grad}
    grads = torch.autograd.grad(y, list(params.values()), grad_y.to(y.dtype))
    return {"y": y, **dict(zip(params, grads, strict=True))}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``max|actual - expected| <= TOLERANCE[dtype] * max(|expected|, 1)``, with a readable message."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, 1.0)
    assert err <= TOLERANCE[dtype] * scale, f"{what} ({dtype}): max error {err:.3e}, scale {scale:.3e}"


def _check(
    tensors: dict[str, torch.Tensor | None], grad_y: torch.Tensor, backend: str, block: int | None = None
) -> dict[str, torch.Tensor]:
    """Run ``backend`` and compare output and gradients with the float64 truth; return them."""
    dtype = tensors["x"].dtype
    y = _lora_linear(
        *(tensors[k] for k in NAMES[:4]),
        SCALE,
        *(tensors[k] for k in NAMES[4:]),
        _backend=backend,
        _block=block,
    )
    assert y.dtype == dtype and y.shape == (*tensors["x"].shape[:-1], tensors["weight"].shape[0])
    got = _outputs(y, grad_y, tensors)
    truth64 = _truth(tensors)
    want = _outputs(_naive(*truth64.values()), grad_y, truth64)
    assert got.keys() == want.keys()
    for name in got:
        if name != "y":
            assert got[name].dtype == tensors[name].dtype, name
        _assert_close(got[name], want[name], dtype, f"{backend} {name}")
    return got


# (leading shape, in, out, r, with column_scale, with bias)
REFERENCE_CASES = [
    ((7,), 16, 12, 4, True, True),
    ((2, 3), 17, 13, 3, False, False),
    ((1,), 5, 1, 1, True, False),
    ((4,), 9, 6, 2, False, True),
]


@pytest.mark.parametrize("frozen", [(), ("x", "weight")], ids=["all-grads", "frozen-x-weight"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=lambda c: "N{}-in{}-out{}-r{}-c{:d}-b{:d}".format(*c))
def test_reference_matches_naive_formula(case, dtype, frozen):
    """Values and gradients of every argument; frozen ``x`` takes the ``u = dy B`` path without ``dx``."""
    lead, n_in, n_out, rank, with_c, with_bias = case
    tensors, grad_y = _inputs(lead, n_in, n_out, rank, dtype, with_c=with_c, with_bias=with_bias)
    for name in frozen:
        tensors[name].requires_grad_(False)
    _check(tensors, grad_y, "torch")


def test_reference_gradcheck_and_double_backward():
    """float64 finite differences for first and second derivatives (the backward is differentiable)."""
    tensors, _ = _inputs((3,), 5, 4, 2, torch.float64)

    def f(x, weight, A, B, column_scale, bias):
        return lora_linear(x, weight, A, B, 0.7, column_scale, bias)

    args = tuple(tensors.values())
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


# (leading shape, in, out, r, with column_scale, with bias, dtype, forced block). With block 16: N = 37 gives
# three row tiles (the last with 5 rows), out = 50 four column tiles (2 columns in the last), in = 17 two
# reduction steps (1 element in the second), r in {1, 3, 8} a masked 16-wide rank block; N = 1 a single row.
# `None` runs the default launch configuration.
TRITON_CASES = [
    ((1,), 17, 13, 1, True, True, torch.float32, 16),
    ((37,), 17, 50, 3, False, False, torch.float32, 16),
    ((37,), 64, 13, 8, True, False, torch.float32, 16),
    ((5, 7), 64, 50, 3, True, True, torch.float32, 16),
    ((37,), 17, 50, 8, True, True, torch.bfloat16, 16),
    ((1,), 64, 13, 3, False, True, torch.bfloat16, 16),
    ((5, 7), 17, 50, 1, True, False, torch.bfloat16, 16),
    ((37,), 64, 50, 8, True, True, torch.bfloat16, None),
    ((37,), 64, 50, 8, True, True, torch.float16, 16),
]


@pytest.mark.triton
@pytest.mark.parametrize(
    "case",
    TRITON_CASES,
    ids=lambda c: "N{}-in{}-out{}-r{}-c{:d}-b{:d}-{}-blk{}".format(*c).replace("torch.", ""),
)
def test_triton_matches_truth_and_reference(case):
    """Forward and all gradients against the float64 truth, then against the reference path."""
    *shape, dtype, block = case
    lead, n_in, n_out, rank, with_c, with_bias = shape
    tensors, grad_y = _inputs(
        lead, n_in, n_out, rank, dtype, with_c=with_c, with_bias=with_bias, seed=n_in + n_out
    )
    got = _check(tensors, grad_y, "triton", block)
    want = _check(tensors, grad_y, "torch")
    for name in got:
        _assert_close(got[name], want[name], dtype, f"triton vs reference {name}")


@pytest.mark.triton
@pytest.mark.parametrize("n_out", [50, 0])
def test_triton_stores_t(n_out):
    """The op's second output ``t = x Aᵀ`` (fp32) is complete, also with several column tiles and none."""
    tensors, _ = _inputs((37,), 17, n_out, 3, torch.bfloat16)
    args = [tensors[k].detach() for k in NAMES[:4]]
    y, t = torch.ops.lightning_llm.lora_linear(*args, None, None, SCALE, "triton", 16)
    assert y.shape == (37, n_out) and t.shape == (37, 3) and t.dtype == torch.float32
    _assert_close(t, args[0].double() @ args[2].double().T, torch.float32, "t")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_non_contiguous_inputs(backend):
    """Transposed ``x`` and ``A``, a column-strided ``weight`` and a broadcast upstream gradient (strides 0,
    as ``y.sum(0)`` produces) give the contiguous results."""
    tensors, _ = _inputs((6,), 20, 13, 3, torch.float32, with_c=False, with_bias=False)
    grad_y = torch.randn(13, generator=torch.Generator().manual_seed(1)).to(DEVICE).expand(6, 13)
    want = _outputs(
        _lora_linear(*(tensors[k] for k in NAMES[:4]), SCALE, _backend=backend, _block=16),
        grad_y.contiguous(),
        tensors,
    )
    x = tensors["x"].detach().T.contiguous().T.requires_grad_()  # strides (1, 6)
    wide = torch.zeros(13, 40, device=DEVICE)
    wide[:, ::2] = tensors["weight"].detach()
    weight = wide[:, ::2].requires_grad_()  # strides (40, 2)
    A = tensors["A"].detach().T.contiguous().T.requires_grad_()
    assert not (x.is_contiguous() or weight.is_contiguous() or A.is_contiguous() or grad_y.is_contiguous())
    strided = {"x": x, "weight": weight, "A": A, "B": tensors["B"]}
    got = _outputs(
        _lora_linear(x, weight, A, tensors["B"], SCALE, _backend=backend, _block=16), grad_y, strided
    )
    for name in want:
        _assert_close(got[name], want[name], torch.float32, name)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_empty_token_dim(backend):
    tensors, _ = _inputs((0, 3), 8, 5, 2, torch.float32)
    y = _lora_linear(
        *(tensors[k] for k in NAMES[:4]), SCALE, tensors["column_scale"], tensors["bias"], _backend=backend
    )
    assert y.shape == (0, 3, 5)
    grads = torch.autograd.grad(y.sum(), [tensors[k] for k in NAMES])
    assert grads[0].shape == (0, 3, 8) and not any(g.any() for g in grads[1:])


def test_opcheck():
    """torch.library's own consistency checks: fake tensor, schema, autograd registration, AOT dispatch."""
    tensors, _ = _inputs((6,), 8, 5, 3, torch.float32)
    args = tuple(tensors.values())
    torch.library.opcheck(torch.ops.lightning_llm.lora_linear, (*args, 0.7, "torch", 0))
    torch.library.opcheck(torch.ops.lightning_llm.lora_linear, (*args[:4], None, None, 0.7, "torch", 0))


def test_torch_compile_aot_eager_matches_eager():
    tensors, grad_y = _inputs((3, 4), 8, 5, 3, torch.float32)

    def f(x, weight, A, B, column_scale, bias):
        return lora_linear(x, weight, A, B, SCALE, column_scale=column_scale, bias=bias)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = _outputs(compiled(*tensors.values()), grad_y, tensors)
    want = _outputs(f(*tensors.values()), grad_y, tensors)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_autocast_casts_like_nn_linear():
    """Under autocast the tensors (not column_scale) are cast to its dtype; grads reach the fp32 params."""
    tensors, grad_y = _inputs((5,), 8, 6, 2, torch.float32)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = lora_linear(*(tensors[k] for k in NAMES[:4]), SCALE, tensors["column_scale"], tensors["bias"])
    assert y.dtype == torch.bfloat16
    got = _outputs(y, grad_y, tensors)
    assert all(got[k].dtype == torch.float32 for k in NAMES)
    cast = {k: t.detach().bfloat16() if k != "column_scale" else t.detach() for k, t in tensors.items()}
    want = lora_linear(*(cast[k] for k in NAMES[:4]), SCALE, cast["column_scale"], cast["bias"])
    torch.testing.assert_close(y, want, rtol=0, atol=0)


def _bad(**changes: object) -> dict[str, object]:
    """Keyword args for a valid call (x (4, 8), out 6, rank 3), with ``changes`` applied."""
    kwargs: dict[str, object] = {
        "x": torch.randn(4, 8),
        "weight": torch.randn(6, 8),
        "A": torch.randn(3, 8),
        "B": torch.randn(6, 3),
        "scale": 2.0,
        "column_scale": torch.ones(3),
        "bias": torch.zeros(6),
    }
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (_bad(A=torch.randn(3, 9)), ValueError, r"x is \(4, 8\) but A is \(3, 9\)"),
        (_bad(weight=torch.randn(6, 9)), ValueError, r"x is \(4, 8\) but weight is \(6, 9\)"),
        (_bad(B=torch.randn(6, 2)), ValueError, r"rank mismatch: A is \(3, 8\) .* B is \(6, 2\)"),
        (_bad(B=torch.randn(5, 3)), ValueError, r"weight is \(6, 8\) but B is \(5, 3\)"),
        (
            _bad(column_scale=torch.ones(4)),
            ValueError,
            r"column_scale must have shape \(r,\) = \(3,\) .* got \(4,\)",
        ),
        (_bad(bias=torch.zeros(5)), ValueError, r"bias must have shape \(out,\) = \(6,\) .* got \(5,\)"),
        (_bad(A=torch.randn(3, 8, 1)), ValueError, r"A must have shape \(r, in\)"),
        (_bad(A=torch.randn(0, 8), B=torch.randn(6, 0), column_scale=None), ValueError, "rank r >= 1"),
        (_bad(x=torch.randn(())), ValueError, "0-d"),
        (_bad(A=torch.randn(3, 8).half()), TypeError, "share a dtype"),
        (_bad(x=torch.zeros(4, 8, dtype=torch.int64)), TypeError, "dtype must be one of"),
        (_bad(column_scale=torch.ones(3, dtype=torch.int64)), TypeError, "floating point"),
        (_bad(scale=float("inf")), ValueError, "scale"),
    ],
)
def test_input_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        lora_linear(**kwargs)


def test_dispatch():
    """CPU and fp64 take the reference; forcing Triton where it cannot run fails clearly."""
    x, weight, A, B = torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, 4), torch.zeros(3, 2)
    assert ll._resolve_backend("auto", x, weight, A, B, None, None) == "torch"
    big_a, big_b = torch.zeros(MAX_TRITON_RANK + 1, 4), torch.zeros(3, MAX_TRITON_RANK + 1)
    if triton_available():
        with pytest.raises(TypeError, match="Triton kernel supports"):
            ll._resolve_backend("triton", x.double(), weight.double(), A.double(), B.double(), None, None)
        with pytest.raises(ValueError, match="ranks up to"):
            ll._resolve_backend("triton", x, weight, big_a, big_b, None, None)
    if torch.cuda.is_available() and triton_available():
        cuda = [t.cuda() for t in (x, weight, A, B)]
        assert ll._resolve_backend("auto", *cuda, None, None) == "triton"
        assert ll._resolve_backend("auto", *(t.double() for t in cuda), None, None) == "torch"
        assert (
            ll._resolve_backend("auto", cuda[0], cuda[1], big_a.cuda(), big_b.cuda(), None, None) == "torch"
        )


def test_import_is_lazy_and_works_without_triton():
    """``import lightning_llm.kernels`` neither needs nor imports Triton; CPU calls run without it."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError, as on macOS
        import torch
        import lightning_llm.kernels as k
        x = torch.randn(3, 4, requires_grad=True)
        y = k.lora_linear(x, torch.randn(5, 4), torch.randn(2, 4), torch.randn(5, 2), 0.5)
        y.sum().backward()
        assert y.shape == (3, 5) and x.grad.shape == (3, 4)
        assert "lightning_llm.kernels._lora_linear_triton" not in sys.modules
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
