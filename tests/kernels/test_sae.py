"""Correctness of the SAE ops ``sparse_decode``, ``topk_encode`` and ``jumprelu``, for both backends.

Each reference is compared with the naive dense formula in float64 (autograd of a dense scatter / top-k,
or hand-computed straight-through gradients for JumpReLU), and the Triton kernels (on CPU through
``TRITON_INTERPRET=1``, which ``tests/conftest.py`` sets when there is no CUDA) with both the truth and the
reference. The interpreter is slow, so the Triton cases are few and small, with blocks forced to 16 so that
several row and column tiles with ragged edges are exercised (N = 33 gives three row tiles, the last with
one row; d = 67 five column tiles, the last with 3 columns).
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F

from lightning_llm.kernels import jumprelu, sparse_decode, topk_encode
from lightning_llm.kernels._dispatch import triton_available
from lightning_llm.kernels.sae import _jumprelu, _sparse_decode, _topk_encode

# The package re-exports functions, so `import ... as` could pick up a function; take the module itself.
sae = importlib.import_module("lightning_llm.kernels.sae")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Max |ours - expected| as a fraction of max(|expected|, 1) over the tensor (``_assert_close``), for
# sparse_decode and topk_encode.
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
# JumpReLU: acts, l0 and d_pre are exact on both paths (a copy of pre or zero, integer counts, a copy of
# d_acts or zero), so they are compared with zero tolerance. d_threshold is an fp32 sum over the rows of
# fp32 products whatever pre's dtype (threshold is fp32 here), so only the summation order differs:
# relative 1e-5 (observed 0 to 1e-7). float64 (reference only): 1e-12.
THRESHOLD_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


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


# --------------------------------------------------------------------------------------------------
# sparse_decode
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# topk_encode
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# jumprelu
# --------------------------------------------------------------------------------------------------

EPS = 0.1  # bandwidth ε of the hand-built example: the window is |pre - θ| < 0.05
HAND_PRE = [[0.5, 1.02, 1.97, 2.0], [1.3, 0.96, 2.04, 1.46]]
HAND_THETA = [1.0, 1.0, 2.0, 1.5]
HAND_GRAD_ACTS = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]
HAND_GRAD_L0 = [10.0, 20.0]
# Active (pre > θ): [[0, 1, 0, 1], [1, 0, 1, 0]]. In the window (|pre − θ| < 0.05): column 0 never
# (0.5, 0.3 away), column 1 both rows (0.02, 0.04), column 2 both (0.03, 0.04), column 3 only row 1
# (0.5 and 0.04 away). d_θ_i = −(1/ε) Σ_n K·(θ_i d_acts[n, i] + d_l0[n]):
#   i = 0: 0;  i = 1: −10·((1·2 + 10) + (1·6 + 20)) = −380;  i = 2: −10·((2·3 + 10) + (2·7 + 20)) = −500;
#   i = 3: −10·(1.5·8 + 20) = −320. Through acts only (d_l0 = 0): [0, −80, −200, −120];
#   through l0 only (d_acts = 0): [0, −300, −300, −200].
HAND_ACTS = [[0.0, 1.02, 0.0, 2.0], [1.3, 0.0, 2.04, 0.0]]
HAND_L0 = [2.0, 2.0]
HAND_GRAD_PRE = [[0.0, 2.0, 0.0, 4.0], [5.0, 0.0, 7.0, 0.0]]
HAND_GRAD_THETA = {
    "both": [0.0, -380.0, -500.0, -320.0],
    "acts": [0.0, -80.0, -200.0, -120.0],
    "l0": [0.0, -300.0, -300.0, -200.0],
}


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        ("torch", torch.float64),
        ("torch", torch.float32),
        pytest.param("triton", torch.float32, marks=pytest.mark.triton),
    ],
)
@pytest.mark.parametrize("through", ["both", "acts", "l0"])
def test_jumprelu_hand_example(backend, dtype, through):
    """The straight-through gradients of the docstring's equations on a 2 × 4 example worked by hand."""
    pre = torch.tensor(HAND_PRE, dtype=dtype, device=DEVICE, requires_grad=True)
    theta = torch.tensor(HAND_THETA, dtype=dtype, device=DEVICE, requires_grad=True)
    acts, l0 = _jumprelu(pre, theta, EPS, _backend=backend, _block=16)
    ref = torch.tensor
    torch.testing.assert_close(acts, ref(HAND_ACTS, dtype=dtype, device=DEVICE), rtol=0, atol=0)
    torch.testing.assert_close(l0, ref(HAND_L0, dtype=dtype, device=DEVICE), rtol=0, atol=0)
    grad_acts = ref(HAND_GRAD_ACTS, dtype=dtype, device=DEVICE) if through != "l0" else None
    grad_l0 = ref(HAND_GRAD_L0, dtype=dtype, device=DEVICE) if through != "acts" else None
    d_pre, d_theta = _grads([acts, l0], [grad_acts, grad_l0], {"pre": pre, "theta": theta}).values()
    want_pre = ref(HAND_GRAD_PRE, dtype=dtype, device=DEVICE) if through != "l0" else torch.zeros_like(pre)
    torch.testing.assert_close(d_pre, want_pre, rtol=0, atol=0)
    torch.testing.assert_close(
        d_theta, ref(HAND_GRAD_THETA[through], dtype=dtype, device=DEVICE), rtol=1e-6, atol=0
    )


JUMP_EPS = 0.05  # bandwidth of the random cases


def _jumprelu_inputs(lead, n_latents, dtype, *, seed=0):
    """``pre`` (requires grad) with about a third of its entries inside the ε-window around θ, ``θ`` in fp32
    (requires grad) and upstream gradients of ``acts`` and ``l0``."""
    gen = torch.Generator().manual_seed(seed)
    theta = 0.5 + torch.rand(n_latents, generator=gen)
    near = theta + JUMP_EPS * (torch.rand(*lead, n_latents, generator=gen) - 0.5) * 1.5
    far = theta + torch.randn(*lead, n_latents, generator=gen)
    pre = torch.where(torch.rand(*lead, n_latents, generator=gen) < 0.5, near, far)
    grad_acts = torch.randn(*lead, n_latents, generator=gen).to(DEVICE, dtype)
    grad_l0 = torch.randn(*lead, generator=gen).to(DEVICE, torch.promote_types(dtype, torch.float32))
    pre = pre.to(DEVICE, dtype).requires_grad_()
    theta = theta.to(DEVICE, torch.promote_types(dtype, torch.float32)).requires_grad_()
    return pre, theta, grad_acts, grad_l0


def _naive_jumprelu_grads(pre, theta, grad_acts, grad_l0):
    """The docstring's equations in float64: ``acts``, ``l0``, ``d_pre``, ``d_θ``.

    The rectangle kernel K((pre − θ)/ε) = 1[|pre − θ| < ε/2] is decided as the ops document it, with
    ``pre − θ`` rounded to the accumulation dtype (fp32 for 16-bit and fp32 ``pre``): evaluated in float64
    instead, an entry within rounding of the window's edge (about one in 10^6 at these distributions) could
    fall on the other side and move d_θ by a whole term.
    """
    acc = torch.promote_types(pre.dtype, torch.float32)
    window = (pre.detach().to(acc) - theta.detach().to(acc)).abs() < 0.5 * JUMP_EPS
    p, th = pre.detach().double(), theta.detach().double()
    ga, gl = grad_acts.double(), grad_l0.double()
    active = (p > th).double()
    d_theta = (
        (-(1 / JUMP_EPS) * window.double() * (th * ga + gl.unsqueeze(-1))).reshape(-1, th.shape[0]).sum(0)
    )
    return p * active, active.sum(-1), ga * active, d_theta


def _check_jumprelu(pre, theta, grad_acts, grad_l0, backend, block=None):
    acts, l0 = _jumprelu(pre, theta, JUMP_EPS, _backend=backend, _block=block)
    assert acts.dtype == pre.dtype and acts.shape == pre.shape
    assert l0.dtype == torch.promote_types(pre.dtype, torch.float32) and l0.shape == pre.shape[:-1]
    d_pre, d_theta = _grads([acts, l0], [grad_acts, grad_l0], {"pre": pre, "theta": theta}).values()
    assert d_pre.dtype == pre.dtype and d_theta.dtype == theta.dtype
    want = _naive_jumprelu_grads(pre, theta, grad_acts, grad_l0)
    for name, got, expected in zip(("acts", "l0", "d_pre"), (acts, l0, d_pre), want[:3], strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=0, msg=f"{backend} {name}")
    _assert_close(d_theta, want[3], THRESHOLD_TOLERANCE[theta.dtype], f"{backend} d_threshold")
    assert want[3].abs().min() < want[3].abs().max(), "degenerate example"
    return acts, l0, d_pre, d_theta


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_jumprelu_reference_matches_equations(dtype):
    _check_jumprelu(*_jumprelu_inputs((4, 9), 13, dtype), "torch")


def test_jumprelu_reference_gradcheck_pre():
    """Away from θ the gradient w.r.t. pre is the true derivative (H for acts, 0 for l0): finite differences."""
    pre, theta, _, _ = _jumprelu_inputs((5,), 7, torch.float64, seed=4)
    pre = (theta.detach() + torch.where(pre.detach() > theta.detach(), 0.5, -0.5)).requires_grad_()

    def f(pre):
        return jumprelu(pre, theta.detach(), JUMP_EPS)

    assert torch.autograd.gradcheck(f, (pre,))


# (leading shape, M, dtype, forced block)
JUMPRELU_TRITON_CASES = [
    ((33,), 67, torch.float32, 16),
    ((7,), 96, torch.bfloat16, 16),
    ((3, 5), 13, torch.float16, 16),
    ((33,), 96, torch.float32, None),
]


@pytest.mark.triton
@pytest.mark.parametrize(
    "case", JUMPRELU_TRITON_CASES, ids=lambda c: "N{}-M{}-{}-blk{}".format(*c).replace("torch.", "")
)
def test_jumprelu_triton_matches_equations_and_reference(case):
    lead, n_latents, dtype, block = case
    inputs = _jumprelu_inputs(lead, n_latents, dtype, seed=n_latents)
    got = _check_jumprelu(*inputs, "triton", block)
    want = _check_jumprelu(*inputs, "torch")
    for name, g, w in zip(("acts", "l0", "d_pre"), got[:3], want[:3], strict=False):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)
    _assert_close(got[3], want[3], THRESHOLD_TOLERANCE[torch.float32], "triton vs reference d_threshold")


# --------------------------------------------------------------------------------------------------
# All ops: edge cases, registration, dispatch, validation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_empty_token_dim(backend):
    tensors, _ = _decode_inputs((0, 3), 5, 13, 4, torch.float32)
    out = _sparse_decode(*tensors.values(), _backend=backend)
    assert out.shape == (0, 3, 5)
    grads = torch.autograd.grad(out.sum(), [tensors["values"], tensors["weight"], tensors["bias"]])
    assert grads[0].shape == (0, 3, 4) and not any(g.any() for g in grads[1:])
    enc, _ = _encode_inputs((0,), 5, 13, 4, torch.float32)
    values, indices = _topk_encode(*enc.values(), 4, _backend=backend)
    assert values.shape == indices.shape == (0, 4)
    grads = torch.autograd.grad(values.sum(), list(enc.values()))
    assert grads[0].shape == (0, 5) and not any(g.any() for g in grads[1:])
    pre, theta, _, _ = _jumprelu_inputs((0,), 13, torch.float32)
    acts, l0 = _jumprelu(pre, theta, 0.1, _backend=backend)
    assert acts.shape == (0, 13) and l0.shape == (0,)
    d_pre, d_theta = torch.autograd.grad(acts.sum() + l0.sum(), [pre, theta])
    assert d_pre.shape == (0, 13) and not d_theta.any()


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
    tensors, grad_out = _decode_inputs((6,), 5, 13, 3, torch.float32)
    args = tuple(tensors.values())
    torch.library.opcheck(torch.ops.lightning_llm.sparse_decode, (*args, "torch", 0))
    torch.library.opcheck(torch.ops.lightning_llm.sae_gather_dot, (grad_out, *args[1:3], "torch", 0))
    enc, _ = _encode_inputs((6,), 5, 13, 3, torch.float32)
    torch.library.opcheck(torch.ops.lightning_llm.topk_encode, (*enc.values(), 3, "torch", 0))
    pre, theta, grad_acts, grad_l0 = _jumprelu_inputs((6,), 13, torch.float32)
    torch.library.opcheck(torch.ops.lightning_llm.jumprelu, (pre, theta, 0.1, "torch", 0))
    for upstream in ((grad_acts, None), (None, grad_l0)):
        torch.library.opcheck(
            torch.ops.lightning_llm.jumprelu_backward,
            (*upstream, pre.detach(), theta.detach(), 0.1, "torch", 0),
        )


def _decode_kwargs(**changes):
    kwargs = {
        "values": torch.rand(4, 3),
        "indices": torch.randint(0, 6, (4, 3)),
        "weight": torch.randn(6, 5),
        "bias": torch.zeros(5),
    }
    return {**kwargs, **changes}


def _encode_kwargs(**changes):
    kwargs = {"x": torch.randn(4, 5), "weight": torch.randn(6, 5), "bias": torch.zeros(6), "k": 2}
    return {**kwargs, **changes}


def _jumprelu_kwargs(**changes):
    return {"pre": torch.randn(4, 6), "threshold": torch.ones(6), "bandwidth": 0.1, **changes}


@pytest.mark.parametrize(
    ("fn", "kwargs", "error", "match"),
    [
        (
            sparse_decode,
            _decode_kwargs(indices=torch.zeros(4, 2, dtype=torch.long)),
            ValueError,
            r"shape of values .* \(4, 3\), got \(4, 2\)",
        ),
        (
            sparse_decode,
            _decode_kwargs(weight=torch.randn(6, 5, 1)),
            ValueError,
            r"weight must have shape \(M, d\)",
        ),
        (
            sparse_decode,
            _decode_kwargs(bias=torch.zeros(4)),
            ValueError,
            r"bias must have shape \(d,\) = \(5,\) .* got \(4,\)",
        ),
        (
            sparse_decode,
            _decode_kwargs(values=torch.rand(4, 0), indices=torch.zeros(4, 0, dtype=torch.long)),
            ValueError,
            "k >= 1",
        ),
        (sparse_decode, _decode_kwargs(values=torch.tensor(1.0), indices=torch.tensor(0)), ValueError, "0-d"),
        (
            sparse_decode,
            _decode_kwargs(indices=torch.full((4, 3), 6)),
            ValueError,
            r"\[0, 6\), got values in \[6, 6\]",
        ),
        (
            sparse_decode,
            _decode_kwargs(indices=torch.tensor([[0, -1, 2]] * 4)),
            ValueError,
            r"got values in \[-1, 2\]",
        ),
        (sparse_decode, _decode_kwargs(indices=torch.zeros(4, 3, dtype=torch.int32)), TypeError, "int64"),
        (sparse_decode, _decode_kwargs(weight=torch.randn(6, 5).half()), TypeError, "share a dtype"),
        (
            sparse_decode,
            _decode_kwargs(values=torch.ones(4, 3, dtype=torch.int64)),
            TypeError,
            "dtype must be one of",
        ),
        (
            topk_encode,
            _encode_kwargs(weight=torch.randn(6, 4)),
            ValueError,
            r"x is \(4, 5\) but weight is \(6, 4\)",
        ),
        (
            topk_encode,
            _encode_kwargs(bias=torch.zeros(5)),
            ValueError,
            r"bias must have shape \(M,\) = \(6,\)",
        ),
        (topk_encode, _encode_kwargs(k=7), ValueError, r"k must be in \[1, M\] = \[1, 6\] .* got 7"),
        (topk_encode, _encode_kwargs(k=0), ValueError, r"\[1, 6\]"),
        (topk_encode, _encode_kwargs(k=2.0), TypeError, "Python int"),
        (topk_encode, _encode_kwargs(x=torch.randn(4, 5).double()), TypeError, "share a dtype"),
        (jumprelu, _jumprelu_kwargs(threshold=torch.ones(5)), ValueError, r"\(M,\) = \(6,\) .* got \(5,\)"),
        (jumprelu, _jumprelu_kwargs(bandwidth=0.0), ValueError, "bandwidth"),
        (jumprelu, _jumprelu_kwargs(bandwidth=float("nan")), ValueError, "bandwidth"),
        (jumprelu, _jumprelu_kwargs(threshold=torch.ones(6, dtype=torch.int64)), TypeError, "floating point"),
        (
            jumprelu,
            _jumprelu_kwargs(pre=torch.ones(4, 6, dtype=torch.int64)),
            TypeError,
            "dtype must be one of",
        ),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_input_validation(fn, kwargs, error, match):
    with pytest.raises(error, match=match):
        fn(**kwargs)


def test_dispatch_and_private_hooks():
    """CPU takes the reference; forcing Triton on fp64 or a bad block/backend fails clearly."""
    x = torch.zeros(2, 3)
    assert sae._resolve_backend("auto", x.dtype, x) == "torch"
    assert sae._resolve_backend("auto", torch.float64, x.double()) == "torch"
    if triton_available():
        with pytest.raises(TypeError, match="Triton kernels support"):
            _sparse_decode(
                **_decode_kwargs(
                    values=torch.rand(4, 3).double(), weight=torch.randn(6, 5).double(), bias=None
                ),
                _backend="triton",
            )
    with pytest.raises(ValueError, match="_block"):
        _jumprelu(**_jumprelu_kwargs(), _block=24)
    with pytest.raises(ValueError, match="_backend"):
        _sparse_decode(**_decode_kwargs(), _backend="cuda")
    if torch.cuda.is_available() and triton_available():
        assert sae._resolve_backend("auto", torch.bfloat16, x.cuda()) == "triton"
        assert sae._resolve_backend("auto", torch.float64, x.cuda().double()) == "torch"


def test_cpu_path_never_loads_the_triton_module(monkeypatch):
    """CPU calls (forward and backward, default backend) never import ``_sae_triton``, so they run where
    Triton is missing. (That ``import lightning_llm.kernels`` imports no Triton is checked in a clean
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
    assert "triton" not in vars(sae)


@pytest.mark.gpu
def test_cuda_triton_path_matches_reference():
    """On CUDA ``auto`` runs the compiled Triton kernels; they match the reference at SAE-like sizes (bf16)."""
    n_tokens, d, n_latents, k = 512, 256, 4096, 32
    dtype = torch.bfloat16
    tensors, grad_out = _decode_inputs((n_tokens,), d, n_latents, k, dtype)
    assert sae._resolve_backend("auto", dtype, *(t for t in tensors.values())) == "triton"
    got = _check_decode(tensors, grad_out, "auto")
    want = _check_decode(tensors, grad_out, "torch")
    for name in got:
        _assert_close(got[name], want[name], TOLERANCE[dtype], f"decode {name}")
    enc, grad_values = _encode_inputs((n_tokens,), d, n_latents, k, dtype)
    got = _check_encode(enc, grad_values, k, "auto")
    want = _check_encode(enc, grad_values, k, "torch")
    for name in got:
        _assert_close(got[name], want[name], TOLERANCE[dtype], f"encode {name}")
    inputs = _jumprelu_inputs((n_tokens,), n_latents, dtype)
    got = _check_jumprelu(*inputs, "auto")
    want = _check_jumprelu(*inputs, "torch")
    for g, w in zip(got[:3], want[:3], strict=False):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    _assert_close(got[3], want[3], THRESHOLD_TOLERANCE[torch.float32], "jumprelu d_threshold")
