"""Harvested activations, held in memory or as safetensors shards on disk, read shard by shard.

A harvest is its training tokens (``activations`` float32 ``[n, d_in]``, ``special_mask`` bool ``[n]``,
``token_ids`` long ``[n]``, in data order) cut into shards of ``shard_tokens`` tokens, the unit of loading, plus
the validation dialogues (:class:`ValidationSet`). In memory (:class:`MemoryStore`) it takes about
``num_tokens × d_in × 4`` bytes (plus 9 bytes a token of ids and flags): 1M tokens of a 4096-wide model are
16 GiB. On disk (:class:`ShardStore`) a harvest directory holds ``train-00000.safetensors``, ...,
``val.safetensors`` and a ``manifest.json`` with the harvest's key, ``d_in``, ``num_tokens``, the special token
ids, each shard's file, token count and size, and every file's SHA-256; training then holds one shard at a time.
Both stores cut the same shard bounds, so a harvest streams identically from memory and from disk.
:func:`check_harvest` accepts a directory only when all of its manifest holds.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_llm.backbones.cache import MANIFEST, verify

__all__ = [
    "VAL_FILE",
    "ActivationStore",
    "MemoryStore",
    "ShardStore",
    "ShardWriter",
    "ValidationSet",
    "check_harvest",
    "load_harvest",
]

VAL_FILE = "val.safetensors"


class ActivationStore(Protocol):
    """Harvested training tokens, read shard by shard (the unit of loading) or gathered by index."""

    d_in: int
    bounds: list[tuple[int, int]]

    @property
    def num_tokens(self) -> int: ...

    def load(self, shard: int) -> tuple[Tensor, Tensor]:
        """``(activations, special_mask)`` of one shard."""
        ...

    def gather(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """``(activations, special_mask)`` of the tokens at ``indices``."""
        ...

    def token_ids(self) -> Tensor:
        """Token id of every harvested token."""
        ...


def _bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` token ranges of consecutive shards of ``counts`` tokens."""
    return list(itertools.pairwise(itertools.accumulate(counts, initial=0)))


class MemoryStore:
    """The whole harvest in memory, split into virtual shards of ``shard_tokens`` like the on-disk layout."""

    def __init__(self, activations: Tensor, special: Tensor, token_ids: Tensor, shard_tokens: int) -> None:
        self.activations, self.special, self._token_ids = activations, special, token_ids
        self.d_in = activations.shape[1]
        total = len(activations)
        self.bounds = _bounds([min(shard_tokens, total - start) for start in range(0, total, shard_tokens)])

    @property
    def num_tokens(self) -> int:
        return len(self.activations)

    def load(self, shard: int) -> tuple[Tensor, Tensor]:
        lo, hi = self.bounds[shard]
        return self.activations[lo:hi], self.special[lo:hi]

    def gather(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        return self.activations[indices], self.special[indices]

    def token_ids(self) -> Tensor:
        return self._token_ids


class ShardStore:
    """Safetensors shards on disk, as listed by a harvest manifest; at most one shard is loaded at a time."""

    def __init__(self, directory: Path, manifest: Mapping[str, Any]) -> None:
        self.directory = directory
        self.files = [shard["file"] for shard in manifest["shards"]]
        self.bounds = _bounds([shard["tokens"] for shard in manifest["shards"]])
        self.d_in = int(manifest["d_in"])

    @property
    def num_tokens(self) -> int:
        return self.bounds[-1][1] if self.bounds else 0

    def load(self, shard: int) -> tuple[Tensor, Tensor]:
        from safetensors.torch import load_file

        tensors = load_file(self.directory / self.files[shard])
        return tensors["activations"], tensors["special_mask"]

    def token_ids(self) -> Tensor:
        """Token id of every harvested token (reads only the ids of each shard)."""
        from safetensors import safe_open

        ids = []
        for file in self.files:
            with safe_open(str(self.directory / file), framework="pt") as shard:
                ids.append(shard.get_tensor("token_ids"))
        return torch.cat(ids)

    def gather(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        activations = torch.empty(len(indices), self.d_in)
        special = torch.empty(len(indices), dtype=torch.bool)
        starts = torch.tensor([lo for lo, _ in self.bounds])
        shard_of = torch.bucketize(indices, starts, right=True) - 1
        for shard in shard_of.unique().tolist():
            where = (shard_of == shard).nonzero().flatten()
            shard_activations, shard_special = self.load(shard)
            local = indices[where] - self.bounds[shard][0]
            activations[where] = shard_activations[local]
            special[where] = shard_special[local]
        return activations, special


class ValidationSet(Dataset):
    """Held-out dialogues, one item each: ``input_ids [T]``, ``activations [T, d]``, ``special_mask [T]``."""

    def __init__(self, activations: Tensor, special_mask: Tensor, token_ids: Tensor, lengths: Tensor) -> None:
        self.activations, self.special, self.token_ids = activations, special_mask, token_ids
        self.lengths = lengths
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        lo, hi = self.offsets[index], self.offsets[index + 1]
        return {
            "input_ids": self.token_ids[lo:hi],
            "activations": self.activations[lo:hi],
            "special_mask": self.special[lo:hi],
        }

    def tensors(self) -> dict[str, Tensor]:
        """The flat tensors it is built from (the contents of ``val.safetensors``)."""
        return {
            "activations": self.activations,
            "special_mask": self.special,
            "token_ids": self.token_ids,
            "lengths": self.lengths,
        }


class ShardWriter:
    """Collects harvested chunks into a :class:`MemoryStore`, or into shards in ``directory`` when given one.

    On disk, a shard is written as soon as ``shard_tokens`` tokens are pending, so harvesting holds at most one
    shard plus one forward's tokens.
    """

    def __init__(self, shard_tokens: int, directory: Path | None = None) -> None:
        self.shard_tokens, self.directory = shard_tokens, directory
        self.pending: list[tuple[Tensor, Tensor, Tensor]] = []
        self.pending_tokens = 0
        self.shards: list[dict[str, Any]] = []

    def add(self, activations: Tensor, special: Tensor, token_ids: Tensor) -> None:
        self.pending.append((activations, special, token_ids))
        self.pending_tokens += len(activations)
        while self.directory is not None and self.pending_tokens >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def _take(self, count: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        activations, special, token_ids = (torch.cat(column) for column in zip(*self.pending, strict=True))
        count = len(activations) if count is None else count
        rest = (activations[count:], special[count:], token_ids[count:])
        self.pending = [rest] if len(rest[0]) else []
        self.pending_tokens = len(rest[0])
        return activations[:count], special[:count], token_ids[:count]

    def _flush(self, count: int) -> None:
        from safetensors.torch import save_file

        activations, special, token_ids = self._take(count)
        name = f"train-{len(self.shards):05d}.safetensors"
        path = self.directory / name
        tensors = {"activations": activations, "special_mask": special, "token_ids": token_ids}
        save_file({key: value.contiguous() for key, value in tensors.items()}, path)
        self.shards.append({"file": name, "tokens": count, "bytes": path.stat().st_size})

    def to_memory(self) -> MemoryStore:
        """The collected tokens as a :class:`MemoryStore`."""
        return MemoryStore(*self._take(), self.shard_tokens)

    def to_disk(self, validation: ValidationSet) -> dict[str, Any]:
        """Write the last shard and ``val.safetensors``; the manifest record of the files (``d_in``,
        ``num_tokens``, ``shards``, ``val``)."""
        from safetensors.torch import save_file

        if self.pending_tokens:
            self._flush(self.pending_tokens)
        path = self.directory / VAL_FILE
        save_file({key: value.contiguous() for key, value in validation.tensors().items()}, path)
        return {
            "d_in": validation.activations.shape[1],
            "num_tokens": sum(shard["tokens"] for shard in self.shards),
            "shards": self.shards,
            "val": {"file": VAL_FILE, "bytes": path.stat().st_size},
        }


def check_harvest(directory: Path, key: Mapping[str, Any]) -> str | None:
    """None when ``directory`` holds a complete harvest for ``key``, else what is wrong with it.

    The manifest must be readable and carry ``key``; every shard and the validation file must be there with its
    recorded size, the shard token counts must add up, and every file must match its SHA-256
    (:func:`~lightning_llm.backbones.cache.verify`).
    """
    path = directory / MANIFEST
    if not path.is_file():
        return "no manifest (missing or partially written harvest)"
    try:
        manifest = json.loads(path.read_text())
        if manifest["key"] != key:
            return "the manifest's key differs from this DataModule's"
        for entry in [*manifest["shards"], manifest["val"]]:
            file = directory / entry["file"]
            if not file.is_file():
                return f"missing file {entry['file']}"
            if file.stat().st_size != entry["bytes"]:
                return f"size mismatch for {entry['file']}"
        if sum(int(shard["tokens"]) for shard in manifest["shards"]) != manifest["num_tokens"]:
            return "shard token counts do not add up to num_tokens"
        int(manifest["d_in"])
    except (ValueError, KeyError, TypeError) as error:
        return f"unreadable manifest ({type(error).__name__}: {error})"
    return verify(directory)


def load_harvest(directory: Path) -> tuple[ShardStore, ValidationSet]:
    """The training shards and the validation set of a harvest directory that passed :func:`check_harvest`."""
    from safetensors.torch import load_file

    manifest = json.loads((directory / MANIFEST).read_text())
    return ShardStore(directory, manifest), ValidationSet(**load_file(directory / VAL_FILE))
