"""Correctness of the TopK SAE encoder ``topk_encode`` for both backends, and of SAE steps composing the ops.

The reference is compared with the dense formula in float64 (autograd of a dense top-k), and the Triton path
of its sparse backward (on CPU through ``TRITON_INTERPRET=1``, which ``tests/conftest.py`` sets when there is
no CUDA) with both the truth and the reference, with blocks forced to 16 so that several tiles with ragged
edges are exercised. The SAE-step tests compose ``topk_encode``, ``jumprelu`` and ``sparse_decode``.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F

from lightning_llm.kernels import jumprelu, sparse_decode, topk_encode
from lightning_llm.kernels._dispatch import resolve_backend
from lightning_llm.kernels.topk_encode import _topk_encode

# The package re-exports functions, so `import ... as` could pick up a function; take the modules themselves.
SAE_OP_MODULES = [
    importlib.import_module(f"lightning_llm.kernels.{name}")
    for name in ("sparse_decode", "topk_encode", "jumprelu")
]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Max |ours - expected| as a fraction of max(|expected|, 1) over the tensor (``_assert_close``), for
# topk_encode and sparse_decode.
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


def _encode_inputs(lead, d, n_latents, k, dtype, *, seed=0):
    """``x``, ``weight``, ``bias`` (requiring grad) and an upstream gradient of ``values``.

    About half of the pre-activations are negative, so with M = 13 and k = 7 many rows have fewer than k
    positive ones: their zero values (at indices torch.topk picks) must get zero gradient.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "x": torch.randn(*lead, d, generator=gen),
        "weight": torch.randn(n_latents, d, generator=gen) / d**0.5,
        "bias": 0.5 * torch.randn(n_latents, generator=gen),
    }
    grad_values = torch.randn(*lead, k, generator=gen).to(DEVICE, dtype)
    return {k_: t.to(DEVICE, dtype).requires_grad_() for k_, t in tensors.items()}, grad_values


def _check_encode(tensors, grad_values, k, backend, block=None):
    """Run ``backend``: the selection is torch.topk of relu(pre) in the input dtype (bitwise), and values
    and gradients match the float64 dense formula ``pre.gather(indices) · 1[values > 0]`` for that selection
    (whose autograd is the dense backward). Returns them."""
    x, weight, bias = tensors.values()
    dtype = x.dtype
    values, indices = _topk_encode(x, weight, bias, k, _backend=backend, _block=block)
    assert values.dtype == dtype and indices.dtype == torch.int64
    assert values.shape == indices.shape == (*x.shape[:-1], k)
    with torch.no_grad():
        want_v, want_i = torch.topk(torch.relu(F.linear(x, weight, bias)), k, sorted=False)
    torch.testing.assert_close(values, want_v, rtol=0, atol=0)
    assert torch.equal(indices, want_i)
    got = {"values": values, **_grads([values], [grad_values], tensors)}
    t64 = _truth(tensors)
    pre = F.linear(t64["x"], t64["weight"], t64["bias"])
    want_values = pre.gather(-1, indices) * (values > 0)
    want = {"values": want_values, **_grads([want_values], [grad_values.double()], t64)}
    for name in want:
        assert got[name].dtype == dtype, name
        _assert_close(got[name], want[name], TOLERANCE[dtype], f"{backend} {name} ({dtype})")
    return got


@pytest.mark.parametrize(
    ("lead", "d", "n_latents", "k"),
    [((7,), 5, 13, 4), ((2, 3), 48, 96, 7), ((1,), 67, 13, 1), ((33,), 5, 13, 7)],
)
def test_encode_reference_matches_dense_topk_autograd(lead, d, n_latents, k):
    """float64: values, indices and gradients equal autograd of ``torch.topk(relu(x Wᵀ + b), k, sorted=False)`` itself."""
    tensors, grad_values = _encode_inputs(lead, d, n_latents, k, torch.float64)
    values, indices = topk_encode(*tensors.values(), k)
    got = {"values": values, **_grads([values], [grad_values], tensors)}
    t64 = _truth(tensors)
    want_values, want_indices = torch.topk(torch.relu(F.linear(*t64.values())), k, sorted=False)
    want = {"values": want_values, **_grads([want_values], [grad_values], t64)}
    assert torch.equal(indices, want_indices)
    for name in want:
        _assert_close(got[name], want[name], TOLERANCE[torch.float64], name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_encode_reference_matches_truth(dtype):
    tensors, grad_values = _encode_inputs((33,), 48, 13, 7, dtype)
    _check_encode(tensors, grad_values, 7, "torch")


def test_encode_reference_gradcheck_and_double_backward():
    """float64 finite differences (pre-activations far from 0 and from ties at this seed), first and second
    order (the sparse backward is built from differentiable ops)."""
    tensors, _ = _encode_inputs((3,), 4, 6, 2, torch.float64, seed=3)

    def f(x, weight, bias):
        return topk_encode(x, weight, bias, 2)[0]

    args = tuple(tensors.values())
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


# (leading shape, d, M, k, dtype, forced block)
ENCODE_TRITON_CASES = [
    ((33,), 67, 96, 7, torch.float32, 16),
    ((7,), 48, 13, 4, torch.bfloat16, 16),
    ((2, 3), 5, 13, 1, torch.float16, None),
]


@pytest.mark.triton
@pytest.mark.parametrize(
    "case", ENCODE_TRITON_CASES, ids=lambda c: "N{}-d{}-M{}-k{}-{}-blk{}".format(*c).replace("torch.", "")
)
def test_encode_triton_matches_truth_and_reference(case):
    lead, d, n_latents, k, dtype, block = case
    tensors, grad_values = _encode_inputs(lead, d, n_latents, k, dtype, seed=d)
    got = _check_encode(tensors, grad_values, k, "triton", block)
    want = _check_encode(tensors, grad_values, k, "torch")
    for name in got:
        _assert_close(got[name], want[name], TOLERANCE[dtype], f"triton vs reference {name}")


def test_encode_autocast_casts_like_nn_linear():
    """Under autocast the tensors are cast to its dtype; the gradients reach the fp32 parameters."""
    tensors, grad_values = _encode_inputs((5,), 8, 13, 3, torch.float32)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        values, indices = topk_encode(*tensors.values(), 3)
    assert values.dtype == torch.bfloat16
    got = _grads([values], [grad_values.bfloat16()], tensors)
    assert all(g.dtype == torch.float32 for g in got.values())
    want_v, want_i = topk_encode(*(t.detach().bfloat16() for t in tensors.values()), 3)
    torch.testing.assert_close(values, want_v, rtol=0, atol=0)
    assert torch.equal(indices, want_i)


def test_sae_step_decodes_own_codes():
    """encode → decode composes: ``sparse_decode(topk_encode(x))`` equals the dense TopK SAE, grads too."""
    enc, _ = _encode_inputs((9,), 12, 40, 5, torch.float64)
    w_dec = (
        torch.randn(40, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64) / 5
    ).requires_grad_()
    b_dec = torch.zeros(12, dtype=torch.float64, requires_grad=True)
    params = {**enc, "w_dec": w_dec, "b_dec": b_dec}
    values, indices = topk_encode(enc["x"], enc["weight"], enc["bias"], 5)
    loss = (sparse_decode(values, indices, w_dec, b_dec) - enc["x"]).pow(2).sum()
    got = _grads([loss], [torch.ones(())], params)
    t64 = _truth(params)
    pre = torch.relu(F.linear(t64["x"], t64["weight"], t64["bias"]))
    v, i = torch.topk(pre, 5)
    f = torch.zeros_like(pre).scatter(-1, i, v)
    loss64 = (f @ t64["w_dec"] + t64["b_dec"] - t64["x"]).pow(2).sum()
    want = _grads([loss64], [torch.ones((), dtype=torch.float64)], t64)
    torch.testing.assert_close(loss.detach(), loss64.detach(), rtol=1e-12, atol=0)
    for name in want:
        _assert_close(got[name], want[name], TOLERANCE[torch.float64], name)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_empty_token_dim(backend):
    enc, _ = _encode_inputs((0,), 5, 13, 4, torch.float32)
    values, indices = _topk_encode(*enc.values(), 4, _backend=backend)
    assert values.shape == indices.shape == (0, 4)
    grads = torch.autograd.grad(values.sum(), list(enc.values()))
    assert grads[0].shape == (0, 5) and not any(g.any() for g in grads[1:])


def test_torch_compile_sae_step_matches_eager():
    """A TopK + JumpReLU SAE loss under ``torch.compile`` (aot_eager) gives eager's loss and gradients."""
    enc, _ = _encode_inputs((3, 4), 8, 13, 3, torch.float32)
    w_dec = torch.randn(13, 8, generator=torch.Generator().manual_seed(2), device=DEVICE).requires_grad_()
    theta = torch.full((13,), 0.3, device=DEVICE, requires_grad=True)
    params = {**enc, "w_dec": w_dec, "theta": theta}

    def loss_fn(x, weight, bias, w_dec, theta):
        values, indices = topk_encode(x, weight, bias, 3)
        recon = sparse_decode(values, indices, w_dec)
        acts, l0 = jumprelu(F.linear(x, weight, bias), theta, 0.5)
        return (recon - x).pow(2).sum() + (acts @ w_dec - x).pow(2).sum() + l0.sum()

    compiled = torch.compile(loss_fn, backend="aot_eager")
    got = _grads([compiled(*params.values())], [torch.ones((), device=DEVICE)], params)
    want = _grads([loss_fn(*params.values())], [torch.ones((), device=DEVICE)], params)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_opcheck():
    """torch.library's own consistency checks: fake tensors, schema, autograd registration, AOT dispatch."""
    enc, _ = _encode_inputs((6,), 5, 13, 3, torch.float32)
    torch.library.opcheck(torch.ops.lightning_llm.topk_encode, (*enc.values(), 3, "torch", 0))


def _encode_kwargs(**changes):
    kwargs = {"x": torch.randn(4, 5), "weight": torch.randn(6, 5), "bias": torch.zeros(6), "k": 2}
    return {**kwargs, **changes}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (_encode_kwargs(weight=torch.randn(6, 4)), ValueError, r"x is \(4, 5\) but weight is \(6, 4\)"),
        (_encode_kwargs(bias=torch.zeros(5)), ValueError, r"bias must have shape \(M,\) = \(6,\)"),
        (_encode_kwargs(k=7), ValueError, r"k must be in \[1, M\] = \[1, 6\] .* got 7"),
        (_encode_kwargs(k=0), ValueError, r"\[1, 6\]"),
        (_encode_kwargs(k=2.0), TypeError, "Python int"),
        (_encode_kwargs(x=torch.randn(4, 5).double()), TypeError, "share a dtype"),
    ],
)
def test_input_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        topk_encode(**kwargs)


def test_cpu_path_never_loads_the_triton_module(monkeypatch):
    """CPU calls of the SAE ops (forward and backward, default backend) never import ``_sae_triton``, so they
    run where Triton is missing. (That ``import lightning_llm.kernels`` imports no Triton is checked in a clean
    interpreter by the other kernel test files; a subprocess here would cost seconds.)"""
    import lightning_llm.kernels as kernels

    monkeypatch.delattr(kernels, "_sae_triton", raising=False)
    monkeypatch.setitem(sys.modules, "lightning_llm.kernels._sae_triton", None)  # importing it now fails
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(6, 4, requires_grad=True)
    values, indices = topk_encode(x, w, torch.zeros(6), 2)
    acts, l0 = jumprelu(values, torch.ones(2), 0.1)
    (sparse_decode(acts, indices, w).sum() + l0.sum()).backward()
    assert x.grad.shape == (3, 4) and w.grad.shape == (6, 4)
    assert all("triton" not in vars(module) for module in SAE_OP_MODULES)


@pytest.mark.gpu
def test_cuda_triton_path_matches_reference():
    """On CUDA ``auto`` runs the compiled Triton kernels; they match the reference at SAE-like sizes (bf16)."""
    n_tokens, d, n_latents, k = 512, 256, 4096, 32
    dtype = torch.bfloat16
    enc, grad_values = _encode_inputs((n_tokens,), d, n_latents, k, dtype)
    assert resolve_backend("topk_encode", "auto", enc.values(), dtype=dtype) == "triton"
    got = _check_encode(enc, grad_values, k, "auto")
    want = _check_encode(enc, grad_values, k, "torch")
    for name in got:
        _assert_close(got[name], want[name], TOLERANCE[dtype], f"encode {name}")
