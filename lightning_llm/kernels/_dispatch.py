"""Choosing between a Triton kernel and its plain-PyTorch reference.

Every op in :mod:`lightning_llm.kernels` has a reference implementation in PyTorch that is the spec, and
optionally a Triton implementation that must match it. Triton only runs compiled kernels on CUDA tensors,
so it is used exactly when all tensors live on CUDA and Triton can be imported; everything else (CPU,
macOS without Triton, ``LIGHTNING_LLM_DISABLE_TRITON=1`` for debugging or A/B comparisons) takes the
reference path.
"""

from __future__ import annotations

import functools
import os

import torch

DISABLE_TRITON_ENV = "LIGHTNING_LLM_DISABLE_TRITON"


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` succeeds. Cached, and only called once a CUDA tensor shows up.

    Importing Triton costs a noticeable fraction of a second, so it is never done on CPU-only paths.
    """
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while initialising
        return False
    return True


def triton_disabled() -> bool:
    """Whether the user forced the reference path with ``LIGHTNING_LLM_DISABLE_TRITON=1``.

    Read at every call (not cached) so tests and notebooks can flip it at runtime.
    """
    return os.environ.get(DISABLE_TRITON_ENV, "0").strip().lower() not in ("", "0", "false", "no")


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernels should run for ``tensors``: all on CUDA, Triton importable, not disabled."""
    if triton_disabled():
        return False
    if not tensors or not all(t.is_cuda for t in tensors):
        return False
    return triton_available()
