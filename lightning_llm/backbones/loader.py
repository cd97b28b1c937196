"""``load_backbone(name_or_path)``: an alias, a local directory or a Hugging Face id -> ``(model, tokenizer)``."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_llm.backbones.gemma3 import GEMMA3, gemma3_directory
from lightning_llm.backbones.moe import is_nonuniform_moe, load_moe
from lightning_llm.backbones.smollm2 import SMOLLM2, smollm2_directory
from lightning_llm.backbones.tiny import TINY, tiny_directory
from lightning_llm.backbones.tiny_moe import TINY_MOE, tiny_moe_directory
from lightning_llm.backbones.utils import quiet_progress

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "BackboneNotFoundError",
    "available_backbones",
    "load_backbone",
    "load_model",
    "load_tokenizer",
    "register_backbone",
    "resolve_backbone",
]


class BackboneNotFoundError(FileNotFoundError):
    """A backbone name that is neither an alias, nor a local directory, nor reachable on the hub."""


#: Aliases -> a function returning the local directory (built, fetched or converted on first use).
_ALIASES: dict[str, Callable[[], Path]] = {
    TINY: tiny_directory,
    TINY_MOE: tiny_moe_directory,
    SMOLLM2: smollm2_directory,
    GEMMA3: gemma3_directory,
}
#: Aliases built on this machine from a seed: their loads are quiet (no weight-loading progress bars).
_EMBEDDED = {TINY, TINY_MOE}


def register_backbone(name: str, directory: Callable[[], Path]) -> None:
    """Make ``load_backbone(name)`` load the directory ``directory()`` returns (it may build or fetch it)."""
    if name in _ALIASES and _ALIASES[name] is not directory:
        raise ValueError(f"backbone alias {name!r} is already registered")
    _ALIASES[name] = directory


def available_backbones() -> list[str]:
    """The registered aliases (``tiny``, ``tiny-moe``, ``smollm2-135m``, ``gemma3-270m``...)."""
    return sorted(_ALIASES)


def resolve_backbone(name_or_path: str) -> str:
    """The local directory of an alias or path, or a Hugging Face id; fails fast and clearly otherwise.

    An unknown name that is not a local directory is looked up in the Hugging Face cache; if it is not there and
    the hub is offline (``HF_HUB_OFFLINE``) or unreachable (checked with a 3 s connection probe), this raises
    :class:`BackboneNotFoundError` at once instead of letting transformers retry for a minute.
    """
    if name_or_path in _ALIASES:
        return str(_ALIASES[name_or_path]())
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    looks_local = (
        name_or_path.startswith(("/", "./", "../", "~")) or name_or_path.count("/") > 1 or path.exists()
    )
    if looks_local:
        raise BackboneNotFoundError(_not_found(name_or_path, "no such local directory"))
    if _in_hub_cache(name_or_path):
        return name_or_path
    if _hub_offline():
        raise BackboneNotFoundError(
            _not_found(
                name_or_path,
                "no such local directory, and it is not in the Hugging Face cache while "
                "the hub is offline (HF_HUB_OFFLINE)",
            )
        )
    if not _hub_reachable():
        raise BackboneNotFoundError(
            _not_found(
                name_or_path,
                "no such local directory, not in the Hugging Face cache, and the hub is unreachable",
            )
        )
    return name_or_path


def _not_found(name: str, why: str) -> str:
    return (
        f"backbone {name!r}: {why}. Known aliases: {', '.join(available_backbones())}. A Hugging Face model is "
        "passed by its hub id (e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct', downloaded once with network access); "
        "a local model by the directory `save_pretrained` wrote."
    )


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an invalid repo id, or no cache
        return False
    return isinstance(found, str)


def _hub_offline() -> bool:
    flags = (os.environ.get(name, "") for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(flag.strip().lower() in ("1", "true", "yes", "on") for flag in flags)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint opens within ``timeout`` seconds (DNS included)."""
    import socket
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants

        endpoint = urlparse(constants.ENDPOINT)
    except Exception:  # pragma: no cover - huggingface_hub is a transformers dependency
        return False
    host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)  # getaddrinfo ignores socket timeouts
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def load_tokenizer(name_or_path: str = TINY, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load only the tokenizer of a backbone (DataModules need it without the weights).

    A tokenizer without a pad token gets its eos token as pad, so batching always works.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        resolve_backbone(name_or_path), trust_remote_code=trust_remote_code
    )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name_or_path!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name_or_path: str = TINY,
    *,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    **model_kwargs: Any,
) -> PreTrainedModel:
    """The model of :func:`load_backbone` alone (modules load their tokenizer at construction)."""
    from transformers import AutoModelForCausalLM

    path = resolve_backbone(name_or_path)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with quiet_progress(name_or_path in _EMBEDDED):
        # An MoE whose layers keep different numbers of experts cannot be rebuilt from its config alone.
        load = load_moe if is_nonuniform_moe(path) else AutoModelForCausalLM.from_pretrained
        return load(path, dtype=dtype, trust_remote_code=trust_remote_code, **model_kwargs)


def load_backbone(
    name_or_path: str = TINY,
    *,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    **model_kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)`` for a causal LM.

    Args:
        name_or_path: An alias — ``"tiny"`` (embedded, random init, for tests), ``"tiny-moe"`` (its sparse-MoE
            sibling), ``"smollm2-135m"`` (SmolLM2-135M-Instruct, a real pretrained chat model, offline after its
            first fetch; see :mod:`lightning_llm.backbones.smollm2`) —, a local directory written by
            ``save_pretrained``, or a Hugging Face model id.
        dtype: parameter dtype (``torch.bfloat16``, ``"bfloat16"``...); ``None`` keeps the checkpoint's.
        trust_remote_code: passed to ``from_pretrained``. Off by default: a checkpoint's Python code is
            never executed unless you ask for it.
        **model_kwargs: forwarded to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation``).
    """
    model = load_model(name_or_path, dtype=dtype, trust_remote_code=trust_remote_code, **model_kwargs)
    tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
