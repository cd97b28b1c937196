"""Correctness of the JumpReLU SAE activation ``jumprelu``, for both backends.

Outputs and straight-through gradients are compared with the docstring's equations (a hand-worked example
and float64 formulas), and the Triton kernels (on CPU through ``TRITON_INTERPRET=1``, which
``tests/conftest.py`` sets when there is no CUDA) with both the equations and the reference, with blocks
forced to 16 so that several row and column tiles with ragged edges are exercised.
"""

from __future__ import annotations

import pytest
import torch

from lightning_llm.kernels import jumprelu
from lightning_llm.kernels._dispatch import resolve_backend
from lightning_llm.kernels.jumprelu import _jumprelu

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

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


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_empty_token_dim(backend):
    pre, theta, _, _ = _jumprelu_inputs((0,), 13, torch.float32)
    acts, l0 = _jumprelu(pre, theta, 0.1, _backend=backend)
    assert acts.shape == (0, 13) and l0.shape == (0,)
    d_pre, d_theta = torch.autograd.grad(acts.sum() + l0.sum(), [pre, theta])
    assert d_pre.shape == (0, 13) and not d_theta.any()


def test_opcheck():
    """torch.library's own consistency checks: fake tensors, schema, autograd registration, AOT dispatch."""
    pre, theta, grad_acts, grad_l0 = _jumprelu_inputs((6,), 13, torch.float32)
    torch.library.opcheck(torch.ops.lightning_llm.jumprelu, (pre, theta, 0.1, "torch", 0))
    for upstream in ((grad_acts, None), (None, grad_l0)):
        torch.library.opcheck(
            torch.ops.lightning_llm.jumprelu_backward,
            (*upstream, pre.detach(), theta.detach(), 0.1, "torch", 0),
        )


def _jumprelu_kwargs(**changes):
    return {"pre": torch.randn(4, 6), "threshold": torch.ones(6), "bandwidth": 0.1, **changes}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (_jumprelu_kwargs(threshold=torch.ones(5)), ValueError, r"\(M,\) = \(6,\) .* got \(5,\)"),
        (_jumprelu_kwargs(bandwidth=0.0), ValueError, "bandwidth"),
        (_jumprelu_kwargs(bandwidth=float("nan")), ValueError, "bandwidth"),
        (_jumprelu_kwargs(threshold=torch.ones(6, dtype=torch.int64)), TypeError, "floating point"),
        (_jumprelu_kwargs(pre=torch.ones(4, 6, dtype=torch.int64)), TypeError, "dtype must be one of"),
    ],
)
def test_input_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        jumprelu(**kwargs)


def test_private_hooks():
    """A bad forced block fails clearly."""
    with pytest.raises(ValueError, match="_block"):
        _jumprelu(**_jumprelu_kwargs(), _block=24)


@pytest.mark.gpu
def test_cuda_triton_path_matches_reference():
    """On CUDA ``auto`` runs the compiled Triton kernels; they match the reference at SAE-like sizes (bf16)."""
    n_tokens, n_latents = 512, 4096
    dtype = torch.bfloat16
    inputs = _jumprelu_inputs((n_tokens,), n_latents, dtype)
    assert resolve_backend("jumprelu", "auto", inputs[:2], dtype=dtype) == "triton"
    got = _check_jumprelu(*inputs, "auto")
    want = _check_jumprelu(*inputs, "torch")
    for g, w in zip(got[:3], want[:3], strict=False):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    _assert_close(got[3], want[3], THRESHOLD_TOLERANCE[torch.float32], "jumprelu d_threshold")
