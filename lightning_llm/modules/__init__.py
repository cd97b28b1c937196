"""LightningModules, one file per method family.

Placement rule (see :mod:`lightning_llm`): this package holds a method's LightningModule (its training step,
losses, logging, optimiser); the method's non-Lightning building blocks (layers, algorithms, configs) live in a
feature module or package named after it (:mod:`lightning_llm.sae` for :class:`SparseAutoencoderModule`,
:mod:`lightning_llm.lora`, :mod:`lightning_llm.eviction` for :class:`IndexMemModule`), and its callbacks in
:mod:`lightning_llm.callbacks`.
"""

from lightning_llm.modules.causal_lm import CausalLMModule
from lightning_llm.modules.dpo import DPOModule, dpo_loss, sequence_logprobs
from lightning_llm.modules.grpo import GRPOModule
from lightning_llm.modules.indexmem import IndexMemModule
from lightning_llm.modules.latent_thoughts import LatentThoughtsModule, fuse_latent, latent_collapse
from lightning_llm.modules.sae import SparseAutoencoderModule

__all__ = [
    "CausalLMModule",
    "DPOModule",
    "GRPOModule",
    "IndexMemModule",
    "LatentThoughtsModule",
    "SparseAutoencoderModule",
    "dpo_loss",
    "fuse_latent",
    "latent_collapse",
    "sequence_logprobs",
]
