"""Which tokenizer a DataModule uses: the model's, unless told otherwise, and never a different one silently.

A DataModule built with ``tokenizer=None`` takes the tokenizer of the LightningModule it is fitted with
(``trainer.lightning_module.tokenizer``), resolved when it first needs one (``prepare_data``/``setup``); used on
its own (no Trainer), it falls back to the embedded ``"tiny"`` tokenizer. A named tokenizer is loaded by
:func:`~lightning_llm.backbones.load_tokenizer`. Either way :meth:`setup` checks it against the model's and raises
:class:`TokenizerMismatchError` when they differ, so data can never be tokenized with another vocabulary than
the one the model reads.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TokenizerMismatchError", "check_same_tokenizer", "model_tokenizer", "resolve_tokenizer"]

#: What a DataModule used on its own (without a Trainer) tokenizes with when it was given no tokenizer.
STANDALONE_TOKENIZER = "tiny"


class TokenizerMismatchError(ValueError):
    """The DataModule's tokenizer is not the tokenizer of the model it is fitted with."""


def model_tokenizer(datamodule: Any) -> PreTrainedTokenizerBase | None:
    """The tokenizer of the LightningModule ``datamodule`` is being fitted with, if any."""
    trainer = getattr(datamodule, "trainer", None)
    module = getattr(trainer, "lightning_module", None) if trainer is not None else None
    return getattr(module, "tokenizer", None)


def resolve_tokenizer(
    datamodule: Any, name: str | None, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """``name``'s tokenizer, or (``name=None``) the fitted model's, or standalone the tiny one."""
    from lightning_llm.backbones import load_tokenizer

    if name is None:
        tokenizer = model_tokenizer(datamodule)
        if tokenizer is not None:
            return tokenizer
        name = STANDALONE_TOKENIZER
    return load_tokenizer(name, trust_remote_code=trust_remote_code)


def _fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of what decides token ids and rendered prompts: vocabulary, special tokens, chat template."""
    record = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(record, default=str).encode()).hexdigest()


def check_same_tokenizer(datamodule: Any, tokenizer: PreTrainedTokenizerBase, name: str | None) -> None:
    """Raise :class:`TokenizerMismatchError` if ``tokenizer`` is not the fitted model's (nothing to check unfitted)."""
    model = model_tokenizer(datamodule)
    if model is None or model is tokenizer or _fingerprint(model) == _fingerprint(tokenizer):
        return
    source = (
        f"tokenizer={name!r}" if name is not None else "the tiny tokenizer (it was set up before fitting)"
    )
    raise TokenizerMismatchError(
        f"{type(datamodule).__name__} tokenizes with {source} ({len(tokenizer)} tokens), but the model it is "
        f"fitted with reads another tokenizer ({len(model)} tokens, {getattr(model, 'name_or_path', '?')!r}). "
        "Leave the DataModule's tokenizer unset (None) to use the model's, or name the model's own tokenizer."
    )
