"""Validation and dtype helpers shared by the ops of :mod:`lightning_llm.kernels`.

The checks here are static (shapes, dtypes, devices, test hooks): the ops run them before their custom op,
so they also run under ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

#: Dtypes the reference paths take (fp64 runs the reference only, see :mod:`._dispatch`).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

#: Values of the ops' ``_backend`` test hook.
BACKENDS = ("auto", "triton", "torch")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def autocast_inputs(device_type: str, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """``tensors`` as autocast casts ``nn.Linear``'s inputs when it is on for ``device_type``.

    Floating tensors other than fp64 go to the autocast dtype; with autocast off, ``tensors`` unchanged.
    """
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


def check_dtypes(
    first: str,
    tensors: Mapping[str, Tensor | None],
    *,
    supported: tuple[torch.dtype, ...] = SUPPORTED_DTYPES,
    hint: str = "",
) -> None:
    """TypeError unless ``tensors[first]`` has a ``supported`` dtype that every other tensor shares.

    ``hint`` is appended to the mismatch message (e.g. ``"; cast one of them"``).
    """
    dtype = tensors[first].dtype
    if dtype not in supported:
        raise TypeError(f"{first} dtype must be one of {supported}, got {dtype}")
    for name, t in tensors.items():
        if t is not None and t.dtype != dtype:
            raise TypeError(f"{first} ({dtype}) and {name} ({t.dtype}) must share a dtype{hint}")


def check_same_device(tensors: Iterable[Tensor | None]) -> None:
    """ValueError unless all the tensors (``None`` skipped) are on one device."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def check_hooks(backend: str, block: int | None, min_block: int) -> None:
    """ValueError unless the ``_backend`` hook is one of :data:`BACKENDS` and the ``_block`` hook is None or a
    power of two ``>= min_block``."""
    if backend not in BACKENDS:
        raise ValueError(f"_backend must be one of {BACKENDS}, got {backend!r}")
    if block is not None and (block < min_block or block & (block - 1)):
        raise ValueError(f"_block must be a power of two >= {min_block}, got {block!r}")
