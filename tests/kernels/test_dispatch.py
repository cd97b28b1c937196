"""The one dispatch decision of the kernels: ``resolve_backend``, its once-per-reason fallback log, and its errors.

A CUDA machine is simulated by making ``use_triton`` (and, where needed, ``triton_available``) answer True, so
the decision runs here on CPU tensors; the kernels themselves are not called.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from lightning_llm.kernels import _dispatch
from lightning_llm.kernels._dispatch import resolve_backend

# The package re-exports the op functions under the modules' names; take the modules themselves.
ll = importlib.import_module("lightning_llm.kernels.lora_linear")


@pytest.fixture
def cuda_like(monkeypatch):
    """``use_triton`` holds for every tensor and Triton counts as importable; the fallback log starts empty."""
    monkeypatch.setattr(_dispatch, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(_dispatch, "triton_available", lambda: True)
    _dispatch._log_fallback.cache_clear()
    yield
    _dispatch._log_fallback.cache_clear()


def _fallbacks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lightning_llm.kernels"]


def test_cpu_takes_the_reference_without_logging(caplog):
    x = torch.zeros(2, 3)
    with caplog.at_level(logging.DEBUG, logger="lightning_llm.kernels"):
        assert resolve_backend("op", "auto", (x, None), dtype=torch.float64) == "torch"
    assert resolve_backend("op", "torch", (x,), dtype=x.dtype) == "torch"
    assert resolve_backend("op", "compiled", (x,), dtype=x.dtype) == "compiled"
    assert _fallbacks(caplog) == []


def test_cuda_fallback_is_logged_once_per_op_and_reason(cuda_like, caplog):
    x = torch.zeros(2, 3)
    with caplog.at_level(logging.DEBUG, logger="lightning_llm.kernels"):
        assert resolve_backend("op", "auto", (x,), dtype=torch.float32) == "triton"
        for _ in range(3):
            assert resolve_backend("op", "auto", (x.double(),), dtype=torch.float64) == "torch"
        assert resolve_backend("other_op", "auto", (x.double(),), dtype=torch.float64) == "torch"
        for _ in range(2):
            limits = (("ranks", 300, 256),)
            assert resolve_backend("op", "auto", (x,), dtype=torch.float32, limits=limits) == "torch"
        choices = (("codes", "qtip-3inst", ("qtip-1mad", "proteus")),)
        assert resolve_backend("op", "auto", (x,), dtype=torch.float32, choices=choices) == "torch"
    messages = _fallbacks(caplog)
    assert len(messages) == 4, messages
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "lightning_llm.kernels")
    assert messages[0].startswith("op runs its PyTorch reference on CUDA") and "torch.float64" in messages[0]
    assert messages[1].startswith("other_op") and "torch.float64" in messages[1]
    assert "ranks up to 256, got 300" in messages[2]
    assert "codes in ('qtip-1mad', 'proteus'), got 'qtip-3inst'" in messages[3]


def test_an_op_passes_its_own_limits(cuda_like, caplog):
    """LoRA's rank limit reaches the decision: a rank above ``MAX_TRITON_RANK`` falls back, with the reason."""
    x, weight = torch.randn(4, 8), torch.randn(6, 8)
    rank = ll.MAX_TRITON_RANK + 1
    with caplog.at_level(logging.DEBUG, logger="lightning_llm.kernels"):
        assert (
            ll._resolve_backend("auto", x, weight, torch.randn(2, 8), torch.randn(6, 2), None, None)
            == "triton"
        )
        big = ll._resolve_backend("auto", x, weight, torch.randn(rank, 8), torch.randn(6, rank), None, None)
    assert big == "torch"
    assert _fallbacks(caplog) == [
        f"lora_linear runs its PyTorch reference on CUDA: the Triton kernel supports ranks up to "
        f"{ll.MAX_TRITON_RANK}, got {rank}"
    ]


def test_forcing_triton_where_it_cannot_run_raises(cuda_like, monkeypatch):
    x = torch.zeros(2, 3)
    with pytest.raises(TypeError, match=r"Triton kernel supports .*float32.*, got torch.float64"):
        resolve_backend("op", "triton", (x,), dtype=torch.float64)
    with pytest.raises(ValueError, match="head dims up to 256, got 257"):
        resolve_backend("op", "triton", (x,), dtype=torch.float32, limits=(("head dims", 257, 256),))
    with pytest.raises(ValueError, match=r"V in \(1, 2\), got 4"):
        resolve_backend("op", "triton", (x,), dtype=torch.float32, choices=(("V", 4, (1, 2)),))
    assert resolve_backend("op", "triton", (x,), dtype=torch.float32) == "triton"
    monkeypatch.setattr(_dispatch, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="triton cannot be imported"):
        resolve_backend("op", "triton", (x,), dtype=torch.float32)
