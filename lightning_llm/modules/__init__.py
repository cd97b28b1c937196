"""LightningModules, one file per method family."""

from lightning_llm.modules.causal_lm import CausalLMModule
from lightning_llm.modules.grpo import GRPOModule

__all__ = ["CausalLMModule", "GRPOModule"]
