"""LightningModules, one file per method family."""

from lightning_llm.modules.causal_lm import CausalLMModule
from lightning_llm.modules.dpo import DPOModule, dpo_loss, sequence_logprobs
from lightning_llm.modules.grpo import GRPOModule
from lightning_llm.modules.indexmem import IndexMemModule
from lightning_llm.modules.latent_thoughts import LatentThoughtsModule, fuse_latent, latent_collapse
from lightning_llm.modules.sae import SparseAutoencoder, SparseAutoencoderModule, geometric_median

__all__ = [
    "CausalLMModule",
    "DPOModule",
    "GRPOModule",
    "IndexMemModule",
    "LatentThoughtsModule",
    "SparseAutoencoder",
    "SparseAutoencoderModule",
    "dpo_loss",
    "fuse_latent",
    "geometric_median",
    "latent_collapse",
    "sequence_logprobs",
]
