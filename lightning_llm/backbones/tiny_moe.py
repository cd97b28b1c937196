"""``"tiny-moe"``: a tiny, randomly initialised sparse MoE causal LM with the tiny tokenizer, for expert-pruning studies."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_llm.backbones.cache import cached_directory, lightning_llm_home
from lightning_llm.backbones.tiny import TinyRecipe, tiny_directory
from lightning_llm.backbones.utils import quiet_progress

__all__ = ["ARCHS", "TINY_MOE", "TinyMoERecipe", "build_tiny_moe", "tiny_moe_directory"]

TINY_MOE = "tiny-moe"
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class TinyMoERecipe:
    """Everything that determines the tiny MoE (``build_tiny_moe``'s arguments); with the tokenizer's recipe, the key."""

    version: int = 1
    arch: str = "mixtral"
    num_experts: int = 8
    top_k: int = 2
    layers: int = 4
    hidden: int = 64
    expert_intermediate: int = 128
    seed: int = 0

    def key(self) -> str:
        record = {**asdict(self), "tokenizer": TinyRecipe().key()}
        digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:12]
        return f"tiny-moe-v{self.version}-{digest}"


def tiny_moe_directory(recipe: TinyMoERecipe | None = None) -> Path:
    """Path of the verified tiny MoE, building (or rebuilding) it when missing or corrupt."""
    recipe = recipe or TinyMoERecipe()

    def build(staging: Path) -> dict[str, Any]:
        build_tiny_moe(staging, **{k: v for k, v in asdict(recipe).items() if k != "version"})
        return {"recipe": asdict(recipe)}

    return cached_directory(lightning_llm_home() / recipe.key(), build, what="tiny-moe backbone")


def build_tiny_moe(
    directory: str | Path,
    arch: Literal["mixtral", "qwen2_moe", "qwen3_moe"] = "mixtral",
    *,
    num_experts: int = 8,
    top_k: int = 2,
    layers: int = 2,
    hidden: int = 64,
    expert_intermediate: int = 128,
    shared_expert_intermediate: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 1024,
    seed: int = 0,
    **config_kwargs: Any,
) -> Path:
    """Write a random MoE LM and the tiny tokenizer to ``directory``; ``load_backbone(directory)`` loads it.

    Args:
        directory: Where to write (created if needed).
        arch: ``"mixtral"`` (``MixtralForCausalLM``, renormalised top-k router), ``"qwen2_moe"``
            (``Qwen2MoeForCausalLM``, with a sigmoid-gated shared expert of ``shared_expert_intermediate``
            units that pruning never touches) or ``"qwen3_moe"`` (``Qwen3MoeForCausalLM``, no shared expert).
        num_experts: Routed experts per layer.
        top_k: Experts per token (``num_experts_per_tok``).
        layers: Decoder layers, every one an MoE layer.
        hidden: Hidden size.
        expert_intermediate: Each routed expert's intermediate size.
        shared_expert_intermediate: The shared expert's intermediate size (``qwen2_moe``).
        heads: Attention heads (``hidden`` must divide by it).
        kv_heads: Key/value heads.
        max_positions: Maximum sequence length.
        seed: The weights are a pure function of the arguments and ``seed``.
        **config_kwargs: Further config fields (e.g. ``norm_topk_prob=True`` for Qwen).

    Embeddings are tied (as for ``"tiny"``), so ``CausalLMModule`` can train it.
    """
    from transformers import GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_directory())
    common: dict[str, Any] = dict(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        num_experts_per_tok=top_k,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "mixtral":
        from transformers import MixtralConfig as Config
        from transformers import MixtralForCausalLM as Model

        common.update(num_local_experts=num_experts, intermediate_size=expert_intermediate)
    else:
        if arch == "qwen2_moe":
            from transformers import Qwen2MoeConfig as Config
            from transformers import Qwen2MoeForCausalLM as Model

            common.update(shared_expert_intermediate_size=shared_expert_intermediate)
        else:
            from transformers import Qwen3MoeConfig as Config
            from transformers import Qwen3MoeForCausalLM as Model
        common.update(
            num_experts=num_experts,
            moe_intermediate_size=expert_intermediate,
            intermediate_size=expert_intermediate,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    config = Config(**{**common, **config_kwargs})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Model(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with quiet_progress():
        model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
