"""A GGUF file as an ordinary Hugging Face checkpoint: dequantised once, written as safetensors."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning_llm.backbones.utils import quiet_progress

__all__ = ["convert_gguf"]


def convert_gguf(
    staging: Path,
    extract: Callable[[Path], Path],
    model_class: type,
    *,
    what: str,
    end_tokens: Sequence[str] = (),
    chat_template: str | None = None,
) -> Any:
    """Write the GGUF that ``extract(directory)`` puts into a temporary directory to ``staging`` as a plain
    ``model_class`` checkpoint (float32 safetensors) with its tokenizer, and return the tokenizer.

    The generation config stops at the tokenizer's eos and at each of ``end_tokens``; ``chat_template`` (when
    given) replaces the tokenizer's. ``what`` names the backbone in the messages.
    """
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"converting {what} from its GGUF needs the `gguf` package (`pip install gguf`)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with tempfile.TemporaryDirectory(dir=staging.parent) as tmp:
        gguf = extract(Path(tmp))
        print(f"lightning_llm: converting {gguf.name} to safetensors (once)", file=sys.stderr, flush=True)
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
        with quiet_progress():
            loaded = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain model from its dequantised weights.
    fields = {
        k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")
    }
    config = model_class.config_class.from_dict(fields)
    with torch.device("meta"):
        model = model_class(config)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    ends = [tokenizer.convert_tokens_to_ids(token) for token in end_tokens]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, *ends] if ends else tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    with quiet_progress():
        model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    return tokenizer
