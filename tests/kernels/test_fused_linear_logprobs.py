"""Correctness of ``fused_linear_logprobs`` against a float64 ``log_softmax`` ground truth.

Both backends are checked: the PyTorch reference and the Triton kernels (on CPU through
``TRITON_INTERPRET=1``, which ``tests/conftest.py`` sets when there is no CUDA). The interpreter is slow,
so the Triton cases are a small subset of the reference ones.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_llm.kernels import fused_linear_logprobs
from lightning_llm.kernels._dispatch import DISABLE_TRITON_ENV, triton_available, use_triton
from lightning_llm.kernels.fused_linear_logprobs import _fused_linear_logprobs, entropy_dynamics_reference

# The package re-exports the function under the module's own name, so `import ... as` would give the function.
flp = importlib.import_module("lightning_llm.kernels.fused_linear_logprobs")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Max |ours - float64 truth| as a fraction of the largest |truth| in that tensor (``_assert_close``).
# fp32: all reductions in fp32 without cancellation; observed <= 1.3e-6 over this file's cases.
# bf16: the logits chunk and its in-place gradient are bf16 (2^-9 relative rounding), so with logits up to
#       ~8 an error of ~1e-2 of scale is inherent, as for any bf16 LM head; observed <= 1.1e-2.
# fp16: same structure with a 10-bit mantissa; observed <= 1.6e-3.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}

# (tokens, vocab, hidden, chunk_size): chunk smaller than and dividing / not dividing the token count, equal
# to it and larger than it; vocab 1 (degenerate softmax), primes, and a non power of two above 512.
SHAPES = [
    (1, 1, 8, 4),
    (7, 37, 24, 3),
    (33, 257, 65, 8),
    (130, 1000, 24, 50),
    (33, 1000, 8, 1000),
    (130, 257, 65, 130),
]


def _inputs(
    n_tokens: int, vocab: int, hidden: int, dtype: torch.dtype, seed: int = 0, logit_scale: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden, weight (both requiring grad), targets and random upstream grads for the two outputs.

    ``weight`` is scaled so logits have std ``logit_scale``: realistic peaked-but-not-degenerate rows.
    """
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n_tokens, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * (logit_scale / hidden**0.5)
    y = torch.randint(0, vocab, (n_tokens,), generator=gen)
    g_lp, g_ent = torch.randn(n_tokens, generator=gen), torch.randn(n_tokens, generator=gen)
    h, w = (t.to(DEVICE, dtype).requires_grad_() for t in (h, w))
    return h, w, y.to(DEVICE), g_lp.to(DEVICE), g_ent.to(DEVICE)


def _truth(
    h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ground truth: full logits, ``log_softmax``, gather, ``-Σ p log p``; autograd for grads."""
    log_p = torch.log_softmax(h.double() @ w.double().T / temperature, dim=-1)
    return log_p.gather(-1, y[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _grads(
    lp: torch.Tensor, ent: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor, *params: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    loss = (lp * g_lp.to(lp.dtype)).sum() + (ent * g_ent.to(ent.dtype)).sum()
    return torch.autograd.grad(loss, params)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``max|actual - expected| <= TOLERANCE[dtype] * max(|expected|, 1)``, with a readable message."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, 1.0)
    assert err <= TOLERANCE[dtype] * scale, f"{what} ({dtype}): max error {err:.3e}, scale {scale:.3e}"


def _check_against_truth(
    shape: tuple[int, int, int, int],
    temperature: float,
    dtype: torch.dtype,
    backend: str,
    block_v: int | None = None,
    logit_scale: float = 2.0,
) -> None:
    n_tokens, vocab, hidden, chunk = shape
    h, w, y, g_lp, g_ent = _inputs(n_tokens, vocab, hidden, dtype, seed=sum(shape), logit_scale=logit_scale)
    lp, ent = _fused_linear_logprobs(
        h, w, y, chunk_size=chunk, temperature=temperature, _backend=backend, _block_v=block_v
    )
    assert lp.dtype == ent.dtype == torch.float32
    grad_h, grad_w = _grads(lp, ent, g_lp, g_ent, h, w)
    assert grad_h.dtype == grad_w.dtype == dtype

    ref_lp, ref_ent = _truth(h, w, y, temperature)
    ref_grad_h, ref_grad_w = _grads(ref_lp, ref_ent, g_lp, g_ent, h, w)
    _assert_close(lp, ref_lp, dtype, "logprobs")
    _assert_close(ent, ref_ent, dtype, "entropy")
    _assert_close(grad_h, ref_grad_h, dtype, "grad hidden")
    _assert_close(grad_w, ref_grad_w, dtype, "grad weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-V{}-H{}-C{}".format(*s))
def test_reference_matches_float64(shape, temperature, dtype):
    _check_against_truth(shape, temperature, dtype, backend="torch")


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-V{}-H{}-C{}".format(*s))
def test_triton_matches_float64(shape, temperature, dtype):
    _check_against_truth(shape, temperature, dtype, backend="triton")


@pytest.mark.triton
@pytest.mark.parametrize(
    ("vocab", "block_v", "logit_scale", "dtype"),
    [
        (257, 16, 2.0, torch.float32),
        (257, 16, 2.0, torch.bfloat16),
        (1000, 128, 2.0, torch.float32),
        (1000, 128, 2.0, torch.bfloat16),
        (1000, 128, 2.0, torch.float16),
        (100, 16, 30.0, torch.float32),
    ],
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_triton_multi_block_rows(vocab, block_v, logit_scale, dtype):
    """Rows streamed over several blocks with a ragged last block: online max rescaling and masking.

    ``logit_scale=30`` makes rows nearly one-hot (entropy ~0, lse dominated by one logit), the regime where
    ``lse - Σ p z`` computed naively would cancel. fp32 only: bf16 logits of magnitude ~60 carry rounding
    errors of ~0.25 by themselves, which says nothing about the kernel.
    """
    _check_against_truth(
        (9, vocab, 24, 4), 0.7, dtype, backend="triton", block_v=block_v, logit_scale=logit_scale
    )


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_leading_dims_and_default_chunk(backend):
    """``[B, T, H]`` hidden with ``[B, T]`` targets, default chunk size: same as the flattened call."""
    h, w, y, g_lp, g_ent = _inputs(2 * 5, 37, 16, torch.float32)
    h3 = h.detach().reshape(2, 5, 16).requires_grad_()
    lp, ent = _fused_linear_logprobs(h3, w, y.reshape(2, 5), _backend=backend)
    assert lp.shape == ent.shape == (2, 5)
    grad_h3, grad_w = _grads(lp, ent, g_lp.reshape(2, 5), g_ent.reshape(2, 5), h3, w)
    ref_lp, ref_ent = _truth(h, w, y, 1.0)
    ref_grad_h, ref_grad_w = _grads(ref_lp, ref_ent, g_lp, g_ent, h, w)
    _assert_close(lp.reshape(-1), ref_lp, torch.float32, "logprobs")
    _assert_close(ent.reshape(-1), ref_ent, torch.float32, "entropy")
    _assert_close(grad_h3.reshape(-1, 16), ref_grad_h, torch.float32, "grad hidden")
    _assert_close(grad_w, ref_grad_w, torch.float32, "grad weight")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_non_contiguous_inputs(backend):
    """Transposed hidden, a column-strided weight and strided targets give the contiguous results."""
    h, w, y, g_lp, g_ent = _inputs(6, 37, 8, torch.float32)
    h_t = h.detach().T.contiguous().T.requires_grad_()  # same values, strides (1, 6)
    w_wide = torch.zeros(37, 16, device=DEVICE)
    w_wide[:, ::2] = w.detach()
    w_s = w_wide[:, ::2].requires_grad_()  # same values, strides (16, 2)
    y_s = torch.stack([y, torch.zeros_like(y)], dim=1)[:, 0]  # same values, stride 2
    assert not (h_t.is_contiguous() or w_s.is_contiguous() or y_s.is_contiguous())
    lp, ent = _fused_linear_logprobs(h_t, w_s, y_s, chunk_size=4, _backend=backend)
    grads = _grads(lp, ent, g_lp, g_ent, h_t, w_s)
    ref_lp, ref_ent = _truth(h, w, y, 1.0)
    ref_grads = _grads(ref_lp, ref_ent, g_lp, g_ent, h, w)
    _assert_close(lp, ref_lp, torch.float32, "logprobs")
    _assert_close(ent, ref_ent, torch.float32, "entropy")
    for got, want in zip(grads, ref_grads, strict=True):
        _assert_close(got, want, torch.float32, "grad")


def test_partial_requires_grad_and_single_output():
    """Frozen hidden / frozen head / no grad at all, and a loss that uses only one of the outputs."""
    h, w, y, g_lp, g_ent = _inputs(7, 37, 8, torch.float32)

    def truth_grads(*params: torch.Tensor, use_entropy: bool = True) -> tuple[torch.Tensor, ...]:
        ref_lp, ref_ent = _truth(h, w, y, 0.7)
        return _grads(ref_lp, ref_ent, g_lp, g_ent if use_entropy else torch.zeros_like(g_ent), *params)

    lp, ent = fused_linear_logprobs(h.detach(), w, y, chunk_size=3, temperature=0.7)
    _assert_close(_grads(lp, ent, g_lp, g_ent, w)[0], truth_grads(w)[0], torch.float32, "grad weight")

    lp, ent = fused_linear_logprobs(h, w.detach(), y, chunk_size=3, temperature=0.7)
    _assert_close(_grads(lp, ent, g_lp, g_ent, h)[0], truth_grads(h)[0], torch.float32, "grad hidden")

    with torch.no_grad():
        lp, ent = fused_linear_logprobs(h, w, y, temperature=0.7)
    assert not lp.requires_grad and not ent.requires_grad
    _assert_close(lp, _truth(h, w, y, 0.7)[0], torch.float32, "no-grad logprobs")

    lp, _ = fused_linear_logprobs(h, w, y, chunk_size=3, temperature=0.7)
    grads = torch.autograd.grad((lp * g_lp).sum(), (h, w))
    for got, want, what in zip(
        grads, truth_grads(h, w, use_entropy=False), ("hidden", "weight"), strict=True
    ):
        _assert_close(got, want, torch.float32, f"logprob-only grad {what}")


def test_chunks_bound_the_logits(monkeypatch):
    """No more than ``chunk_size`` rows of logits exist at once, in forward and in backward."""
    seen: list[tuple[int, int]] = []
    stats, grad_ = flp._torch_row_stats, flp._torch_row_grad_
    monkeypatch.setattr(
        flp, "_torch_row_stats", lambda logits, *a: (seen.append(logits.shape), stats(logits, *a))
    )
    monkeypatch.setattr(
        flp, "_torch_row_grad_", lambda logits, *a: (seen.append(logits.shape), grad_(logits, *a))
    )
    h, w, y, g_lp, g_ent = _inputs(10, 37, 8, torch.float32)
    lp, ent = _fused_linear_logprobs(h, w, y, chunk_size=4, _backend="torch")
    _grads(lp, ent, g_lp, g_ent, h, w)
    assert seen == [(4, 37), (4, 37), (2, 37)] * 2


def test_default_chunk_rule():
    """Default chunk: DEFAULT_CHUNK_BYTES of logits in the input dtype, clamped to [1, tokens]."""
    w32 = torch.empty(32000, 1, dtype=torch.float32)
    assert flp._resolve_chunk_size(0, 10**6, w32) == flp.DEFAULT_CHUNK_BYTES // (32000 * 4)
    assert flp._resolve_chunk_size(0, 10**6, w32.bfloat16()) == flp.DEFAULT_CHUNK_BYTES // (32000 * 2)
    assert flp._resolve_chunk_size(0, 7, w32) == 7
    assert flp._resolve_chunk_size(0, 10, torch.empty(10**9, 0)) == 1
    assert flp._resolve_chunk_size(3, 10, w32) == 3


def test_torch_compile_aot_eager_matches_eager():
    h, w, y, g_lp, g_ent = _inputs(12, 37, 16, torch.float32)
    h3, y3 = h.detach().reshape(3, 4, 16).requires_grad_(), y.reshape(3, 4)

    def f(h, w, y):
        return fused_linear_logprobs(h, w, y, chunk_size=5, temperature=0.7)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    lp_c, ent_c = compiled(h3, w, y3)
    grads_c = _grads(lp_c, ent_c, g_lp.reshape(3, 4), g_ent.reshape(3, 4), h3, w)
    lp_e, ent_e = f(h3, w, y3)
    grads_e = _grads(lp_e, ent_e, g_lp.reshape(3, 4), g_ent.reshape(3, 4), h3, w)
    torch.testing.assert_close(lp_c, lp_e, rtol=0, atol=0)
    torch.testing.assert_close(ent_c, ent_e, rtol=0, atol=0)
    for got, want in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_opcheck():
    """torch.library's own consistency checks: fake tensor, schema, autograd registration, AOT dispatch."""
    h, w, y, _, _ = _inputs(6, 37, 8, torch.float32)
    torch.library.opcheck(torch.ops.lightning_llm.fused_linear_logprobs, (h, w, y, 4, 0.7, "torch", 0))


def test_autocast_does_not_change_precision():
    """Under autocast the op still computes in its inputs' dtype (fp32 here), as documented."""
    h, w, y, _, _ = _inputs(7, 37, 8, torch.float32)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        lp, ent = fused_linear_logprobs(h, w, y)
    ref_lp, ref_ent = _truth(h, w, y, 1.0)
    _assert_close(lp, ref_lp, torch.float32, "autocast logprobs")
    _assert_close(ent, ref_ent, torch.float32, "autocast entropy")


def test_empty_token_dim():
    h, w, y, _, _ = _inputs(0, 37, 8, torch.float32)
    lp, ent = fused_linear_logprobs(h.reshape(0, 3, 8), w, y.reshape(0, 3))
    assert lp.shape == ent.shape == (0, 3)
    grad_h, grad_w = torch.autograd.grad(lp.sum() + ent.sum(), (h, w))
    assert grad_h.shape == (0, 8) and not grad_w.any()


def _bad(**changes):
    """Keyword args for a valid call (tokens 4, vocab 37, hidden 8), with ``changes`` applied."""
    kwargs = {
        "hidden": torch.randn(4, 8),
        "lm_head_weight": torch.randn(37, 8),
        "targets": torch.randint(0, 37, (4,)),
    }
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (_bad(lm_head_weight=torch.randn(37, 9)), ValueError, "hidden size mismatch"),
        (_bad(lm_head_weight=torch.randn(37, 8, 1)), ValueError, r"shape \[V, H\]"),
        (_bad(targets=torch.zeros(5, dtype=torch.long)), ValueError, "leading shape"),
        (_bad(targets=torch.tensor([0, 1, 37, 2])), ValueError, r"in \[0, 37\)"),
        (_bad(targets=torch.tensor([0, -1, 3, 2])), ValueError, r"in \[0, 37\)"),
        (_bad(targets=torch.zeros(4)), TypeError, "integer token ids"),
        (_bad(targets=torch.zeros(4, dtype=torch.bool)), TypeError, "integer token ids"),
        (_bad(hidden=torch.randn(4, 8).double()), TypeError, "dtype must be one of"),
        (_bad(lm_head_weight=torch.randn(37, 8).half()), TypeError, "share a dtype"),
        (_bad(temperature=0.0), ValueError, "temperature"),
        (_bad(temperature=-1.0), ValueError, "temperature"),
        (_bad(temperature=float("nan")), ValueError, "temperature"),
        (_bad(chunk_size=0), ValueError, "chunk_size"),
        (_bad(with_dynamics=1), TypeError, "with_dynamics"),
    ],
)
def test_input_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        fused_linear_logprobs(**kwargs)


def test_int32_targets_accepted():
    kwargs = _bad()
    lp32, _ = fused_linear_logprobs(**{**kwargs, "targets": kwargs["targets"].int()})
    lp64, _ = fused_linear_logprobs(**kwargs)
    torch.testing.assert_close(lp32, lp64, rtol=0, atol=0)


def test_dispatch_on_cpu_and_env_override(monkeypatch):
    cpu = torch.zeros(1)
    assert not use_triton(cpu)
    assert flp._resolve_backend("auto", cpu) == "torch"
    assert flp._resolve_backend("torch", cpu) == "torch"
    if torch.cuda.is_available() and triton_available():
        cuda = cpu.cuda()
        assert use_triton(cuda)
        monkeypatch.setenv(DISABLE_TRITON_ENV, "1")
        assert not use_triton(cuda)
    monkeypatch.setenv(DISABLE_TRITON_ENV, "1")
    assert not use_triton(cpu)


def test_import_is_lazy_and_works_without_triton():
    """``import lightning_llm.kernels`` neither needs nor imports Triton; CPU calls run without it."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError, as on macOS
        import torch
        import lightning_llm.kernels as k
        from lightning_llm.kernels._dispatch import triton_available
        lp, ent = k.fused_linear_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 4, 2]))
        assert lp.shape == ent.shape == (3,)
        assert not triton_available()
        assert "lightning_llm.kernels._fused_linear_logprobs_triton" not in sys.modules
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


@pytest.mark.gpu
def test_cuda_auto_backend_uses_triton_and_saves_memory():
    """On CUDA the default path is the Triton one, and its peak memory stays far below the naive logits."""
    n_tokens, vocab, hidden = 2048, 32000, 256
    h, w, y, g_lp, g_ent = _inputs(n_tokens, vocab, hidden, torch.bfloat16)
    assert flp._resolve_backend("auto", h, w) == "triton"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = fused_linear_logprobs(h, w, y, chunk_size=256)
    _grads(lp, ent, g_lp, g_ent, h, w)
    peak = torch.cuda.max_memory_allocated() - base
    naive_logits_bytes = n_tokens * vocab * 2
    assert peak < naive_logits_bytes, (
        f"peak {peak / 2**20:.0f} MiB vs naive logits {naive_logits_bytes / 2**20:.0f}"
    )


# --------------------------------------------------------------------------------------------------
# Entropy dynamics (arXiv 2602.03392, docs/methods.md §3): S_k = p_k (H + log p_k), N = Σ p² (log p + H)
# --------------------------------------------------------------------------------------------------


def _entropy64(z: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(z, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def _random_logits64(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def test_entropy_dynamics_reference_finite_differences_of_s():
    """Raising logit k by ε changes H by −ε·S_k: central difference over every (row, k), float64."""
    z = _random_logits64(5, 11)
    s, n = entropy_dynamics_reference(z)
    assert s.shape == z.shape and n.shape == z.shape[:1] and s.dtype == n.dtype == torch.float64
    eps = 1e-6
    bump = eps * torch.eye(11, dtype=torch.float64)  # [k, V]: row k raises logit k
    dh = (_entropy64(z[:, None, :] + bump) - _entropy64(z[:, None, :] - bump)) / (2 * eps)  # [rows, k]
    # truncation ~ ε² · (third derivative of H) ~ 1e-12, rounding ~ 1e-16 / ε ~ 1e-10
    torch.testing.assert_close(dh, -s, rtol=0, atol=1e-8)
    torch.testing.assert_close(s.sum(-1), torch.zeros(5, dtype=torch.float64), rtol=0, atol=1e-14)
    p = torch.softmax(z, -1)
    torch.testing.assert_close(n, (p * s).sum(-1), rtol=0, atol=1e-14)


def test_entropy_dynamics_reference_policy_gradient_step():
    """One PG step z ← z + ηA(onehot(k) − p) changes H by −ηA(S_k − N) + O(η²): the ratio → 1 linearly in η."""
    rows, vocab = 6, 11
    z = _random_logits64(rows, vocab, seed=1)
    k = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(2))
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.3], dtype=torch.float64)
    s, n = entropy_dynamics_reference(z)
    s_k = s.gather(1, k[:, None]).squeeze(1)
    assert (s_k - n).abs().min() > 1e-3, "ill-conditioned ratio; pick another seed"
    p = torch.softmax(z, -1)
    step_dir = adv[:, None] * (torch.nn.functional.one_hot(k, vocab).double() - p)

    def rel_error(eta: float) -> torch.Tensor:
        measured = _entropy64(z + eta * step_dir) - _entropy64(z)
        predicted = -eta * adv * (s_k - n)
        return (measured / predicted - 1).abs()

    err_4, err_5 = rel_error(1e-4), rel_error(1e-5)
    assert err_4.max() < 1e-3, err_4
    # first-order prediction: the relative error (the O(η²) remainder over the O(η) change) shrinks ~10x
    # per 10x smaller η
    torch.testing.assert_close(err_4 / err_5, torch.full_like(err_4, 10.0), rtol=0.05, atol=0)


def test_entropy_dynamics_reference_dtypes_and_edge_cases():
    """fp32 compute for low-precision input; V = 1 and uniform rows have S = N = 0."""
    s, n = entropy_dynamics_reference(torch.randn(2, 3, 7, dtype=torch.bfloat16))
    assert s.dtype == n.dtype == torch.float32 and s.shape == (2, 3, 7) and n.shape == (2, 3)
    for z in (torch.randn(4, 1), torch.full((4, 9), 3.0)):
        s, n = entropy_dynamics_reference(z)
        assert not s.any() and not n.any()
    with pytest.raises(TypeError, match="floating point"):
        entropy_dynamics_reference(torch.zeros(3, dtype=torch.long))


def _dynamics_truth(
    h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (S_y, N) from the full logits through the (finite-difference-checked) reference."""
    s, n = entropy_dynamics_reference(h.detach().double() @ w.detach().double().T / temperature)
    return s.gather(-1, y[..., None]).squeeze(-1), n


# (tokens, vocab, hidden, chunk, block_v, logit_scale): V = 1; one masked block (37 in 64); 17 blocks with a
# 1-wide ragged tail (257 over 16); 8 blocks with a ragged tail (1000 over 128); nearly one-hot rows over
# 7 blocks (scale 30, fp32 only, see test_triton_multi_block_rows). block_v only affects the Triton path.
DYNAMICS_CASES = [
    ((1, 1, 8, 4, None, 2.0), torch.float32),
    ((7, 37, 24, 3, None, 2.0), torch.float32),
    ((7, 37, 24, 3, None, 2.0), torch.bfloat16),
    ((9, 257, 24, 4, 16, 2.0), torch.float32),
    ((9, 257, 24, 4, 16, 2.0), torch.bfloat16),
    ((9, 1000, 24, 4, 128, 2.0), torch.float32),
    ((9, 1000, 24, 4, 128, 2.0), torch.bfloat16),
    ((9, 100, 24, 4, 16, 30.0), torch.float32),
]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize(
    ("case", "dtype"), DYNAMICS_CASES, ids=lambda v: str(v).replace("torch.", "").replace(" ", "")
)
def test_dynamics_match_float64(case, dtype, backend):
    """``with_dynamics=True`` (S_y, N) vs float64 truth, two ways, with the file's TOLERANCE scheme.

    Every other target is the row's argmax (as sampled tokens often are): with uniformly random targets
    ``p_y`` and hence ``S_y`` are ~1e-2, too small for a ``max(|truth|, 1)``-scaled check to say much.

    1. Truth from float64 ``hidden``/``weight`` with ``TOLERANCE[dtype]``, as for logprobs and entropy.
       Observed: fp32 ≤ 3e-6; bf16 ≤ 1.1e-2, all of it from the bf16 logits chunk (both backends agree).
    2. Truth from the op's own rounded logits chunk, i.e. the row reduction alone: ``TOLERANCE[float32]``
       for every input dtype, since the reductions are fp32. Observed ≤ 3e-6.
    """
    n_tokens, vocab, hidden, chunk, block_v, logit_scale = case
    h, w, y, _, _ = _inputs(n_tokens, vocab, hidden, dtype, seed=vocab, logit_scale=logit_scale)
    with torch.no_grad():
        logits = torch.cat([h[i : i + chunk] @ w.T for i in range(0, n_tokens, chunk)])  # as the op does
    y[::2] = logits.argmax(-1)[::2]
    with torch.no_grad():
        lp, ent, s, n = _fused_linear_logprobs(
            h, w, y, chunk_size=chunk, temperature=0.7, with_dynamics=True, _backend=backend, _block_v=block_v
        )
    assert s.dtype == n.dtype == torch.float32 and s.shape == n.shape == (n_tokens,)
    ref_s, ref_n = _dynamics_truth(h, w, y, 0.7)
    ref_lp, ref_ent = _truth(h, w, y, 0.7)
    _assert_close(s, ref_s, dtype, "s_target")
    _assert_close(n, ref_n, dtype, "n")
    _assert_close(lp, ref_lp, dtype, "logprobs")
    _assert_close(ent, ref_ent, dtype, "entropy")
    chunk_s, chunk_n = entropy_dynamics_reference(logits.double() / 0.7)
    _assert_close(s, chunk_s.gather(1, y[:, None]).squeeze(1), torch.float32, "s_target (same logits)")
    _assert_close(n, chunk_n, torch.float32, "n (same logits)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_dynamics_leave_outputs_and_grads_unchanged(backend, dtype):
    """logprobs, entropy and both gradients are bitwise those of the default call; S and N are detached."""
    h, w, y, g_lp, g_ent = _inputs(10, 257, 16, dtype)
    h3, y3 = h.detach().reshape(2, 5, 16).requires_grad_(), y.reshape(2, 5)
    g_lp, g_ent = g_lp.reshape(2, 5), g_ent.reshape(2, 5)
    kwargs = {"chunk_size": 4, "temperature": 0.7, "_backend": backend, "_block_v": 64}
    lp, ent = _fused_linear_logprobs(h3, w, y3, **kwargs)
    lp_d, ent_d, s, n = _fused_linear_logprobs(h3, w, y3, with_dynamics=True, **kwargs)
    assert s.shape == n.shape == (2, 5) and not s.requires_grad and not n.requires_grad
    torch.testing.assert_close(lp_d, lp, rtol=0, atol=0)
    torch.testing.assert_close(ent_d, ent, rtol=0, atol=0)
    for got, want in zip(
        _grads(lp_d, ent_d, g_lp, g_ent, h3, w), _grads(lp, ent, g_lp, g_ent, h3, w), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dynamics_torch_compile_aot_eager_matches_eager():
    h, w, y, g_lp, g_ent = _inputs(12, 37, 16, torch.float32)
    h3, y3 = h.detach().reshape(3, 4, 16).requires_grad_(), y.reshape(3, 4)

    def f(h, w, y):
        lp, ent, s, n = fused_linear_logprobs(h, w, y, chunk_size=5, temperature=0.7, with_dynamics=True)
        return lp, ent, s - n  # the PG entropy-change coefficient, as a monitor would use it

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    lp_c, ent_c, x_c = compiled(h3, w, y3)
    lp_e, ent_e, x_e = f(h3, w, y3)
    assert not x_c.requires_grad
    for got, want in zip((lp_c, ent_c, x_c), (lp_e, ent_e, x_e), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    grads_c = _grads(lp_c, ent_c, g_lp.reshape(3, 4), g_ent.reshape(3, 4), h3, w)
    grads_e = _grads(lp_e, ent_e, g_lp.reshape(3, 4), g_ent.reshape(3, 4), h3, w)
    for got, want in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dynamics_opcheck():
    h, w, y, _, _ = _inputs(6, 37, 8, torch.float32)
    torch.library.opcheck(
        torch.ops.lightning_llm.fused_linear_logprobs_dynamics, (h, w, y, 4, 0.7, "torch", 0)
    )
