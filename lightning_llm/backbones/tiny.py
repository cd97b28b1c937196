"""``"tiny"``: the embedded offline backbone, a ~0.9M-parameter random-init Llama with its own BPE tokenizer.

Built on this machine with no network: a byte-level BPE tokenizer trained on a corpus shipped inside the package
(digits split one per token, as Qwen and Llama do, so arithmetic is learnable) and a small randomly initialised
Llama-style decoder. Deterministic from its :class:`TinyRecipe`, cached under ``$LIGHTNING_LLM_HOME`` and verified
on every load (:mod:`lightning_llm.backbones.cache`). It is for tests and fast studies: it knows nothing until
trained.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch

from lightning_llm.backbones.cache import cached_directory, lightning_llm_home
from lightning_llm.backbones.utils import quiet_progress

__all__ = ["CHAT_TEMPLATE", "CONTROL_TOKENS", "TAG_TOKENS", "TINY", "TinyRecipe", "tiny_directory"]

TINY = "tiny"

#: Added tokens of the tiny tokenizer. The first three are control tokens (dropped by
#: ``decode(skip_special_tokens=True)``); the tags are ordinary added tokens so decoded text keeps them.
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = (
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<search>",
    "</search>",
    "<information>",
    "</information>",
    "<thinking>",
)

#: ChatML, as Qwen uses: ``<|im_start|>role\ncontent<|im_end|>\n``.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines the tiny backbone. Changing any field changes the cache key."""

    version: int = 1
    vocab_size: int = 1024  # BPE target; the shipped corpus is small, so fewer merges may be learned
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    seed: int = 0

    def key(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return f"tiny-v{self.version}-{digest}"


def tiny_directory(recipe: TinyRecipe | None = None) -> Path:
    """Path of the verified tiny backbone, building (or rebuilding) it when missing or corrupt."""
    recipe = recipe or TinyRecipe()
    return cached_directory(
        lightning_llm_home() / recipe.key(), lambda staging: _build(staging, recipe), what="tiny backbone"
    )


def _corpus_lines() -> list[str]:
    text = resources.files("lightning_llm").joinpath("assets/tiny_corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def _train_tokenizer(recipe: TinyRecipe):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits one per token (as Llama/Qwen): multi-digit merges would make arithmetic needlessly hard.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=recipe.max_position_embeddings,
        padding_side="right",
    )


def _build(directory: Path, recipe: TinyRecipe) -> dict:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer(recipe)
    vocab = -(-len(tokenizer) // 64) * 64  # round up: friendlier matmul shapes, room for added tokens
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=recipe.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    with quiet_progress():
        model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return {"recipe": asdict(recipe)}
