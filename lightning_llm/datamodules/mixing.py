"""The training stream of harvested activations: a seeded mixing buffer, split across DDP ranks, resumable.

Harvested tokens are served through a *mixing buffer* of ``buffer_size`` tokens: fill it (from the shards, in an
epoch-seeded shard order, each shard in stored order), shuffle it, emit batches from it until it is at most half
full, refill, and so on; when the data is exhausted the rest of the buffer is emitted in full batches and the
last partial batch (fewer than ``batch_size`` tokens) is dropped. An epoch therefore serves every token at most
once, exactly once when the token count is a multiple of ``batch_size``, and is reshuffled with ``seed + epoch``.
A buffer at least as large as the harvest is a full uniform shuffle. Training holds the buffer and one shard:
at most about ``(2 × buffer_size + shard_tokens) × d_in × 4`` bytes (shuffling copies the buffer once).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from lightning_llm.datamodules.activation_store import ActivationStore

__all__ = ["ActivationStream"]


def _distributed() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised default process group, else ``(0, 1)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class ActivationStream(IterableDataset):
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
        store: ActivationStore,
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
