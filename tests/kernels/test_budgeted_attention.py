"""Correctness of ``budgeted_attention`` (one decode step over a budgeted KV cache plus the memory readout).

The reference is compared with a naive per-(batch, head) formula in float64 (softmax attention over the
valid slots written with plain torch ops, plus the readout), with ``scaled_dot_product_attention`` when
nothing is evicted, and the Triton kernel (on CPU through ``TRITON_INTERPRET=1``, which
``tests/conftest.py`` sets when there is no CUDA) with both the truth and the reference. The interpreter is
slow, so the Triton cases are few and small, with the slot/feature block forced to 4 in most of them so that
several tiles with ragged edges are exercised (S = 17 gives five slot tiles, the last with one slot; D = 33
nine feature tiles). Lengths are ragged and always include a head with no valid slot and a full one.
"""

from __future__ import annotations

import importlib
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from lightning_llm.kernels import budgeted_attention
from lightning_llm.kernels._dispatch import triton_available
from lightning_llm.kernels.budgeted_attention import MEMORY_EPS, _budgeted_attention, phi

# The package re-exports the function, so `import ... as` could pick it up; take the module itself.
ba = importlib.import_module("lightning_llm.kernels.budgeted_attention")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Max |ours - expected| as a fraction of max(|expected|, 1) over the tensor (``_assert_close``).
# float64 (reference only): summation order alone.
# float32: fp32 accumulation over at most S = 40 slots and D = 64 features, the kernel's online softmax
# rescaling and a different exp; observed <= 3.8e-7.
# bfloat16 / float16, unit roundoff u = 2^-8 / 2^-11: every path computes in fp32 from the same 16-bit
# inputs (products exact), so the fp32 results agree to ~1e-6 and each path rounds once to the output dtype:
# <= u·|x| against the float64 truth, and kernel against reference at most one ulp apart (at a rounding
# boundary), <= 2u·|x|. 2u: 2^-7 (bf16), 2^-10 (fp16). Observed (bf16): <= 0.62u against the truth,
# kernel and reference identical.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """``max|actual - expected| <= tol * max(|expected|, 1)``, with a readable message."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, 1.0)
    assert err <= tol * scale, f"{what}: max error {err:.3e}, scale {scale:.3e}, tolerance {tol:.1e}"


def _inputs(batch, heads, kv_heads, capacity, head_dim, dtype, *, memory=False, gate=None, seed=0):
    """Keyword args of one call, in ``dtype`` (memory and gate stay fp32 for 16-bit ``dtype``).

    Lengths are ragged: the first (batch, kv head) has none valid, the last is full, the rest are random.
    The memory is built as the paper's running state would be, from 11 "evicted" keys and values
    (``S_mem = Σ φ(k)ᵀ v``, ``z = Σ φ(k)``), so its readout is a weighted average of values, of order one.
    ``gate`` is None, ``"batch"`` for a ``(B, H)`` gate or ``"heads"`` for ``(H,)``.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, capacity + 1, (batch, kv_heads), generator=gen)
    lengths.view(-1)[0] = 0
    lengths.view(-1)[-1] = capacity
    kwargs = {
        "q": torch.randn(batch, heads, head_dim, generator=gen),
        "k": torch.randn(batch, kv_heads, capacity, head_dim, generator=gen),
        "v": torch.randn(batch, kv_heads, capacity, head_dim, generator=gen),
        "lengths": lengths,
    }
    if memory:
        evicted_k = torch.randn(batch, heads, 11, head_dim, generator=gen)
        evicted_v = torch.randn(batch, heads, 11, head_dim, generator=gen)
        kwargs["memory_state"] = phi(evicted_k).transpose(-1, -2) @ evicted_v
        kwargs["memory_norm"] = phi(evicted_k).sum(-2)
    if gate is not None:
        shape = (batch, heads) if gate == "batch" else (heads,)
        kwargs["gate"] = torch.rand(shape, generator=gen)
    mem_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    for name, t in kwargs.items():
        t = t.to(DEVICE)
        kwargs[name] = t.to(dtype if name in ("q", "k", "v") else mem_dtype) if t.is_floating_point() else t
    return kwargs


def _naive(
    q, k, v, lengths, *, scale=None, memory_state=None, memory_norm=None, gate=None, memory_mode="residual"
):
    """The definition, one (batch, query head) at a time, in float64: softmax over the valid slots only.

    ``"softmax"`` mode is written as the definition, a softmax over the kept logits plus one slot of logit
    ``log m`` whose value is the readout (no sigmoid rewriting).
    """
    n_batch, n_heads, head_dim = q.shape
    group = n_heads // k.shape[1]
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(n_batch, n_heads, head_dim, dtype=torch.float64)
    for b in range(n_batch):
        for h in range(n_heads):
            qh = q[b, h].double().cpu()
            n = int(lengths[b, h // group])
            keys, values = k[b, h // group, :n].double().cpu(), v[b, h // group, :n].double().cpu()
            g = 1.0 if gate is None else (gate[h] if gate.dim() == 1 else gate[b, h]).double().cpu()
            readout = None
            if memory_state is not None:
                fq = F.elu(qh) + 1
                readout = fq @ memory_state[b, h].double().cpu()
                readout = readout / (fq @ memory_norm[b, h].double().cpu() + MEMORY_EPS)
            if memory_mode == "softmax" and readout is not None:
                mass = g * (fq @ memory_norm[b, h].double().cpu())
                if mass > 0:
                    logits = torch.cat([keys @ qh * scale, mass.log().reshape(1)])
                    values = torch.cat([values, readout[None]])
                    out[b, h] = torch.softmax(logits, dim=0) @ values
                elif n > 0:
                    out[b, h] = torch.softmax(keys @ qh * scale, dim=0) @ values
                continue
            if n > 0:
                weights = torch.softmax(keys @ qh * scale, dim=0)
                out[b, h] = weights @ values
            if readout is not None:
                out[b, h] += readout * g
    return out


def _check(kwargs, backend, block=None):
    """Run ``backend``; compare with the float64 naive formula on the same inputs; return the output."""
    dtype = kwargs["q"].dtype
    out = _budgeted_attention(**kwargs, _backend=backend, _block=block)
    if kwargs.get("memory_mode") == "softmax" and kwargs.get("memory_state") is not None:
        # the slot must matter in these cases, or the comparison would not test it
        no_memory = {**kwargs, "gate": None, "memory_state": None, "memory_norm": None}
        assert (out.double() - _budgeted_attention(**no_memory).double()).abs().max() > 1e-2
    assert out.dtype == dtype and out.shape == kwargs["q"].shape
    _assert_close(out.cpu(), _naive(**kwargs), TOLERANCE[dtype], f"{backend} vs truth ({dtype})")
    return out


# (B, H, Hkv, S, D, memory, gate)
REFERENCE_CASES = [
    (2, 4, 2, 1, 5, False, None),
    (3, 4, 2, 7, 16, True, None),
    (2, 3, 3, 17, 33, True, "batch"),
    (2, 4, 1, 40, 64, True, "heads"),
    (1, 6, 2, 0, 8, True, "heads"),  # an empty cache (S = 0): only the readout
]


def _case_id(c):
    return "B{}-H{}-Hkv{}-S{}-D{}-mem{:d}-gate{}".format(*c)


@pytest.mark.parametrize("memory_mode", ["residual", "softmax"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=_case_id)
def test_reference_matches_naive_formula(case, dtype, memory_mode):
    batch, heads, kv_heads, capacity, head_dim, memory, gate = case
    kwargs = _inputs(batch, heads, kv_heads, capacity, head_dim, dtype, memory=memory, gate=gate)
    _check({**kwargs, "memory_mode": memory_mode}, "torch")


# (B, H, Hkv, S, D, memory, gate, block): every D in {5, 16, 33, 64} and S in {1, 7, 17, 40} appears, with
# GQA (H = 4, Hkv = 2) and H = Hkv, with and without memory and gate, forced and default blocks.
TRITON_CASES = [
    (2, 4, 2, 1, 5, False, None, 4),
    (2, 4, 2, 7, 33, True, "batch", 4),
    (2, 2, 2, 17, 16, True, None, 4),
    (1, 4, 2, 40, 64, True, "heads", 8),
    (2, 3, 3, 17, 5, False, None, None),
    (1, 4, 2, 40, 33, True, "batch", None),
    (2, 4, 4, 7, 64, False, None, 16),
    (1, 4, 2, 1, 16, True, "heads", None),
    (1, 6, 2, 0, 8, True, "heads", None),  # an empty cache (S = 0): only the readout
]


# The softmax-slot epilogue (memory_mode="softmax"): GQA and not, several slot tiles, a (B, H) and an (H,) gate
# and none, an empty cache and heads with no valid slot (weight 1), a zero-mass gate entry (weight 0).
SLOT_CASES = [
    (2, 4, 2, 17, 33, True, "batch", 4),
    (1, 4, 2, 40, 16, True, None, None),
    (1, 6, 2, 0, 8, True, "heads", None),
]


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("case", "memory_mode"),
    [(c, "residual") for c in TRITON_CASES] + [(c, "softmax") for c in SLOT_CASES],
    ids=lambda x: x if isinstance(x, str) else f"{_case_id(x[:7])}-blk{x[7]}",
)
def test_triton_matches_truth_and_reference(case, memory_mode, dtype):
    batch, heads, kv_heads, capacity, head_dim, memory, gate, block = case
    seed = 1 if memory_mode == "residual" else 2
    kwargs = _inputs(batch, heads, kv_heads, capacity, head_dim, dtype, memory=memory, gate=gate, seed=seed)
    kwargs["memory_mode"] = memory_mode
    if memory_mode == "softmax" and gate is not None:
        kwargs["gate"] = kwargs["gate"] * 3.0  # a mass factor, not limited to [0, 1]
        kwargs["gate"].view(-1)[0] = 0.0  # an empty slot
    got = _check(kwargs, "triton", block)
    want = _budgeted_attention(**kwargs, _backend="torch")
    _assert_close(got, want, TOLERANCE[dtype], f"triton vs reference ({dtype}, {memory_mode})")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_softmax_slot_limits(backend):
    """Mass 0 gives exactly the cache's attention; a huge mass the readout; no valid slot the readout."""
    kwargs = _inputs(2, 4, 2, 7, 16, torch.float32, memory=True, gate="batch")
    kwargs["lengths"] = kwargs["lengths"].clamp_min(1)
    slot = {**kwargs, "memory_mode": "softmax"}
    plain = {k: kwargs[k] for k in ("q", "k", "v", "lengths")}
    want = _budgeted_attention(**plain, _backend=backend, _block=4)
    zero = {**slot, "gate": torch.zeros_like(kwargs["gate"])}
    torch.testing.assert_close(_budgeted_attention(**zero, _backend=backend, _block=4), want, rtol=0, atol=0)
    residual = {**kwargs, "gate": None, "lengths": torch.zeros_like(kwargs["lengths"])}
    readout = _budgeted_attention(**residual, _backend="torch")
    huge = {**slot, "gate": torch.full_like(kwargs["gate"], 1e30)}
    _assert_close(_budgeted_attention(**huge, _backend=backend, _block=4), readout, 1e-5, "huge mass")
    empty = {**slot, "lengths": torch.zeros_like(kwargs["lengths"])}
    _assert_close(_budgeted_attention(**empty, _backend=backend, _block=4), readout, 1e-5, "no slot")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_no_memory_or_zero_gate_is_exactly_plain_attention(backend):
    """The readout is exactly zero without memory or with gate 0 (docs/methods.md §11: zero when nothing is evicted)."""
    kwargs = _inputs(2, 4, 2, 7, 16, torch.float32, memory=True, gate="batch")
    plain = {k: kwargs[k] for k in ("q", "k", "v", "lengths")}
    want = _budgeted_attention(**plain, _backend=backend, _block=4)
    gated_off = {**kwargs, "gate": torch.zeros_like(kwargs["gate"])}
    torch.testing.assert_close(
        _budgeted_attention(**gated_off, _backend=backend, _block=4), want, rtol=0, atol=0
    )
    # lengths == 0 everywhere: exactly zero attention (not NaN), so only the readout, or zeros without memory.
    empty = {**kwargs, "lengths": torch.zeros_like(kwargs["lengths"])}
    assert not _budgeted_attention(**{**empty, "memory_state": None, "memory_norm": None, "gate": None}).any()
    only_memory = _budgeted_attention(**empty, _backend=backend, _block=4)
    fq = phi(kwargs["q"])
    readout = torch.einsum("bhf,bhfd->bhd", fq, kwargs["memory_state"])
    readout = (
        readout
        / ((fq * kwargs["memory_norm"]).sum(-1, keepdim=True) + MEMORY_EPS)
        * kwargs["gate"][..., None]
    )
    _assert_close(only_memory, readout, TOLERANCE[torch.float32], "memory only")


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_reference_equals_sdpa_when_nothing_is_evicted(kv_heads):
    """Full budget, no memory: the reference is HF-style full attention (SDPA on the same keys, GQA repeated)."""
    kwargs = _inputs(2, 4, kv_heads, 9, 16, torch.float32)
    kwargs["lengths"] = torch.full_like(kwargs["lengths"], 9)
    q, k, v = kwargs["q"], kwargs["k"], kwargs["v"]
    group = q.shape[1] // kv_heads
    k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    for scale in (None, 0.3):
        got = budgeted_attention(**kwargs, scale=scale)
        want = F.scaled_dot_product_attention(q[:, :, None], k_rep, v_rep, scale=scale)[:, :, 0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_strided_inputs_and_empty_batch(backend):
    """Views (a slice of a larger cache, permuted queries, an expanded gate) give the contiguous result."""
    kwargs = _inputs(2, 4, 2, 7, 5, torch.float32, memory=True, gate="heads")
    want = _budgeted_attention(**kwargs, _backend="torch")
    big = torch.randn(2, 2, 12, 5, device=DEVICE)
    big[:, :, 3:10] = kwargs["k"]
    strided = {
        **kwargs,
        "q": kwargs["q"].transpose(0, 1).contiguous().transpose(0, 1),
        "k": big[:, :, 3:10],
        "memory_state": kwargs["memory_state"].transpose(-1, -2).contiguous().transpose(-1, -2),
        "lengths": kwargs["lengths"].t().contiguous().t().int(),
    }
    _assert_close(_budgeted_attention(**strided, _backend=backend, _block=4), want, 1e-5, "strided")
    q0, k0 = torch.zeros(0, 4, 5, device=DEVICE), torch.zeros(0, 2, 7, 5, device=DEVICE)
    lengths0 = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    assert _budgeted_attention(q0, k0, k0, lengths0, _backend=backend).shape == (0, 4, 5)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_out_of_range_lengths(backend):
    """The reference rejects lengths outside [0, S]; the kernel clamps them (no host sync to check)."""
    kwargs = _inputs(1, 2, 2, 7, 5, torch.float32)
    bad = {**kwargs, "lengths": torch.tensor([[8, -1]], device=DEVICE)}
    if backend == "torch":
        with pytest.raises(
            ValueError, match=r"lengths must lie in \[0, S\] = \[0, 7\], got values in \[-1, 8\]"
        ):
            _budgeted_attention(**bad, _backend=backend)
    else:
        clamped = {**kwargs, "lengths": torch.tensor([[7, 0]], device=DEVICE)}
        torch.testing.assert_close(
            _budgeted_attention(**bad, _backend=backend),
            _budgeted_attention(**clamped, _backend="torch"),
            rtol=1e-5,
            atol=1e-6,
        )


def test_inference_only():
    """No autograd formula: backward through the op raises instead of returning wrong gradients."""
    kwargs = _inputs(1, 2, 1, 3, 4, torch.float32)
    kwargs["q"].requires_grad_()
    with pytest.raises(RuntimeError, match="no autograd formula"):
        budgeted_attention(**kwargs).sum().backward()


def test_opcheck():
    """torch.library's own consistency checks: fake tensor, schema, AOT dispatch."""
    kwargs = _inputs(2, 4, 2, 5, 8, torch.float32, memory=True, gate="heads")
    args = tuple(kwargs.values())
    for mode in ("residual", "softmax"):
        torch.library.opcheck(torch.ops.lightning_llm.budgeted_attention, (*args, 0.4, mode, "torch", 0))
    torch.library.opcheck(
        torch.ops.lightning_llm.budgeted_attention,
        (*args[:4], None, None, None, 0.4, "residual", "torch", 0),
    )


def test_torch_compile_aot_eager_matches_eager():
    kwargs = _inputs(2, 4, 2, 7, 8, torch.float32, memory=True, gate="batch")

    def f(q, k, v, lengths, memory_state, memory_norm, gate):
        return budgeted_attention(
            q, k, v, lengths, memory_state=memory_state, memory_norm=memory_norm, gate=gate
        )

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(**kwargs), f(**kwargs), rtol=0, atol=0)


def _bad(**changes: object) -> dict[str, object]:
    """Keyword args for a valid call (B 2, H 4, Hkv 2, S 3, D 5, memory and gate), with ``changes`` applied."""
    kwargs: dict[str, object] = {
        "q": torch.randn(2, 4, 5),
        "k": torch.randn(2, 2, 3, 5),
        "v": torch.randn(2, 2, 3, 5),
        "lengths": torch.ones(2, 2, dtype=torch.int64),
        "memory_state": torch.zeros(2, 4, 5, 5),
        "memory_norm": torch.ones(2, 4, 5),
        "gate": torch.ones(4),
    }
    kwargs.update(changes)
    return kwargs


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (_bad(q=torch.randn(2, 4)), ValueError, r"q must have shape \(B, H, D\), got \(2, 4\)"),
        (_bad(k=torch.randn(2, 2, 5)), ValueError, r"k must have shape \(B, Hkv, S, D\)"),
        (_bad(k=torch.randn(2, 2, 3, 6)), ValueError, r"q is \(2, 4, 5\) but k is \(2, 2, 3, 6\)"),
        (_bad(k=torch.randn(3, 2, 3, 5)), ValueError, r"expected \(2, Hkv, S, 5\)"),
        (_bad(k=torch.randn(2, 3, 3, 5)), ValueError, "H = 4 .* multiple of kv heads Hkv = 3"),
        (_bad(v=torch.randn(2, 2, 4, 5)), ValueError, r"k is \(2, 2, 3, 5\) but v is \(2, 2, 4, 5\)"),
        (_bad(lengths=torch.ones(2, 4)), ValueError, r"lengths must have shape \(B, Hkv\) = \(2, 2\)"),
        (_bad(memory_norm=None), ValueError, "given together"),
        (_bad(memory_state=torch.zeros(2, 4, 6, 5)), ValueError, "F must equal D"),
        (
            _bad(memory_state=torch.zeros(2, 3, 5, 5)),
            ValueError,
            r"memory_state must have shape \(B, H, F, D\)",
        ),
        (_bad(memory_norm=torch.ones(2, 4, 4)), ValueError, r"memory_norm must have shape \(B, H, F\)"),
        (_bad(gate=torch.ones(2, 3)), ValueError, r"gate must have shape \(B, H\) = \(2, 4\) or \(H,\)"),
        (_bad(memory_state=None, memory_norm=None), ValueError, "gate .* needs memory_state"),
        (_bad(k=torch.randn(2, 2, 3, 5).half()), TypeError, "share a dtype"),
        (_bad(q=torch.zeros(2, 4, 5, dtype=torch.int64)), TypeError, "dtype must be one of"),
        (_bad(lengths=torch.ones(2, 2)), TypeError, "lengths must be an integer tensor"),
        (_bad(gate=torch.ones(4, dtype=torch.int64)), TypeError, "gate must be floating point"),
        (_bad(scale=float("nan")), ValueError, "scale"),
        (_bad(memory_mode="slot"), ValueError, "memory_mode must be one of"),
    ],
)
def test_input_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        budgeted_attention(**kwargs)


def test_dispatch_and_private_hooks(monkeypatch):
    """CPU takes the reference without loading the Triton module; forcing Triton where it cannot run fails."""
    import lightning_llm.kernels as kernels

    q, k = torch.zeros(1, 2, 4), torch.zeros(1, 1, 3, 4)
    assert ba._resolve_backend("auto", q, k) == "torch"
    if triton_available():
        with pytest.raises(TypeError, match="Triton kernel supports"):
            ba._resolve_backend("triton", q.double(), k.double())
        with pytest.raises(ValueError, match="head dims up to"):
            ba._resolve_backend("triton", torch.zeros(1, 2, 257), torch.zeros(1, 1, 3, 257))
    with pytest.raises(ValueError, match="_block"):
        _budgeted_attention(**_bad(), _block=3)
    with pytest.raises(ValueError, match="_backend"):
        _budgeted_attention(**_bad(), _backend="cuda")
    if torch.cuda.is_available() and triton_available():
        assert ba._resolve_backend("auto", q.cuda(), k.cuda()) == "triton"
        assert ba._resolve_backend("auto", q.cuda().double(), k.cuda().double()) == "torch"
    # The CPU path never imports the kernel module, so it runs where Triton is missing. (That
    # `import lightning_llm.kernels` imports no Triton is checked in a clean interpreter by test_lora_linear.)
    monkeypatch.delattr(kernels, "_budgeted_attention_triton", raising=False)
    monkeypatch.setitem(sys.modules, "lightning_llm.kernels._budgeted_attention_triton", None)
    assert budgeted_attention(**_bad()).shape == (2, 4, 5)


@pytest.mark.gpu
def test_cuda_triton_path_matches_reference():
    """On CUDA ``auto`` runs the compiled kernel; it matches the reference at decode-like sizes (bf16, fp32)."""
    for dtype in (torch.bfloat16, torch.float32):
        for head_dim, kv_heads in ((128, 8), (256, 2), (80, 32)):
            kwargs = _inputs(4, 32, kv_heads, 1000, head_dim, dtype, memory=True, gate="batch", seed=2)
            assert ba._resolve_backend("auto", *kwargs.values()) == "triton"
            got = _budgeted_attention(**kwargs)
            want = _budgeted_attention(**kwargs, _backend="torch")
            _assert_close(got, want, TOLERANCE[dtype], f"cuda D={head_dim} ({dtype})")
