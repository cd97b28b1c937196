r"""Decode primitives of bitshift-trellis quantisation: bit stream → trellis states → code values.

:func:`~lightning_llm.kernels.trellis_matmul` decodes with these (its torch reference and its compiled decode),
and :mod:`lightning_llm.quantization` encodes into the same format (its Viterbi, packing and code classes use the
same functions), so the two sides share one definition of every bit and every integer instruction.

Bit stream. A tile of ``N`` trellis steps stores one ``kV``-bit chunk ``b_t`` per step, written MSB first into a
bit string of ``N·kV`` bits, 8 bits per uint8 (zero-padded to a whole byte only if ``N·kV`` is not a multiple of
8): :func:`pack_chunks` / :func:`unpack_chunks`.

States. The trellis state of step ``t`` is the last ``L / kV`` chunks, ``s_t = Σ_{j < L/kV} b_{t−j} << (j·kV)``,
with the history before ``b_0`` taken cyclically from the end of the tile (tail-biting): equivalently, the
``L``-bit big-endian window of the cyclic bit stream that ends with chunk ``t`` (:func:`trellis_states`).

Codes. A computed ("lookup-free") code maps a state to ``V`` values with a few integer instructions on int64
tensors holding unsigned 32-bit values (exact and deterministic); value ``j`` comes from the ``(j+1)``-th iterate
of the code's integer step. With ``byte_i(x)`` the bytes of ``x``::

    1MAD     step  x ← (a·x + b) mod 2^32            value  (Σ_i byte_i(x) − 510) / 147.8
    MUL-BAL  step  x ← (m·x) mod 2^32, x ^= x >> r   value  α · (byte_0 − byte_1 + byte_2 − byte_3)(x) / 147.8 + β
    3INST    step  as 1MAD (an LCG)                  value  (fp16(y[31:16]) + fp16(y[15:0])) / 1.2444,
                                                            y = (x AND 0x8FFF8FFF) XOR 0x3B603B60

The code classes of :mod:`lightning_llm.quantization.codes` document where the constants come from.
:data:`CODE_IDS` numbers the codes as :func:`~lightning_llm.kernels.trellis_matmul`'s op schema does (``"rtn"``,
the round-to-nearest baseline, stores plain level indices: :func:`rtn_levels`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "CODE_IDS",
    "THREEINST_MASK",
    "THREEINST_STD",
    "THREEINST_XOR",
    "code_values",
    "mulbal_step",
    "mulbal_value",
    "onemad_step",
    "onemad_value",
    "pack_chunks",
    "rtn_levels",
    "threeinst_value",
    "trellis_states",
    "unpack_chunks",
    "window_states",
]

#: Integer ids of the codes (the trellis matmul op's schema).
CODE_IDS = {"qtip-1mad": 0, "proteus": 1, "qtip-3inst": 2, "rtn": 3}

#: 3INST's default mask, xor and normalising standard deviation (see :mod:`lightning_llm.quantization.codes`).
THREEINST_MASK, THREEINST_XOR, THREEINST_STD = 0x8FFF8FFF, 0x3B603B60, 1.2444

_M32 = (1 << 32) - 1
_BYTE_STD = 147.8  # sqrt(4 · (256² − 1) / 12)


def _bytes(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return x & 255, (x >> 8) & 255, (x >> 16) & 255, (x >> 24) & 255


# The constants are arguments (ints, or 0-d tensors so that ``torch.compile`` sees them as data).
def onemad_step(x: Tensor, a, b) -> Tensor:
    """1MAD (and 3INST) state update ``(a·x + b) mod 2^32`` (``a``, ``b`` ints or 0-d int64 tensors)."""
    return (a * x + b) & _M32


def onemad_value(x: Tensor) -> Tensor:
    """1MAD value: the centred byte sum ``(Σ bytes − 510) / 147.8`` (float32)."""
    b0, b1, b2, b3 = _bytes(x)
    return (b0 + b1 + b2 + b3 - 510).float() / _BYTE_STD


def mulbal_step(x: Tensor, multiplier, shift) -> Tensor:
    """MUL-BAL state update: ``x ← (multiplier·x) mod 2^32``, then ``x ^ (x >> shift)``."""
    x = (multiplier * x) & _M32
    return x ^ (x >> shift)


def mulbal_value(x: Tensor, alpha, beta) -> Tensor:
    """MUL-BAL value: ``α·g + β`` with ``g`` the balanced byte sum ``(b0 − b1 + b2 − b3) / 147.8``."""
    b0, b1, b2, b3 = _bytes(x)
    return alpha * ((b0 - b1 + b2 - b3).float() / _BYTE_STD) + beta


def _fp16_bits(h: Tensor) -> Tensor:
    """Reinterpret 16-bit unsigned values (in an int64 tensor) as fp16, returned as float32."""
    h = torch.where(h >= 32768, h - 65536, h)
    return h.to(torch.int16).view(torch.float16).float()


def threeinst_value(
    x: Tensor, mask: int = THREEINST_MASK, xor: int = THREEINST_XOR, std: float = THREEINST_STD
) -> Tensor:
    """3INST value: ``y = (x AND mask) XOR xor``, the sum of its two halves read as fp16, divided by ``std``."""
    y = (x & mask) ^ xor
    return (_fp16_bits(y >> 16) + _fp16_bits(y & 0xFFFF)) / std


def code_values(states: Tensor, code_id: int, c0, c1, alpha, beta, V: int) -> Tensor:
    """``[..., V]`` float32 values of int64 ``states`` under the computed code ``code_id`` (1MAD, MUL-BAL, 3INST).

    ``(c0, c1)`` are the integer step's constants (1MAD / 3INST: ``a, b``; MUL-BAL: multiplier, shift) and
    ``(alpha, beta)`` MUL-BAL's affine; 3INST uses its default mask, xor and std.
    """
    x, values = states, []
    for _ in range(V):
        if code_id == CODE_IDS["proteus"]:
            x = mulbal_step(x, c0, c1)
            values.append(mulbal_value(x, alpha, beta))
        else:
            x = onemad_step(x, c0, c1)
            values.append(onemad_value(x) if code_id == CODE_IDS["qtip-1mad"] else threeinst_value(x))
    return torch.stack(values, dim=-1)


def pack_chunks(chunks: Tensor, width: int) -> Tensor:
    """``[T, N]`` integers of ``width`` bits → ``[T, ceil(N·width/8)]`` uint8, MSB first."""
    T, N = chunks.shape
    shifts = torch.arange(width - 1, -1, -1, device=chunks.device)
    bits = ((chunks.to(torch.int64).unsqueeze(-1) >> shifts) & 1).reshape(T, N * width)
    pad = (-bits.shape[1]) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(T, pad)], dim=1)
    weights = 1 << torch.arange(7, -1, -1, device=chunks.device)
    return (bits.view(T, -1, 8) * weights).sum(-1).to(torch.uint8)


def unpack_chunks(packed: Tensor, N: int, width: int) -> Tensor:
    """Inverse of :func:`pack_chunks`: ``[T, N]`` int64."""
    T = packed.shape[0]
    shifts = torch.arange(7, -1, -1, device=packed.device)
    bits = ((packed.to(torch.int64).unsqueeze(-1) >> shifts) & 1).reshape(T, -1)[:, : N * width]
    weights = 1 << torch.arange(width - 1, -1, -1, device=packed.device)
    return (bits.view(T, N, width) * weights).sum(-1)


def window_states(packed: Tensor, N: int, L: int, kv: int) -> Tensor:
    """:func:`trellis_states` by reading bit windows (needs ``N·kv`` a multiple of 8 and ``L ≤ 24``).

    State ``t`` is the ``L``-bit big-endian window of the (cyclic) bit stream that ends with chunk ``t``, i.e.
    starts at bit ``kv·t − (L − kv)``. Each window lies in 4 consecutive bytes (``L + 7 ≤ 32``): gather them as
    one 32-bit word, shift, mask. The stream is extended at the front by its last ``P`` bytes (the cyclic wrap).
    Several times faster than assembling states chunk by chunk; same result (tested).
    """
    T, B = packed.shape
    P = (L - kv + 7) // 8
    ext = torch.cat([packed[:, B - P :], packed, packed.new_zeros(T, 3)], dim=1).to(torch.int32)
    start = torch.arange(N, device=packed.device) * kv - (L - kv) + 8 * P
    byte, bit = start >> 3, start & 7
    word = (ext[:, byte] << 24) | (ext[:, byte + 1] << 16) | (ext[:, byte + 2] << 8) | ext[:, byte + 3]
    # int32 may be negative (bit 31 set): the arithmetic shift's sign bits fall outside the L-bit mask.
    return ((word >> (32 - L - bit)) & ((1 << L) - 1)).to(torch.int64)


def trellis_states(packed: Tensor, N: int, L: int, kv: int) -> Tensor:
    """The cyclic (tail-biting) states ``[T, N]`` int64 of packed tiles ``[T, ceil(N·kv/8)]`` uint8.

    Bit windows (:func:`window_states`) where they apply, else the chunks shifted into place one by one.
    """
    if (N * kv) % 8 == 0 and L <= 24:
        return window_states(packed, N, L, kv)
    chunks = unpack_chunks(packed, N, kv)
    states = torch.zeros_like(chunks)
    for j in range(L // kv):
        states |= torch.roll(chunks, j, dims=1) << (j * kv)
    return states


def rtn_levels(packed: Tensor, n: int, bits: int) -> Tensor:
    """The round-to-nearest baseline's centred levels ``j − (2^bits − 1)/2`` ``[T, n]`` (float32) of packed
    ``bits``-bit level indices ``j``."""
    return unpack_chunks(packed, n, bits).float() - ((1 << bits) - 1) / 2
