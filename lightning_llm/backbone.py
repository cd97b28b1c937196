"""Backbones: any Hugging Face causal LM, plus ``"tiny"``, an embedded offline default.

Every module in the library takes ``model: str = "tiny"``. A Hugging Face id or a local directory goes through
the real ``from_pretrained`` path; ``"tiny"`` is built on this machine with no network: a byte-level BPE
tokenizer trained on a corpus shipped inside the package (digits split one per token, as Qwen and Llama do, so
arithmetic is learnable) and a small randomly initialised Llama-style decoder. It is deterministic from its
recipe, cached under ``$LIGHTNING_LLM_HOME`` (default ``~/.cache/lightning_llm``), and every cached file is
checked against a manifest of SHA-256 digests on load, so a partial or corrupt cache is rebuilt, never used.
``"tiny-moe"`` is its sparse-MoE sibling (a random 4-layer × 8-expert top-2 Mixtral with the same tokenizer,
:func:`~lightning_llm.pruning.build_tiny_moe`), cached the same way, for expert-pruning studies.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "TINY",
    "TINY_MOE",
    "TinyMoERecipe",
    "TinyRecipe",
    "eval_mode",
    "lightning_llm_home",
    "load_backbone",
    "load_tokenizer",
]

TINY = "tiny"
TINY_MOE = "tiny-moe"

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

_MANIFEST = "manifest.json"


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


def lightning_llm_home() -> Path:
    """Cache root: ``$LIGHTNING_LLM_HOME`` or ``~/.cache/lightning_llm``."""
    return Path(os.environ.get("LIGHTNING_LLM_HOME", Path.home() / ".cache" / "lightning_llm")).expanduser()


def _resolve(name_or_path: str) -> str:
    """The tiny cache directory, a local directory, or a hub id; a missing local path fails here, clearly."""
    if name_or_path == TINY:
        return str(_tiny_dir())
    if name_or_path == TINY_MOE:
        return str(_tiny_dir(TinyMoERecipe(), _build_tiny_moe))
    looks_local = name_or_path.startswith(("/", "./", "../", "~")) or Path(name_or_path).exists()
    if looks_local and not Path(name_or_path).expanduser().is_dir():
        raise FileNotFoundError(f"backbone directory {name_or_path!r} does not exist")
    return str(Path(name_or_path).expanduser()) if looks_local else name_or_path


def load_tokenizer(name_or_path: str = TINY, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load only the tokenizer of a backbone (DataModules need it without the weights).

    A tokenizer without a pad token gets its eos token as pad, so batching always works.
    """
    from transformers import AutoTokenizer

    path = _resolve(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name_or_path!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_backbone(
    name_or_path: str = TINY,
    *,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    **model_kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)`` for a causal LM.

    Args:
        name_or_path: ``"tiny"`` (embedded, offline), ``"tiny-moe"`` (its MoE sibling), a Hugging Face model
            id, or a local directory written by ``save_pretrained``.
        dtype: parameter dtype (``torch.bfloat16``, ``"bfloat16"``...); ``None`` keeps the checkpoint's
            (fp32 for tiny).
        trust_remote_code: passed to ``from_pretrained``. Off by default: a checkpoint's Python code is
            never executed unless you ask for it.
        **model_kwargs: forwarded to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation``).
    """
    from transformers import AutoModelForCausalLM

    path = _resolve(name_or_path)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with _quiet_progress(name_or_path in (TINY, TINY_MOE)):
        if _is_nonuniform_pruned_moe(path):
            # an MoE whose layers keep different numbers of experts (ExpertPruning): the config alone cannot
            # describe it, so a plain from_pretrained would fail on the size mismatches
            from lightning_llm.pruning.experts import load_pruned_moe

            model = load_pruned_moe(path, dtype=dtype, trust_remote_code=trust_remote_code, **model_kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code, **model_kwargs
            )
    tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _is_nonuniform_pruned_moe(path: str) -> bool:
    """Whether a local checkpoint directory holds an expert-pruned MoE with different expert counts per layer."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        record = json.loads(config.read_text()).get("expert_pruning") or {}
    except (json.JSONDecodeError, AttributeError):
        return False
    return isinstance(record, dict) and record.get("uniform", True) is False


# --------------------------------------------------------------------------------------------- tiny build


def _tiny_dir(
    recipe: TinyRecipe | TinyMoERecipe | None = None, build: Callable[[Path, Any], None] | None = None
) -> Path:
    """Path of a verified tiny backbone, building (or rebuilding) it when missing or corrupt.

    ``build(directory, recipe)`` writes the files and the manifest (default: the tiny Llama, ``_build_tiny``).
    """
    recipe = recipe or TinyRecipe()
    build = build or _build_tiny
    target = lightning_llm_home() / recipe.key()
    problem = _verify(target)
    if problem is None:
        return target
    if target.exists():
        warnings.warn(f"rebuilding the tiny backbone cache at {target}: {problem}", stacklevel=3)
        shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a crash mid-build leaves only a temp dir, and concurrent builders
    # (DDP ranks) race on an atomic rename instead of writing into the same files.
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        with _quiet_progress(True):
            build(staging, recipe)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary shared directory
        try:
            staging.rename(target)
        except OSError:
            if _verify(target) is not None:  # another process won the race; accept only a valid result
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run a block with ``model`` in eval mode (no dropout), restoring its train/eval mode afterwards, also on errors.

    Generation and measurements (probes, metrics) call this so that they can run in the middle of training.
    """
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _quiet_progress(quiet: bool) -> Iterator[None]:
    """Hide transformers' per-shard progress bars for the tiny model (noise in every test and notebook)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was_enabled:
            hf_logging.enable_progress_bar()


def _verify(directory: Path) -> str | None:
    """None if every file listed in the manifest is present with its digest, else what is wrong."""
    manifest_path = directory / _MANIFEST
    if not manifest_path.is_file():
        return "no manifest (missing or partially written cache)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, str] = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return f"unreadable manifest ({err})"
    for name, digest in files.items():
        file = directory / name
        if not file.is_file():
            return f"missing file {name}"
        if _sha256(file) != digest:
            return f"checksum mismatch for {name}"
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


def _build_tiny(directory: Path, recipe: TinyRecipe) -> None:
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
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    _write_manifest(directory, recipe)


def _build_tiny_moe(directory: Path, recipe: TinyMoERecipe) -> None:
    from lightning_llm.pruning.tiny_moe import build_tiny_moe

    fields = {k: v for k, v in asdict(recipe).items() if k != "version"}
    build_tiny_moe(directory, **fields)
    _write_manifest(directory, recipe)


def _write_manifest(directory: Path, recipe: TinyRecipe | TinyMoERecipe) -> None:
    """Record every file's SHA-256 (written last: a cache without it is incomplete, see :func:`_verify`)."""
    files = {p.name: _sha256(p) for p in sorted(directory.iterdir()) if p.is_file()}
    manifest = {"recipe": asdict(recipe), "files": files}
    (directory / _MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
