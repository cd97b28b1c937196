r"""Residual-stream activations of a frozen backbone, harvested from chat data, for training sparse autoencoders.

FAST (arXiv 2506.07691) trains SAEs for instruct models *sequentially*: every dialogue is rendered by the chat
template (special tokens included) and run through the model on its own, one dialogue per sequence, no packing,
truncated at ``max_length``, which is how the model sees text when it is deployed. The usual baseline, *block
training*, concatenates dialogues into fixed-length blocks, so a token attends to the tail of unrelated
dialogues and its activation is one the deployed model never produces. :class:`ActivationDataModule` harvests
both (``mode``), from the same dialogues and with the same token budget, so the two can be compared fairly, and
always validates on held-out dialogues in the sequential (deployment) format.

Layer convention (as in :mod:`lightning_llm.callbacks.steering`): *layer* :math:`\ell` is the 0-based index into
:func:`~lightning_llm.backbones.inspect.decoder_layers` and the activation is the **output of that decoder
layer**, read by a forward hook; it equals Hugging Face's ``hidden_states[ℓ + 1]`` for every layer but the last
(HF applies the final norm there). The forward stops right after layer :math:`\ell`.

Special tokens: a token is *special* when its id is in the tokenizer's ``all_special_ids`` (bos/eos/pad/unk...
and ``additional_special_tokens``) or is an added token registered with ``special=True``
(``tokenizer.added_tokens_decoder``). The second set matters: ChatML's ``<|im_start|>`` is an added special
token but not in ``all_special_ids``. Tags added as ordinary tokens (the tiny tokenizer's ``<think>``,
``<answer>``...) are not special: they are text the model writes, not template structure. In the tiny backbone
the special tokens are ``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>`` (eos).

Training stream: harvested tokens are served through a seeded *mixing buffer* of ``buffer_size`` tokens: fill it
(from the shards, in an epoch-seeded shard order, each shard in stored order), shuffle it, emit batches from it
until it is at most half full, refill, and so on; when the data is exhausted the rest of the buffer is emitted in
full batches and the last partial batch (fewer than ``batch_size`` tokens) is dropped. An epoch therefore
serves every token at most once, exactly once when the token count is a multiple of ``batch_size``, and is
reshuffled with ``seed + epoch``. A buffer at least as large as the harvest is a full uniform shuffle.

Memory: without ``cache_dir`` the harvest is held in memory, about ``num_tokens × d_in × 4`` bytes of float32
activations (plus 9 bytes a token of ids and flags): 1M tokens of a 4096-wide model are 16 GiB. With
``cache_dir`` it is written once as safetensors shards of ``shard_tokens`` tokens, and training holds only the
mixing buffer and one shard: at most about ``(2 × buffer_size + shard_tokens) × d_in × 4`` bytes (shuffling
copies the buffer once). Validation activations (``num_val`` dialogues) are always held in memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import itertools
import json
import random
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_llm.backbones.inspect import decoder_layers, layer_index, layer_output_reader
from lightning_llm.datamodules.chat_sft import ChatSFTDataModule
from lightning_llm.datamodules.sources import pad_sequences

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["ActivationDataModule"]

_MODES = ("sequential", "block")
#: Version of the on-disk layout; part of the cache key, so a layout change never reads an old cache.
_FORMAT = 1
_MANIFEST = "manifest.json"
_VAL_FILE = "val.safetensors"


def _special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """``all_special_ids`` plus every added token registered as special (ChatML's ``<|im_start|>``...)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(tokenizer.all_special_ids) | frozenset(
        index for index, token in added.items() if getattr(token, "special", False)
    )


@torch.no_grad()
def _harvest(
    model: nn.Module, layer: int, rows: Sequence[Tensor], *, batch_size: int, pad_id: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """``(activations [n, d] float32 CPU, token_ids [n])`` of the real tokens of each forward, row-major.

    ``batch_size`` rows per forward, right-padded with attention mask 0; the padding positions are dropped. Each
    row is attended on its own (rows of a batch never see each other), so a row is the unit of attention: one
    dialogue in sequential mode, one packed block in block mode. The model runs in eval mode, without
    gradients, and stops after ``layer``. Module-level so that tests can replace it.
    """
    device = next(model.parameters()).device
    with layer_output_reader(model, layer) as read:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            input_ids = pad_sequences(chunk, pad_id)
            attention_mask = pad_sequences([torch.ones_like(row) for row in chunk], 0)
            hidden = read(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
            keep = attention_mask.bool()
            yield hidden[keep.to(device)].float().cpu(), input_ids[keep]


# ------------------------------------------------------------------------------------------------ storage


class _Store(Protocol):
    """Harvested training tokens, read shard by shard (the unit of loading) or gathered by index."""

    d_in: int
    bounds: list[tuple[int, int]]

    @property
    def num_tokens(self) -> int: ...

    def load(self, shard: int) -> tuple[Tensor, Tensor]: ...

    def gather(self, indices: Tensor) -> tuple[Tensor, Tensor]: ...

    def token_ids(self) -> Tensor: ...


def _bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` token ranges of consecutive shards of ``counts`` tokens."""
    return list(itertools.pairwise(itertools.accumulate(counts, initial=0)))


class _MemoryStore:
    """The whole harvest in memory, split into virtual shards of ``shard_tokens`` like the on-disk layout.

    The same shard bounds as a cached harvest give the same training stream with and without ``cache_dir``.
    """

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


class _ShardStore:
    """Safetensors shards on disk; at most one shard is loaded at a time."""

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.directory = directory
        self.files = [shard["file"] for shard in manifest["shards"]]
        self.bounds = _bounds([shard["tokens"] for shard in manifest["shards"]])
        self.d_in = int(manifest["d_in"])

    @property
    def num_tokens(self) -> int:
        return self.bounds[-1][1] if self.bounds else 0

    def _read(self, shard: int) -> dict[str, Tensor]:
        from safetensors.torch import load_file

        return load_file(self.directory / self.files[shard])

    def load(self, shard: int) -> tuple[Tensor, Tensor]:
        tensors = self._read(shard)
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


class _Writer:
    """Collects harvested chunks into a :class:`_MemoryStore`, or into shards on disk when given a directory.

    On disk, a shard is written as soon as ``shard_tokens`` tokens are pending, so harvesting holds at most one
    shard plus one forward's tokens.
    """

    def __init__(self, shard_tokens: int, directory: Path | None = None) -> None:
        self.shard_tokens, self.directory = shard_tokens, directory
        self.pending: list[tuple[Tensor, Tensor, Tensor]] = []
        self.pending_tokens = 0
        self.d_in: int | None = None  # width of the harvested activations, once one chunk came in
        self.shards: list[dict[str, Any]] = []

    def add(self, activations: Tensor, special: Tensor, token_ids: Tensor) -> None:
        self.pending.append((activations, special, token_ids))
        self.pending_tokens += len(activations)
        self.d_in = activations.shape[1]
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

    def finish_memory(self) -> _MemoryStore:
        activations, special, token_ids = self._take()
        return _MemoryStore(activations, special, token_ids, self.shard_tokens)

    def finish_disk(self) -> list[dict[str, Any]]:
        if self.pending_tokens:
            self._flush(self.pending_tokens)
        return self.shards


# --------------------------------------------------------------------------------------------- validation


class _ValidationSet(Dataset):
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
        return {
            "activations": self.activations,
            "special_mask": self.special,
            "token_ids": self.token_ids,
            "lengths": self.lengths,
        }


class _ValidationCollator:
    """Right-pads dialogues to the longest: pad id / attention mask 0 / zero activations / ``False`` flags."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        input_ids = [item["input_ids"] for item in items]
        length = max(len(ids) for ids in input_ids)
        activations = torch.zeros(len(items), length, items[0]["activations"].shape[-1])
        for row, item in enumerate(items):
            activations[row, : len(item["input_ids"])] = item["activations"]
        return {
            "input_ids": pad_sequences(input_ids, self.pad_id),
            "attention_mask": pad_sequences([torch.ones_like(ids) for ids in input_ids], 0),
            "activations": activations,
            "special_mask": pad_sequences([item["special_mask"] for item in items], False),
        }


# ------------------------------------------------------------------------------------------ training stream


def _distributed() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised default process group, else ``(0, 1)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class _ActivationStream(IterableDataset):
    """Training batches ``dict(activations [B, d], special_mask [B])`` through a seeded mixing buffer.

    Each ``iter()`` is one epoch (epochs are counted here, from 0; epoch ``e`` shuffles with ``seed + e``).
    Under DDP the global stream of ``num_tokens // batch_size`` batches is split round-robin: rank ``r`` takes
    global batches ``r, r + world, ...``, truncated to ``(num_tokens // batch_size) // world`` batches so every
    rank runs the same number of steps (a rank with one more would wait forever in the gradient all-reduce).

    Resume: :meth:`state_dict` is ``{"epoch", "yielded"}`` (batches this rank has consumed in the epoch); the
    next ``iter()`` after :meth:`load_state_dict` continues that epoch with exactly the next batch. The position
    is recomputed from the seed on indices alone (no activation is read) and then only the shards holding the
    buffered tokens are read, so a checkpoint stays tiny. It assumes the same harvest, ``batch_size``,
    ``buffer_size`` and world size as the run that saved it.
    """

    def __init__(
        self,
        store: _Store,
        *,
        batch_size: int,
        buffer_size: int,
        seed: int,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.store, self.batch_size, self.buffer_size, self.seed = store, batch_size, buffer_size, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = -1  # the epoch being (or last) iterated
        self.yielded = 0  # batches of `epoch` this rank has yielded
        self._resume: tuple[int, int] | None = None

    def _rank_world(self) -> tuple[int, int]:
        rank, world = _distributed()
        return (
            rank if self.rank is None else self.rank,
            world if self.world_size is None else self.world_size,
        )

    def num_batches(self, world_size: int = 1) -> int:
        """Batches one of ``world_size`` ranks gets per epoch."""
        return self.store.num_tokens // self.batch_size // world_size

    def __len__(self) -> int:
        # A length lets Lightning skip its one-batch prefetch, so a checkpoint's loader state is exact.
        return self.num_batches(self._rank_world()[1])

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not {"epoch", "yielded"} <= set(state):
            raise ValueError(f"not an activation stream state: {sorted(state)}")
        self.epoch, self.yielded = int(state["epoch"]), int(state["yielded"])
        self._resume = (self.epoch, self.yielded)

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        # Bookkeeping happens here, eagerly, not in the generator: the loader may ask for the state before the
        # first batch, and it must already name this epoch.
        if self._resume is not None:
            (self.epoch, self.yielded), self._resume = self._resume, None
        else:
            self.epoch, self.yielded = self.epoch + 1, 0
        rank, world = self._rank_world()
        if self.num_batches(world) == 0:
            raise ValueError(
                f"{self.store.num_tokens} training tokens make fewer than one batch of {self.batch_size} per "
                f"rank for {world} rank(s)"
            )
        return self._serve(self.batches(self.epoch, rank=rank, world_size=world, start=self.yielded))

    def _serve(self, batches: Iterator[tuple[Tensor, Tensor, Tensor]]) -> Iterator[dict[str, Tensor]]:
        for _, activations, special in batches:
            self.yielded += 1
            yield {"activations": activations, "special_mask": special}

    def batches(
        self, epoch: int, *, rank: int = 0, world_size: int = 1, start: int = 0
    ) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """``(token indices, activations, special_mask)`` of rank ``rank``'s batches of ``epoch``, from its
        ``start``-th batch on.

        The mixing buffer runs on token indices, with the activations carried along; when skipping ``start > 0``
        batches (a resume) they are only read once the first batch to yield comes up, and then only the buffered
        ones, so a resume does not replay the epoch's reads.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world size {world_size}")
        store, size, capacity = self.store, self.batch_size, self.buffer_size
        total = self.num_batches(world_size) * world_size  # global batches served this epoch
        first = start * world_size + rank  # global number of the first batch to yield
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(len(store.bounds), generator=generator).tolist()
        indices = torch.empty(0, dtype=torch.long)
        # Activations and flags of `indices`: carried along from the start, or (resuming) gathered when the first
        # batch to yield comes up.
        data: tuple[Tensor, Tensor] | None = None
        if start == 0:
            data = (torch.empty(0, store.d_in), torch.empty(0, dtype=torch.bool))
        loaded: tuple[int, Tensor, Tensor] | None = None  # the shard being read
        position, offset, number = 0, 0, 0
        while number < total:
            while len(indices) < capacity and position < len(order):  # fill
                shard = order[position]
                lo, hi = store.bounds[shard]
                take = min(capacity - len(indices), hi - lo - offset)
                indices = torch.cat([indices, torch.arange(lo + offset, lo + offset + take)])
                if data is not None:
                    if loaded is None or loaded[0] != shard:
                        loaded = (shard, *store.load(shard))
                    data = (
                        torch.cat([data[0], loaded[1][offset : offset + take]]),
                        torch.cat([data[1], loaded[2][offset : offset + take]]),
                    )
                offset += take
                if lo + offset == hi:
                    position, offset, loaded = position + 1, 0, None
            exhausted = position == len(order)
            permutation = torch.randperm(len(indices), generator=generator)  # shuffle
            indices = indices[permutation]
            if data is not None:
                data = (data[0][permutation], data[1][permutation])
            # emit: down to half a buffer (the rest mixes with the next fill), or everything at the end
            count = len(indices) // size if exhausted else max(1, (len(indices) - capacity // 2) // size)
            for i in range(min(count, total - number)):
                if number >= first and (number - rank) % world_size == 0:
                    if data is None:
                        data = store.gather(indices)
                    window = slice(i * size, (i + 1) * size)
                    # copies: a view would keep the whole buffer alive for as long as the batch is held
                    yield indices[window].clone(), data[0][window].clone(), data[1][window].clone()
                number += 1
            indices = indices[count * size :]
            if data is not None:
                data = (data[0][count * size :], data[1][count * size :])


# ------------------------------------------------------------------------------------------------ DataModule


def _chat_sft(**kwargs: Any) -> ChatSFTDataModule:
    """A ChatSFTDataModule built outside any ``__init__``: Lightning's ``save_hyperparameters`` walks up through
    enclosing ``__init__`` frames, and would otherwise record this DataModule's arguments as the SFT one's.

    Built in an empty ``contextvars.Context`` too: while the Lightning CLI instantiates this DataModule it sets a
    context variable with *our* parsed arguments, which ``save_hyperparameters`` would take as the SFT one's.
    """
    return contextvars.Context().run(ChatSFTDataModule, **kwargs)


class ActivationDataModule(L.LightningDataModule):
    r"""Backbone activations at one layer, harvested from chat dialogues, for sparse-autoencoder training.

    The dialogues come from a synthetic task or a real source, exactly as for
    :class:`~lightning_llm.datamodules.ChatSFTDataModule`, which builds the token sequences (chat template,
    truncation, packing); every token of a sequence is harvested, whatever its SFT label (template, prompt and
    response tokens alike).

    - ``mode="sequential"`` (FAST): one dialogue per sequence, cut at ``max_length`` (a dialogue whose prompt
      alone fills ``max_length`` is dropped, as in SFT, with a warning). Rows of a forward are right-padded with
      attention mask 0, so a dialogue never attends to another one.
    - ``mode="block"`` (baseline): the dialogues concatenated and cut into ``block_size`` blocks; attention
      crosses dialogue boundaries inside a block by design.

    Training batches are ``dict(activations=float32 [batch_size, d_in], special_mask=bool [batch_size])`` drawn
    through the mixing buffer (see the module docstring: per-epoch reshuffle, last partial batch dropped, DDP
    split into equal rank shares, exact mid-epoch resume through the ``StatefulDataLoader``). Validation batches
    are the held-out dialogues in the sequential format in *both* modes, so SAEs trained either way are scored
    on identical data: ``dict(input_ids long [b, T], attention_mask long [b, T], activations float32 [b, T, d_in],
    special_mask bool [b, T])`` with ``b = harvest_batch_size`` dialogues right-padded (pad id, mask 0, zero
    activations, ``False`` flags), in a fixed order.

    Harvest: without ``cache_dir`` every process harvests in :meth:`setup` into memory. With ``cache_dir`` the
    harvest happens once in :meth:`prepare_data` (once per node; set ``prepare_data_per_node = False`` when nodes
    share the file system) into ``cache_dir/<mode>-layer<ℓ>-<hash>/``:
    safetensors shards (``activations``, ``special_mask``, ``token_ids``) plus ``val.safetensors`` and a JSON
    manifest keyed by everything that determines the harvest (model, layer, mode, data arguments, lengths,
    ``num_tokens``, ``harvest_batch_size``, ``shard_tokens``, seed). Any DataModule with the same key reuses it
    without running the backbone (several SAEs from one harvest); a manifest that is unreadable, has another
    key, or lists a missing or wrongly sized file is rebuilt, never trusted. The key names a model or source,
    not its bytes: after changing a checkpoint or a data file in place, use another ``cache_dir``.

    The backbone runs on the trainer's device when a trainer is attached, otherwise on CUDA if available, and is
    moved back afterwards.

    Args:
        model: Backbone: ``"tiny"``, a Hugging Face id or a local directory (:func:`~lightning_llm.backbones.load_backbone`);
            its tokenizer renders the dialogues and must have a chat template.
        layer: Decoder layer whose output is harvested (0-based, negative counts from the end).
        mode: ``"sequential"`` (one dialogue per sequence, FAST) or ``"block"`` (packed blocks, the baseline).
        task: Registered synthetic task (``arithmetic``, ``copy``...); exactly one of ``task`` and ``source``.
        task_kwargs: The task's parameters, e.g. ``{"digits": 3, "chain_of_thought": true}``.
        source: A real dataset (local ``.json``/``.jsonl``/``.parquet``, ``save_to_disk`` directory, or Hub name).
        columns: Maps our fields (``prompt``, ``completion``, ``answer``, ``messages``) to the source's columns.
        system_prompt: Optional system message rendered before every prompt.
        num_train: Training dialogues.
        num_val: Held-out validation dialogues (their prompts never occur in training).
        max_length: Sequential mode cuts each dialogue at this many tokens; block mode's default ``block_size``.
        block_size: Block length in block mode (default ``max_length``); only valid with ``mode="block"``.
        num_tokens: Exact number of training tokens to harvest (the first ones, in data order); None takes all.
            Give the same value to both modes for a fair comparison; more than the data holds is an error.
        batch_size: Activations per training batch.
        harvest_batch_size: Sequences per backbone forward while harvesting, and dialogues per validation batch.
        buffer_size: Tokens in the shuffling buffer (at least ``batch_size``); larger mixes more, costs memory.
        cache_dir: Directory of harvests on disk; None keeps the harvest in memory.
        shard_tokens: Tokens per shard on disk (and per virtual shard in memory, so streams are identical).
        seed: Seed of the dialogues, the shuffling (``seed + epoch``) and :meth:`sample_activations`.
        trust_remote_code: Passed to ``from_pretrained`` for the backbone and its tokenizer.
    """

    def __init__(
        self,
        *,
        model: str = "tiny",
        layer: int = 1,
        mode: Literal["sequential", "block"] = "sequential",
        task: str | None = "arithmetic",
        task_kwargs: dict[str, Any] | None = None,
        source: str | None = None,
        columns: dict[str, str] | None = None,
        system_prompt: str | None = None,
        num_train: int = 2000,
        num_val: int = 64,
        max_length: int = 256,
        block_size: int | None = None,
        num_tokens: int | None = None,
        batch_size: int = 1024,
        harvest_batch_size: int = 16,
        buffer_size: int = 65536,
        cache_dir: str | None = None,
        shard_tokens: int = 65536,
        seed: int = 0,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {_MODES}")
        if block_size is not None and mode != "block":
            raise ValueError(f"block_size only applies to mode='block', but mode={mode!r}")
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        for name, value in (
            ("batch_size", batch_size),
            ("harvest_batch_size", harvest_batch_size),
            ("shard_tokens", shard_tokens),
            ("num_tokens", num_tokens),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_tokens is not None and num_tokens < batch_size:
            raise ValueError(
                f"num_tokens ({num_tokens}) must be >= batch_size ({batch_size}) to make one batch"
            )
        if buffer_size < batch_size:
            raise ValueError(
                f"buffer_size ({buffer_size}) must be >= batch_size ({batch_size}): batches are drawn from the buffer"
            )
        self.save_hyperparameters()
        # The dialogues and their token sequences are ChatSFTDataModule's (built here so that bad data arguments
        # fail now): the training sequences in this mode's packing, validation always one dialogue per sequence.
        common = dict(
            task=task, task_kwargs=task_kwargs, source=source, columns=columns, tokenizer=model,
            system_prompt=system_prompt, num_train=num_train, num_val=num_val, max_length=max_length,
            batch_size=harvest_batch_size, seed=seed, shuffle=False,
        )  # fmt: skip
        self._dialogues = _chat_sft(packing="none", **common)
        self._packed = (
            _chat_sft(packing="block", block_size=block_size, **common) if mode == "block" else None
        )
        self._backbone: PreTrainedModel | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._store: _Store | None = None
        self._val: _ValidationSet | None = None
        self._stream: _ActivationStream | None = None

    # ------------------------------------------------------------------------------------------ properties

    @property
    def backbone(self) -> PreTrainedModel:
        """The frozen backbone (eval mode, ``requires_grad`` False), loaded on first use."""
        if self._backbone is None:
            from lightning_llm.backbones import load_backbone

            model, tokenizer = load_backbone(
                self.hparams.model, trust_remote_code=self.hparams.trust_remote_code
            )
            model.eval().requires_grad_(False)
            self._backbone = model
            if self._tokenizer is None:
                self._set_tokenizer(tokenizer)
        return self._backbone

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The backbone's tokenizer (loaded without the weights when the backbone is not needed)."""
        if self._tokenizer is None:
            from lightning_llm.backbones import load_tokenizer

            self._set_tokenizer(
                load_tokenizer(self.hparams.model, trust_remote_code=self.hparams.trust_remote_code)
            )
        return self._tokenizer

    def _set_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {self.hparams.model!r} has no chat template; dialogues cannot be rendered (use a "
                "chat/instruct model or set `tokenizer.chat_template`)"
            )
        self._tokenizer = tokenizer
        # The SFT DataModules render with this very tokenizer (it honours trust_remote_code; theirs would not).
        for sft in (self._dialogues, self._packed):
            if sft is not None:
                sft._tokenizer = tokenizer

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids flagged in ``special_mask``: ``all_special_ids`` plus added tokens marked special."""
        return _special_token_ids(self.tokenizer)

    @property
    def d_in(self) -> int:
        """Activation width (the backbone's hidden size)."""
        if self._store is not None:
            return self._store.d_in
        return self.backbone.config.get_text_config().hidden_size

    @property
    def num_train_tokens(self) -> int:
        """Harvested training tokens (after :meth:`setup`)."""
        return self._ready().num_tokens

    @property
    def layer(self) -> int:
        """The harvested decoder layer, non-negative (a negative ``layer`` is resolved against the backbone)."""
        layer = self.hparams.layer
        return layer if layer >= 0 else layer_index(layer, len(decoder_layers(self.backbone)))

    @property
    def block_size(self) -> int | None:
        """Block length in block mode (``max_length`` unless ``block_size`` was given); None in sequential mode."""
        return self._packed.block_size if self._packed is not None else None

    def sample_activations(self, n: int) -> Tensor:
        """``[n, d_in]`` float32 training activations drawn without replacement, seeded by ``seed``.

        For data-dependent initialisation (the decoder bias at the geometric median, input normalisation):
        every DDP rank gets the same sample. Reads shard by shard, so it holds ``n`` rows plus one shard.
        """
        store = self._ready()
        if not 1 <= n <= store.num_tokens:
            raise ValueError(f"cannot sample {n} activations from {store.num_tokens} harvested tokens")
        indices = torch.tensor(random.Random(self.hparams.seed).sample(range(store.num_tokens), n))
        return store.gather(indices)[0]

    # ----------------------------------------------------------------------------------------- Lightning

    def prepare_data(self) -> None:
        """With ``cache_dir``: harvest to disk unless a valid harvest with the same key is there (once per node)."""
        if self.hparams.cache_dir is not None:
            self._cached()

    def setup(self, stage: str | None = None) -> None:
        """Load the cached harvest, or harvest into memory without ``cache_dir``."""
        if self._store is not None:
            return
        if self.hparams.cache_dir is not None:
            directory, manifest = self._cached()
            from safetensors.torch import load_file

            store: _Store = _ShardStore(directory, manifest)
            val = _ValidationSet(**load_file(directory / _VAL_FILE))
        else:
            train_rows, val_rows = self.sequences()
            writer = _Writer(self.hparams.shard_tokens)
            val = self._run_harvest(train_rows, val_rows, writer)
            store = writer.finish_memory()
        if store.num_tokens < self.hparams.batch_size:
            raise ValueError(
                f"{store.num_tokens} training tokens make fewer than one batch of "
                f"batch_size={self.hparams.batch_size}"
            )
        self._store, self._val = store, val
        self._stream = _ActivationStream(
            store,
            batch_size=self.hparams.batch_size,
            buffer_size=self.hparams.buffer_size,
            seed=self.hparams.seed,
        )

    def train_dataloader(self) -> StatefulDataLoader:
        # One stream for the DataModule's life: it counts the epochs that seed the shuffles.
        return StatefulDataLoader(self._ready_stream(), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        if self._val is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for a dataloader")
        return DataLoader(
            self._val,
            batch_size=self.hparams.harvest_batch_size,
            shuffle=False,
            collate_fn=_ValidationCollator(self.tokenizer.pad_token_id),
        )

    # ------------------------------------------------------------------------------------------- harvest

    def _ready(self) -> _Store:
        if self._store is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() first")
        return self._store

    def _ready_stream(self) -> _ActivationStream:
        self._ready()
        assert self._stream is not None
        return self._stream

    def sequences(self) -> tuple[list[Tensor], list[Tensor]]:
        """Token ids of the rows the backbone reads: training rows (dialogues or blocks, cut to ``num_tokens``)
        and validation dialogues. What one forward of the harvest sees, row by row (for inspection).
        """
        self.tokenizer  # noqa: B018  (shares the tokenizer with the SFT DataModules)
        train, val = self._dialogues._examples()
        builder = self._packed or self._dialogues
        train_items, _ = builder._build(train, [])
        val_items = self._dialogues._build(val, [])[0] if val else []
        rows = [item["input_ids"] for item in train_items]
        available = sum(len(row) for row in rows)
        num_tokens = self.hparams.num_tokens
        if num_tokens is not None:
            if num_tokens > available:
                raise ValueError(
                    f"num_tokens={num_tokens} but the {self.hparams.mode} training data has only {available} "
                    f"tokens (num_train={self.hparams.num_train}, max_length={self.hparams.max_length}); lower "
                    "num_tokens or raise num_train"
                )
            used = 0
            for count, row in enumerate(rows, start=1):
                used += len(row)
                if used >= num_tokens:
                    rows = rows[:count]
                    break
        return rows, [item["input_ids"] for item in val_items]

    def _run_harvest(
        self, train_rows: list[Tensor], val_rows: list[Tensor], writer: _Writer
    ) -> _ValidationSet:
        """Harvest the training rows into ``writer`` (exactly ``num_tokens`` tokens) and the validation set."""
        model, hp = self.backbone, self.hparams
        special_ids = torch.tensor(sorted(self.special_token_ids))
        budget = hp.num_tokens if hp.num_tokens is not None else sum(len(row) for row in train_rows)
        device = self._harvest_device()
        home = next(model.parameters()).device
        model.to(device)
        try:
            harvest = _harvest(
                model,
                hp.layer,
                train_rows,
                batch_size=hp.harvest_batch_size,
                pad_id=self.tokenizer.pad_token_id,
            )
            with contextlib.closing(harvest):
                for activations, token_ids in harvest:
                    take = min(budget, len(token_ids))
                    budget -= take
                    writer.add(
                        activations[:take], torch.isin(token_ids[:take], special_ids), token_ids[:take]
                    )
                    if budget == 0:
                        break
            chunks = list(
                _harvest(
                    model,
                    hp.layer,
                    val_rows,
                    batch_size=hp.harvest_batch_size,
                    pad_id=self.tokenizer.pad_token_id,
                )
            )
        finally:
            model.to(home)
        activations = torch.cat([a for a, _ in chunks]) if chunks else torch.zeros(0, self.d_in)
        token_ids = torch.cat([t for _, t in chunks]) if chunks else torch.zeros(0, dtype=torch.long)
        lengths = torch.tensor([len(row) for row in val_rows], dtype=torch.long)
        return _ValidationSet(activations, torch.isin(token_ids, special_ids), token_ids, lengths)

    def _harvest_device(self) -> torch.device:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.strategy.root_device
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # --------------------------------------------------------------------------------------------- cache

    def cache_key(self) -> dict[str, Any]:
        """Everything that determines the harvest; its hash names the cache directory."""
        hp = self.hparams
        key = {
            "format": _FORMAT,
            "model": hp.model,
            "layer": hp.layer,
            "mode": hp.mode,
            "task": hp.task,
            "task_kwargs": hp.task_kwargs or {},
            "source": hp.source,
            "columns": hp.columns or {},
            "system_prompt": hp.system_prompt,
            "num_train": hp.num_train,
            "num_val": hp.num_val,
            "max_length": hp.max_length,
            "block_size": self.block_size,
            "num_tokens": hp.num_tokens,
            "harvest_batch_size": hp.harvest_batch_size,
            "shard_tokens": hp.shard_tokens,
            "seed": hp.seed,
        }
        return json.loads(json.dumps(key, sort_keys=True, default=repr))  # as the manifest will read back

    @property
    def cache_path(self) -> Path | None:
        """Directory of this DataModule's harvest under ``cache_dir`` (None without one)."""
        if self.hparams.cache_dir is None:
            return None
        digest = hashlib.sha256(json.dumps(self.cache_key(), sort_keys=True).encode()).hexdigest()[:16]
        return (
            Path(self.hparams.cache_dir).expanduser()
            / f"{self.hparams.mode}-layer{self.hparams.layer}-{digest}"
        )

    def _cached(self) -> tuple[Path, dict[str, Any]]:
        """``(directory, manifest)`` of a valid harvest with this key, harvesting it first if needed."""
        target = self.cache_path
        assert target is not None
        manifest, problem = _check_cache(target, self.cache_key())
        if manifest is not None:
            return target, manifest
        if target.exists():
            warnings.warn(f"rebuilding the activation cache at {target}: {problem}", stacklevel=3)
        train_rows, val_rows = self.sequences()
        target.parent.mkdir(parents=True, exist_ok=True)
        # Written beside the target and renamed: a crash leaves only a temporary directory, never a cache that
        # looks complete, and concurrent writers (nodes sharing a file system) race on an atomic rename.
        staging = Path(tempfile.mkdtemp(prefix=".harvest-", dir=target.parent))
        try:
            writer = _Writer(self.hparams.shard_tokens, staging)
            val = self._run_harvest(train_rows, val_rows, writer)
            shards = writer.finish_disk()
            from safetensors.torch import save_file

            save_file({key: value.contiguous() for key, value in val.tensors().items()}, staging / _VAL_FILE)
            manifest = {
                "key": self.cache_key(),
                "d_in": writer.d_in or self.d_in,
                "num_tokens": sum(shard["tokens"] for shard in shards),
                "special_token_ids": sorted(self.special_token_ids),
                "shards": shards,
                "val": {"file": _VAL_FILE, "bytes": (staging / _VAL_FILE).stat().st_size},
            }
            (staging / _MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
            staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary shared directory
            # Replace only what is still invalid now: another writer may have finished in the meantime.
            if _check_cache(target, self.cache_key())[0] is None:
                shutil.rmtree(target, ignore_errors=True)
                try:
                    staging.rename(target)
                except OSError:
                    if _check_cache(target, self.cache_key())[0] is None:  # accept only a valid winner
                        raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        manifest, problem = _check_cache(target, self.cache_key())
        if manifest is None:
            raise RuntimeError(f"the activation cache just written at {target} is invalid: {problem}")
        return target, manifest


def _check_cache(directory: Path, key: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)`` when ``directory`` holds a complete harvest for ``key``, else ``(None, why not)``."""
    path = directory / _MANIFEST
    if not path.is_file():
        return None, "no manifest (missing or partially written harvest)"
    try:
        manifest = json.loads(path.read_text())
        if manifest["key"] != key:
            return None, "the manifest's key differs from this DataModule's"
        files = [*manifest["shards"], manifest["val"]]
        for entry in files:
            file = directory / entry["file"]
            if not file.is_file():
                return None, f"missing file {entry['file']}"
            if file.stat().st_size != entry["bytes"]:
                return None, f"size mismatch for {entry['file']}"
        if sum(int(shard["tokens"]) for shard in manifest["shards"]) != manifest["num_tokens"]:
            return None, "shard token counts do not add up to num_tokens"
        int(manifest["d_in"])
    except (ValueError, KeyError, TypeError) as error:
        return None, f"unreadable manifest ({type(error).__name__}: {error})"
    return manifest, None
