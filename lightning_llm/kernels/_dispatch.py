"""Choosing between a Triton kernel and its plain-PyTorch reference.

Every op in :mod:`lightning_llm.kernels` has a reference implementation in PyTorch that is the spec, and
optionally a Triton implementation that must match it. Triton only runs compiled kernels on CUDA tensors,
so it is used exactly when all tensors live on CUDA and Triton can be imported (:func:`use_triton`);
everything else (CPU, macOS without Triton, ``LIGHTNING_LLM_DISABLE_TRITON=1`` for debugging or A/B
comparisons) takes the reference path.

Each op also declares what its kernel accepts (dtypes, size limits such as a LoRA rank or a head dim,
allowed values such as a trellis code) and passes that data to :func:`resolve_backend`, the one place that
turns an op's ``backend`` argument into ``"triton"`` or the reference. On CUDA, inputs the kernel does not
accept fall back to the reference, logged once per (op, reason) at debug level on the
``lightning_llm.kernels`` logger; forcing ``backend="triton"`` with such inputs raises instead.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Collection, Iterable

import torch

DISABLE_TRITON_ENV = "LIGHTNING_LLM_DISABLE_TRITON"

#: The dtypes the Triton kernels take unless an op says otherwise (fp64 runs the reference).
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

logger = logging.getLogger("lightning_llm.kernels")


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


def resolve_backend(
    op: str,
    backend: str,
    tensors: Iterable[torch.Tensor | None],
    *,
    dtype: torch.dtype,
    dtypes: Collection[torch.dtype] = TRITON_DTYPES,
    limits: Iterable[tuple[str, int, int]] = (),
    choices: Iterable[tuple[str, object, Collection[object]]] = (),
) -> str:
    """The backend ``op`` runs with: ``"triton"`` or ``backend`` itself (``"torch"`` or an op's own choice).

    Args:
        op: the op's name, for the log and error messages.
        backend: ``"auto"`` picks ``"triton"`` when :func:`use_triton` holds for ``tensors`` and the kernel
            accepts the inputs, else ``"torch"``; ``"triton"`` is checked (it raises where the kernel cannot
            run); any other value is returned unchanged.
        tensors: the op's tensor arguments (``None`` entries are skipped).
        dtype: the dtype the kernel would compute in, which must be one of ``dtypes``.
        limits: ``(what, value, limit)`` triples: the kernel takes ``value <= limit`` (``what`` is plural,
            e.g. ``"ranks"``).
        choices: ``(what, value, allowed)`` triples: the kernel takes ``value in allowed``.

    Raises:
        RuntimeError: ``backend="triton"`` and Triton cannot be imported.
        TypeError: ``backend="triton"`` and ``dtype`` is not one of ``dtypes``.
        ValueError: ``backend="triton"`` and a limit or choice is not met.
    """
    if backend == "auto":
        if not use_triton(*(t for t in tensors if t is not None)):
            return "torch"
        unsupported = _unsupported(dtype, dtypes, limits, choices)
        if unsupported is not None:
            _log_fallback(op, str(unsupported))
            return "torch"
        return "triton"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("_backend='triton' was requested but triton cannot be imported")
        unsupported = _unsupported(dtype, dtypes, limits, choices)
        if unsupported is not None:
            raise unsupported
    return backend


def _unsupported(
    dtype: torch.dtype,
    dtypes: Collection[torch.dtype],
    limits: Iterable[tuple[str, int, int]],
    choices: Iterable[tuple[str, object, Collection[object]]],
) -> Exception | None:
    """The error a forced Triton run raises for these inputs (its message is the fallback's reason), or None."""
    if dtype not in dtypes:
        return TypeError(f"the Triton kernel supports {tuple(dtypes)}, got {dtype}")
    for what, value, limit in limits:
        if value > limit:
            return ValueError(f"the Triton kernel supports {what} up to {limit}, got {value}")
    for what, value, allowed in choices:
        if value not in allowed:
            return ValueError(f"the Triton kernel supports {what} in {tuple(allowed)}, got {value!r}")
    return None


@functools.cache
def _log_fallback(op: str, reason: str) -> None:
    """Log a CUDA fallback to the reference; cached, so each (op, reason) is logged once per process."""
    logger.debug("%s runs its PyTorch reference on CUDA: %s", op, reason)
