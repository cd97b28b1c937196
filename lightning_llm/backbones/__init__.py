"""Backbones: any Hugging Face causal LM, and three aliases that work offline.

====================  ==========  =============================================================================
alias                 parameters  what it is for
====================  ==========  =============================================================================
``"tiny"``            ~0.9M       embedded, random init, built locally in seconds: tests and fast studies
``"tiny-moe"``        ~1M         its sparse-MoE sibling (4 layers x 8 experts, top-2): expert-pruning studies
``"smollm2-135m"``    135M        SmolLM2-135M-Instruct, a real pretrained chat model (Q4_1 weights dequantised),
                                  fetched from the package index once and converted; evidence on a real model
``"gemma3-270m"``     268M        Gemma 3 270M base (Q4_K_M weights dequantised), the second real architecture:
                                  262k vocabulary, 1 KV head, sliding-window + global layers, no system role
====================  ==========  =============================================================================

Every module takes ``model: str`` and goes through :func:`load_backbone`; anything else is a local directory
(``save_pretrained`` output) or a hub id. Caches live under ``$LIGHTNING_LLM_HOME`` (default
``~/.cache/lightning_llm``), are checked against a manifest of SHA-256 digests, and are built once even when
several processes ask at the same time (:mod:`lightning_llm.backbones.cache`). ``python -m
lightning_llm.backbones fetch smollm2-135m`` (or ``lightning-llm fetch smollm2-135m``) fetches ahead of time.
"""

from lightning_llm.backbones.cache import lightning_llm_home
from lightning_llm.backbones.chat import apply_chat_template, fold_system_messages, keeps_system_messages
from lightning_llm.backbones.gemma3 import GEMMA3
from lightning_llm.backbones.loader import (
    BackboneNotFoundError,
    available_backbones,
    load_backbone,
    load_model,
    load_tokenizer,
    register_backbone,
    resolve_backbone,
)
from lightning_llm.backbones.smollm2 import SMOLLM2
from lightning_llm.backbones.stops import end_of_turn_token_id, stop_token_ids, turn_end_token_id
from lightning_llm.backbones.tiny import TAG_TOKENS, TINY, TinyRecipe
from lightning_llm.backbones.tiny_moe import TINY_MOE, TinyMoERecipe, build_tiny_moe
from lightning_llm.backbones.utils import eval_mode, quiet_progress

__all__ = [
    "GEMMA3",
    "SMOLLM2",
    "TAG_TOKENS",
    "TINY",
    "TINY_MOE",
    "BackboneNotFoundError",
    "TinyMoERecipe",
    "TinyRecipe",
    "apply_chat_template",
    "available_backbones",
    "build_tiny_moe",
    "end_of_turn_token_id",
    "eval_mode",
    "fetch",
    "fold_system_messages",
    "keeps_system_messages",
    "lightning_llm_home",
    "load_backbone",
    "load_model",
    "load_tokenizer",
    "quiet_progress",
    "register_backbone",
    "resolve_backbone",
    "stop_token_ids",
    "turn_end_token_id",
]


def fetch(name: str) -> str:
    """Build, fetch or convert an alias now (instead of at its first load) and return its local directory."""
    return resolve_backbone(name)
