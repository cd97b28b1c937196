"""LightningModules, one file per method family."""

from lightning_llm.modules.causal_lm import CausalLMModule

__all__ = ["CausalLMModule"]
