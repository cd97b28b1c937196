"""Weight quantisation: random Hadamard incoherence processing and 2-bit trellis-coded quantisation.

Proteus / QTIP-style trellis quantisation: :mod:`.hadamard` (incoherence processing), :mod:`.codes`
(lookup-free computed codes: QTIP 1MAD / 3INST, Proteus MUL-BAL), :mod:`.trellis` (bitshift trellis,
tail-biting Viterbi, packing), :mod:`.quantize` (whole matrices, channel compensation, RTN baseline),
:mod:`.linear` (``TrellisLinear``, ``quantize_model``, safetensors save / load), :mod:`.distill` (few-shot
distillation of the affine statistics), :mod:`.baselines` (bitsandbytes NF4 for comparisons) and
:mod:`.study` (the 2-bit perplexity study of tutorial 19, its behaviour test and ``benchmarks/quant.py``).
"""

from .baselines import quantize_model_nf4
from .codes import (
    MULBAL_CANDIDATES,
    MulBalCode,
    OneMADCode,
    TableCode,
    ThreeInstCode,
    TrellisCode,
    make_code,
)
from .distill import distill_affine
from .hadamard import RandomHadamard, fwht, incoherence_process, incoherence_unprocess
from .linear import (
    TrellisLinear,
    distill_quantized,
    load_quantized,
    quantize_model,
    save_quantized,
    set_trellis_backend,
)
from .quantize import QuantizedMatrix, decode_normalized, dequantize, quantize_matrix
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
    "decode_normalized",
    "decode_packed",
    "decode_states",
    "dequantize",
    "distill_affine",
    "distill_quantized",
    "fwht",
    "incoherence_process",
    "incoherence_unprocess",
    "load_quantized",
    "make_code",
    "pack",
    "quantize_matrix",
    "quantize_model",
    "quantize_model_nf4",
    "save_quantized",
    "set_trellis_backend",
    "unpack",
    "viterbi",
]
