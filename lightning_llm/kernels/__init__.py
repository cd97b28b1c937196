"""Memory-efficient fused ops with a Triton path on CUDA and a plain-PyTorch reference everywhere else.

Importing this package never imports Triton; the kernels are loaded on first use with CUDA tensors.
:func:`use_triton` says whether the Triton path runs for given tensors (callers that branch on it, e.g.
:class:`~lightning_llm.lora.LoRALinear`, use it rather than re-deriving the rule).
"""

from lightning_llm.kernels._dispatch import use_triton
from lightning_llm.kernels.budgeted_attention import budgeted_attention
from lightning_llm.kernels.fused_linear_logprobs import entropy_dynamics_reference, fused_linear_logprobs
from lightning_llm.kernels.jumprelu import jumprelu
from lightning_llm.kernels.lora_linear import lora_linear
from lightning_llm.kernels.sparse_decode import sparse_decode
from lightning_llm.kernels.topk_encode import topk_encode
from lightning_llm.kernels.trellis_matmul import trellis_matmul

__all__ = [
    "budgeted_attention",
    "entropy_dynamics_reference",
    "fused_linear_logprobs",
    "jumprelu",
    "lora_linear",
    "sparse_decode",
    "topk_encode",
    "trellis_matmul",
    "use_triton",
]
