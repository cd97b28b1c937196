"""Weight quantisation: random Hadamard incoherence processing and 2-bit trellis-coded quantisation.

Proteus / QTIP-style trellis quantisation: :mod:`.hadamard` (incoherence processing), :mod:`.codes`
(lookup-free computed codes: QTIP 1MAD / 3INST, Proteus MUL-BAL), :mod:`.trellis` (bitshift trellis,
tail-biting Viterbi, packing), :mod:`.quantize` (whole matrices, channel compensation, RTN baseline),
:mod:`.ldlq` (proxy Hessians, BlockLDLQ), :mod:`.linear` (``TrellisLinear``), :mod:`.distill` (few-shot distillation of the affine statistics),
:mod:`.model` (``quantize_model``, safetensors save / load), :mod:`.baselines` (bitsandbytes NF4 for
comparisons) and :mod:`.heldout` (held-out text, perplexity and KL of a quantised model). The decode side (the Hadamard rotation, the bit stream and the code arithmetic, the
decode-on-the-fly matmul) lives in :mod:`lightning_llm.kernels`, which this package imports.
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
from .hadamard import incoherence_process, incoherence_unprocess
from .ldlq import (
    DEFAULT_DAMP,
    HessianCollector,
    block_ldlq,
    damp_hessian,
    feedback_factor,
    incoherence_hessian,
    proxy_error,
)
from .linear import TrellisLinear, set_trellis_backend
from .model import distill_quantized, load_quantized, quantize_layer, quantize_model, save_quantized
from .quantize import QuantizedMatrix, decode_normalized, dequantize, quantize_matrix
from .trellis import brute_force, decode_packed, decode_states, pack, unpack, viterbi

__all__ = [
    "DEFAULT_DAMP",
    "MULBAL_CANDIDATES",
    "HessianCollector",
    "MulBalCode",
    "OneMADCode",
    "QuantizedMatrix",
    "TableCode",
    "ThreeInstCode",
    "TrellisCode",
    "TrellisLinear",
    "block_ldlq",
    "brute_force",
    "damp_hessian",
    "decode_normalized",
    "decode_packed",
    "decode_states",
    "dequantize",
    "distill_affine",
    "distill_quantized",
    "feedback_factor",
    "incoherence_hessian",
    "incoherence_process",
    "incoherence_unprocess",
    "load_quantized",
    "make_code",
    "pack",
    "proxy_error",
    "quantize_layer",
    "quantize_matrix",
    "quantize_model",
    "quantize_model_nf4",
    "save_quantized",
    "set_trellis_backend",
    "unpack",
    "viterbi",
]
