r"""Residual-stream activations of a frozen backbone, harvested from chat dialogues, for training sparse autoencoders.

:class:`ActivationDataModule` harvests one decoder layer of a backbone in FAST's sequential format or in the
block baseline (:mod:`~lightning_llm.datamodules.activation_harvest`), from the same dialogues and with the same
token budget, so the two can be compared fairly; keeps the harvest in memory or in a verified on-disk cache
(:mod:`~lightning_llm.datamodules.activation_store`); serves it through a seeded mixing buffer
(:mod:`~lightning_llm.datamodules.mixing`); and always validates on held-out dialogues in the sequential
(deployment) format. Validation activations (``num_val`` dialogues) are held in memory.
"""

from __future__ import annotations

import hashlib
import json
import random
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_llm.backbones.cache import cached_directory
from lightning_llm.backbones.inspect import decoder_layers, layer_index
from lightning_llm.datamodules.activation_harvest import dialogue_rows, harvest, special_token_ids
from lightning_llm.datamodules.activation_store import (
    ActivationStore,
    ShardWriter,
    ValidationSet,
    check_harvest,
    load_harvest,
)
from lightning_llm.datamodules.chat_sft import ChatSFTDataModule
from lightning_llm.datamodules.mixing import ActivationStream
from lightning_llm.datamodules.sources import pad_sequences

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["ActivationDataModule"]

_MODES = ("sequential", "block")
#: Version of the on-disk layout; part of the cache key, so a layout change never reads an old cache.
_FORMAT = 1


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
    through the mixing buffer (:mod:`~lightning_llm.datamodules.mixing`: per-epoch reshuffle, last partial batch
    dropped, DDP split into equal rank shares, exact mid-epoch resume through the ``StatefulDataLoader``). Validation batches
    are the held-out dialogues in the sequential format in *both* modes, so SAEs trained either way are scored
    on identical data: ``dict(input_ids long [b, T], attention_mask long [b, T], activations float32 [b, T, d_in],
    special_mask bool [b, T])`` with ``b = harvest_batch_size`` dialogues right-padded (pad id, mask 0, zero
    activations, ``False`` flags), in a fixed order.

    Harvest: without ``cache_dir`` every process harvests in :meth:`setup` into memory. With ``cache_dir`` the
    harvest happens once in :meth:`prepare_data` (once per node; set ``prepare_data_per_node = False`` when nodes
    share the file system) into ``cache_dir/<mode>-layer<ℓ>-<hash>/``
    (:mod:`~lightning_llm.datamodules.activation_store`): safetensors shards (``activations``, ``special_mask``,
    ``token_ids``) plus ``val.safetensors`` and a JSON manifest keyed by everything that determines the harvest
    (model, layer, mode, data arguments, lengths, ``num_tokens``, ``harvest_batch_size``, ``shard_tokens``,
    seed). It is built once, under a file lock and renamed into place, by
    :func:`~lightning_llm.backbones.cache.cached_directory`. Any DataModule with the same key reuses it without
    running the backbone (several SAEs from one harvest); a manifest that is unreadable or has another key, or a
    file that is missing or differs from its recorded size or SHA-256, is rebuilt, never trusted. The key names a
    model or source, not its bytes: after changing a checkpoint or a data file in place, use another
    ``cache_dir``.

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
        # The dialogues and their token sequences are ChatSFTDataModule's, built by `sequences`; constructing one
        # here checks the data arguments now, with its errors.
        packing = {"packing": "block", "block_size": block_size} if mode == "block" else {}
        ChatSFTDataModule(**packing, **self._data_arguments())
        self._backbone: PreTrainedModel | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._store: ActivationStore | None = None
        self._val: ValidationSet | None = None
        self._stream: ActivationStream | None = None

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
        """The backbone's tokenizer (loaded without the weights when the backbone is not needed); it renders the
        dialogues."""
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

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids flagged in ``special_mask``: ``all_special_ids`` plus added tokens marked special."""
        return special_token_ids(self.tokenizer)

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
        if self.hparams.mode != "block":
            return None
        return self.hparams.block_size or self.hparams.max_length

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
        store: ActivationStore
        if self.hparams.cache_dir is not None:
            store, val = load_harvest(self._cached())
        else:
            writer = ShardWriter(self.hparams.shard_tokens)
            val = self._harvest(writer)
            store = writer.to_memory()
        if store.num_tokens < self.hparams.batch_size:
            raise ValueError(
                f"{store.num_tokens} training tokens make fewer than one batch of "
                f"batch_size={self.hparams.batch_size}"
            )
        self._store, self._val = store, val
        self._stream = ActivationStream(
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

    def _ready(self) -> ActivationStore:
        if self._store is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() first")
        return self._store

    def _ready_stream(self) -> ActivationStream:
        self._ready()
        assert self._stream is not None
        return self._stream

    def _data_arguments(self) -> dict[str, Any]:
        """The arguments of the :class:`~lightning_llm.datamodules.ChatSFTDataModule` of the dialogues."""
        hp = self.hparams
        return dict(
            task=hp.task, task_kwargs=hp.task_kwargs, source=hp.source, columns=hp.columns,
            system_prompt=hp.system_prompt, num_train=hp.num_train, num_val=hp.num_val, max_length=hp.max_length,
            batch_size=hp.harvest_batch_size, seed=hp.seed, shuffle=False,
        )  # fmt: skip

    def sequences(self) -> tuple[list[Tensor], list[Tensor]]:
        """Token ids of the rows the backbone reads: training rows (dialogues or blocks, cut to ``num_tokens``)
        and validation dialogues. What one forward of the harvest sees, row by row (for inspection).
        """
        return dialogue_rows(
            self.tokenizer,
            mode=self.hparams.mode,
            block_size=self.block_size,
            num_tokens=self.hparams.num_tokens,
            **self._data_arguments(),
        )

    def _harvest(self, writer: ShardWriter) -> ValidationSet:
        """Harvest the training rows into ``writer`` (exactly ``num_tokens`` tokens); the validation set."""
        train_rows, val_rows = self.sequences()
        hp = self.hparams
        return harvest(
            self.backbone,
            hp.layer,
            train_rows,
            val_rows,
            writer,
            num_tokens=hp.num_tokens,
            batch_size=hp.harvest_batch_size,
            pad_id=self.tokenizer.pad_token_id,
            special_ids=self.special_token_ids,
            device=self._harvest_device(),
        )

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

    def _cached(self) -> Path:
        """The directory of a valid harvest with this key, harvesting it first if needed."""
        target, key = self.cache_path, self.cache_key()
        assert target is not None
        return cached_directory(
            target, self._harvest_into, what="activation", check=partial(check_harvest, key=key)
        )

    def _harvest_into(self, directory: Path) -> dict[str, Any]:
        """Harvest into the empty ``directory``; the manifest record (key, special token ids, files)."""
        writer = ShardWriter(self.hparams.shard_tokens, directory)
        files = writer.to_disk(self._harvest(writer))
        return {"key": self.cache_key(), "special_token_ids": sorted(self.special_token_ids), **files}
