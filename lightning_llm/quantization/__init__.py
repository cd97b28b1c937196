"""Weight quantisation: random Hadamard incoherence processing and 2-bit trellis-coded quantisation.

Proteus / QTIP-style trellis quantizer core (issue 8, part 1): :mod:`.hadamard` (incoherence processing),
:mod:`.codes` (lookup-free computed codes), :mod:`.trellis` (bitshift trellis, tail-biting Viterbi, packing)
and :mod:`.quantize` (whole matrices, RTN baseline).
"""

from .codes import (
    MULBAL_CANDIDATES,
    MulBalCode,
    OneMADCode,
    TableCode,
    ThreeInstCode,
    TrellisCode,
    make_code,
)
from .hadamard import RandomHadamard, fwht, incoherence_process, incoherence_unprocess
from .linear import TrellisLinear, load_quantized, quantize_model, save_quantized
from .quantize import QuantizedMatrix, dequantize, quantize_matrix
from .trellis import brute_force, decode_packed, decode_states, pack, unpack, viterbi

__all__ = [
    "MULBAL_CANDIDATES",
    "MulBalCode",
    "OneMADCode",
    "QuantizedMatrix",
    "RandomHadamard",
    "TableCode",
    "ThreeInstCode",
    "TrellisCode",
    "TrellisLinear",
    "brute_force",
    "decode_packed",
    "decode_states",
    "dequantize",
    "fwht",
    "incoherence_process",
    "incoherence_unprocess",
    "load_quantized",
    "make_code",
    "pack",
    "quantize_matrix",
    "quantize_model",
    "save_quantized",
    "unpack",
    "viterbi",
]
