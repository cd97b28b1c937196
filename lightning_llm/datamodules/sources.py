"""Where examples come from: a synthetic task or a real dataset, and the DataModule base that builds on either.

Real data is a local ``.json`` / ``.jsonl`` / ``.parquet`` file or anything ``datasets.load_dataset`` accepts
(a Hub name, a local data directory), mapped onto :class:`~lightning_llm.datamodules.tasks.Example` by a column
mapping. Bad data fails at load time with the file, the line (JSONL) or index, and the column in the message:
a silently skipped record is a silently different experiment.
"""

from __future__ import annotations

import json
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import lightning as L
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

from lightning_llm.backbones import apply_chat_template, stop_token_ids, turn_end_token_id
from lightning_llm.datamodules.tasks import Task, get_task, split_train_val
from lightning_llm.datamodules.tokenizer import check_same_tokenizer, model_tokenizer, resolve_tokenizer
from lightning_llm.text import DataSourceError, PromptPrefix, prefix_messages, read_jsonl, read_text_records
from lightning_llm.types import IGNORE_INDEX, Example

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DataSourceError",
    "EpochSampler",
    "ExampleDataModule",
    "epoch_sampler",
    "load_records",
    "pad_sequences",
    "read_text_records",
    "render_prompt",
]

FIELDS = ("prompt", "completion", "answer")
_MESSAGES = "messages"
_LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")


def load_records(
    source: str,
    *,
    split: str = "train",
    columns: Mapping[str, str] | None = None,
    required: Sequence[str] = ("prompt", "completion"),
    string_columns: Sequence[str] = (),
) -> list[Example]:
    """Load a dataset as :class:`Example` s.

    Args:
        source: A local ``.json`` (a list of objects, or ``{"data": [...]}``), ``.jsonl`` or ``.parquet`` file;
            a directory written by ``Dataset.save_to_disk``; otherwise anything ``datasets.load_dataset``
            accepts (a Hub name, a local data directory).
        split: The split to load; local files have a single split and ignore it.
        columns: Maps our fields (``prompt``, ``completion``, ``answer``, ``messages``) to the source's column
            names; unmapped fields are looked up under their own name.
        required: The fields every record must have; a missing optional field becomes ``""``.
        string_columns: Further source columns every record must hold as strings (they go to ``metadata``),
            e.g. a preference pair's ``chosen`` and ``rejected``.

    A record without a prompt column but with a ``messages`` column (a chat: a list of ``{"role", "content"}``)
    gives the last user message as prompt and, when the chat ends with an assistant message, that message as
    completion. Earlier turns and system messages are not kept. Columns not consumed go to ``metadata``, so
    reward functions can use them.
    """
    mapping = dict(columns or {})
    unknown = sorted(set(mapping) - {*FIELDS, _MESSAGES}) + sorted(set(required) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; fields are {[*FIELDS, _MESSAGES]}")
    examples = [
        _to_example(record, where, mapping, required, string_columns)
        for where, record in _read(source, split)
    ]
    if not examples:
        raise DataSourceError(f"{source}: no records (empty file or split {split!r})")
    return examples


def _read(source: str, split: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Yield ``(location, record)``; ``location`` is what an error message shows to find the record."""
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if suffix in _LOCAL_SUFFIXES and not path.is_file():
        raise FileNotFoundError(f"{source}: no such file")
    if suffix == ".jsonl":
        yield from read_jsonl(path)
    elif suffix == ".json":
        yield from _read_json(path)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        for index, record in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}, index {index}", record
    else:
        import datasets

        if path.is_dir() and any((path / name).is_file() for name in ("state.json", "dataset_dict.json")):
            dataset = datasets.load_from_disk(str(path))
            if isinstance(dataset, datasets.DatasetDict):
                dataset = dataset[split]
        else:
            dataset = datasets.load_dataset(source, split=split)
        for index, record in enumerate(dataset):
            yield f"{source} (split {split!r}), index {index}", record


def _read_json(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DataSourceError(
            f"{path}, line {error.lineno}: malformed JSON ({error.msg} at column {error.colno})"
        ) from None
    records = document.get("data") if isinstance(document, dict) else document
    if not isinstance(records, list):
        raise DataSourceError(f"{path}: expected a JSON list of objects or an object with a 'data' list")
    for index, record in enumerate(records):
        where = f"{path}, index {index}"
        if not isinstance(record, dict):
            raise DataSourceError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield where, record


def _to_example(
    record: Mapping[str, Any],
    where: str,
    mapping: Mapping[str, str],
    required: Sequence[str],
    string_columns: Sequence[str] = (),
) -> Example:
    names = {name: mapping.get(name, name) for name in (*FIELDS, _MESSAGES)}
    values: dict[str, str] = {}
    consumed = set()
    if names["prompt"] not in record and names[_MESSAGES] in record:
        values = _from_messages(record[names[_MESSAGES]], where, names[_MESSAGES])
        consumed.add(names[_MESSAGES])
    for name in FIELDS:
        column = names[name]
        value = record.get(column)
        if value is None:  # datasets and Parquet write null where a record lacks an optional column
            if name in required and name not in values:
                state = "null in" if column in record else "missing column"
                renamed = f" (mapped from field {name!r})" if column != name else ""
                hint = f" or a {names[_MESSAGES]!r} column" if name != "answer" else ""
                raise DataSourceError(
                    f"{where}: {state} {column!r}{renamed}{hint}; the record has columns {sorted(record)}"
                )
        elif isinstance(value, str):
            values[name] = value
        else:
            raise DataSourceError(
                f"{where}: column {column!r} must hold a string, got {type(value).__name__} {_preview(value)}"
            )
        if column in record:
            consumed.add(column)
    for column in string_columns:
        value = record.get(column)
        if value is None:
            raise DataSourceError(
                f"{where}: {'null in' if column in record else 'missing column'} {column!r}; every record needs "
                f"string columns {list(string_columns)}; the record has columns {sorted(record)}"
            )
        if not isinstance(value, str):
            raise DataSourceError(
                f"{where}: column {column!r} must hold a string, got {type(value).__name__} {_preview(value)}"
            )
    metadata = {key: value for key, value in record.items() if key not in consumed}
    return Example(
        prompt=values.get("prompt", ""),
        completion=values.get("completion", ""),
        answer=values.get("answer", ""),
        metadata=metadata,
    )


def _from_messages(messages: Any, where: str, column: str) -> dict[str, str]:
    """``prompt`` (last user message) and, if the chat ends with the assistant, ``completion``."""
    if not isinstance(messages, list) or not all(
        isinstance(message, Mapping)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
        for message in messages
    ):
        raise DataSourceError(
            f"{where}: column {column!r} must be a list of {{'role': str, 'content': str}} objects, got "
            f"{_preview(messages)}"
        )
    values = {}
    if messages and messages[-1]["role"] == "assistant":
        values["completion"] = messages[-1]["content"]
        messages = messages[:-1]
    users = [message["content"] for message in messages if message["role"] == "user"]
    if not users:
        raise DataSourceError(f"{where}: column {column!r} has no user message to use as the prompt")
    values["prompt"] = users[-1]
    return values


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, system_prompt: PromptPrefix = None) -> str:
    """``[system_prompt's messages…, user=prompt]`` chat-templated up to and including the assistant header, as
    generated from (``system_prompt``: a system message, or messages; see :func:`~lightning_llm.text.prefix_messages`).

    How every DataModule renders its prompts; also for callbacks that build prompts of their own (LARFT's
    hindsight word-count task) so that they reach the model exactly as the task's prompts do.
    """
    messages = prefix_messages(system_prompt)
    messages.append({"role": "user", "content": prompt})
    return apply_chat_template(tokenizer, messages, add_generation_prompt=True)


class EpochSampler(DistributedSampler):
    """The training order: pass ``k`` of the sampler is the ``k``-th permutation that
    ``StatefulDataLoader(shuffle=True, generator=torch.Generator().manual_seed(seed))`` draws (with
    ``shuffle=False``: the stored order), and under DDP rank ``r`` takes ``order[r::num_replicas]`` of it, padded
    as ``DistributedSampler`` pads. Its ``state_dict`` (the pass and the indices yielded in it) makes a resume
    exact in that pass and every later one.

    A loader's generator draws one permutation and one 64-bit base seed each time it is iterated, and a resumed
    ``StatefulDataLoader`` restores neither the generator nor the draws after the permutation, so the passes after
    a resume were shuffled differently. Here the order is a function of ``(seed, pass)``: permutation ``k`` is
    computed by replaying that draw sequence from the seed, so one process draws exactly the order the
    generator did, and a ``DistributedSampler`` (which Lightning keeps under DDP instead of replacing it) deals
    that same order to the ranks, so ``W`` ranks with batches of ``B`` read what one process reads with ``W·B``.

    The pass counts the sampler's iterations, as the generator did (an iteration started and not finished
    counts; a new loader starts at pass 0). Lightning's ``set_epoch`` is recorded in ``epoch`` but does not move
    the pass: Lightning iterates the training loader once per epoch, so pass and epoch agree, and a loader
    rebuilt every epoch (``reload_dataloaders_every_n_epochs``) keeps the orders it had.

    Args:
        dataset: A sized dataset.
        num_replicas: Number of ranks (``1``: all the data).
        rank: This rank.
        shuffle: Shuffle (else the stored order).
        seed: Seed of the shuffle.
    """

    def __init__(
        self, dataset: Any, *, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.passes = 0  # iterations started
        self.yielded = 0  # indices yielded in the current pass
        self._current = 0  # the pass being iterated
        self._resume: tuple[int, int] | None = None  # (pass, yielded) from load_state_dict
        self._drawn: tuple[int, torch.Generator] | None = None  # permutations drawn so far, and the generator

    def order(self, pass_: int) -> list[int]:
        """The indices of pass ``pass_`` over all ranks, before dealing (length ``len(dataset)``)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        if self._drawn is None or self._drawn[0] > pass_:
            self._drawn = (0, torch.Generator().manual_seed(self.seed))
        drawn, generator = self._drawn
        for _ in range(drawn, pass_):  # replay: each earlier pass drew a permutation, then the loader's seed
            torch.randperm(n, generator=generator)
            torch.empty((), dtype=torch.int64).random_(generator=generator)
        self._drawn = (pass_, generator)
        return torch.randperm(n, generator=generator.clone_state()).tolist()

    def _shard(self, indices: list[int]) -> list[int]:
        if self.drop_last:
            indices = indices[: self.total_size]
        elif (padding := self.total_size - len(indices)) > 0:
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        return indices[self.rank : self.total_size : self.num_replicas]

    @override
    def __iter__(self) -> Iterator[int]:
        current, start = self._resume if self._resume is not None else (self.passes, 0)
        self._resume = None
        self._current, self.yielded, self.passes = current, start, current + 1
        return self._yield(self._shard(self.order(current))[start:])

    def _yield(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self.yielded += 1
            yield index

    @override
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch  # recorded only: the order follows the passes (see the class docstring)

    def state_dict(self) -> dict[str, Any]:
        return {"pass": self._current, "yielded": self.yielded}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The next iteration continues pass ``state_dict["pass"]`` after its first ``yielded`` indices."""
        current, yielded = int(state_dict["pass"]), int(state_dict["yielded"])
        if current < 0 or yielded < 0:
            raise ValueError(f"EpochSampler: invalid state {state_dict}")
        self._resume = (current, yielded)
        self._current, self.yielded, self.passes = current, yielded, current


def epoch_sampler(data: Any, trainer: L.Trainer | None, *, shuffle: bool, seed: int) -> EpochSampler:
    """The training sampler of ``data``: an :class:`EpochSampler`, dealing to this rank under DDP."""
    replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
    return EpochSampler(data, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed)


def pad_sequences(sequences: Sequence[torch.Tensor], value: int, *, left: bool = False) -> torch.Tensor:
    """Stack 1-D tensors into ``[B, max_len]``, filling with ``value`` on the right (or the left)."""
    length = max(len(sequence) for sequence in sequences)
    out = torch.full((len(sequences), length), value, dtype=sequences[0].dtype)
    for row, sequence in zip(out, sequences, strict=True):
        if left:
            row[length - len(sequence) :] = sequence
        else:
            row[: len(sequence)] = sequence
    return out


class ExampleDataModule(L.LightningDataModule, ABC):
    """Base of the DataModules: examples from a synthetic task or a real source, rendered by a chat template.

    Subclasses decide what a training item is (:meth:`_build`) and how items are batched (:meth:`_collator`).
    Data is built in :meth:`setup`, so each DDP process builds its own (cheap: generation and tokenization are
    deterministic); the train loader is a ``StatefulDataLoader``, whose position Lightning stores in
    checkpoints, so a mid-epoch resume continues with exactly the next batch.

    Args:
        task: Name of a registered synthetic task (``arithmetic``, ``copy``...); exactly one of ``task`` and
            ``source`` must be set (set ``task`` to null to use a source).
        task_kwargs: The task's parameters, e.g. ``{"digits": 3, "chain_of_thought": true}``.
        source: A real dataset: a local ``.json``/``.jsonl``/``.parquet`` file, a ``save_to_disk`` directory,
            or a Hugging Face dataset name or data directory.
        columns: Maps our fields (``prompt``, ``completion``, ``answer``, ``messages``) to the source's columns.
        split: Training split of a dataset source (local files have one split and ignore it).
        val_split: Validation split of a dataset source; None holds out ``num_val`` records of the training
            split instead. Validation prompts never appear in training either way.
        tokenizer: ``None`` (default): the tokenizer of the model this DataModule is fitted with (the tiny one
            when used without a Trainer). A name or path loads that tokenizer instead, and fitting it with a
            model whose tokenizer differs raises :class:`~lightning_llm.datamodules.tokenizer.TokenizerMismatchError`.
            It must have a chat template.
        system_prompt: Optional system message rendered before every prompt. ``"task"``: the synthetic task's
            own instructions (its answer format as the system message, then one worked user/assistant exchange
            taken from the training split), so that an instruct model can follow the task zero-shot.
        num_train: Number of training examples (for a source: at most this many, a seeded random subset).
        num_val: Number of validation examples (for a source: at most this many).
        batch_size: Examples per batch.
        max_length: Token budget of one sequence. SFT cuts the response beyond it (the prompt is kept) and
            packs blocks of this length unless ``block_size`` is given; RL drops longer prompts.
        seed: Seed of example generation, subsampling and the training order.
        shuffle: Whether the training order is reshuffled every epoch.
        num_workers: DataLoader worker processes.
    """

    #: Fields every record of a real source must have.
    _required: ClassVar[tuple[str, ...]]

    def __init__(
        self,
        *,
        task: str | None = "arithmetic",
        task_kwargs: dict[str, Any] | None = None,
        source: str | None = None,
        columns: dict[str, str] | None = None,
        split: str = "train",
        val_split: str | None = None,
        tokenizer: str | None = None,
        system_prompt: str | None = None,
        num_train: int = 1000,
        num_val: int = 100,
        batch_size: int = 8,
        max_length: int = 256,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if (task is None) == (source is None):
            raise ValueError(
                f"give exactly one of `task` and `source` (got task={task!r}, source={source!r}); to use a real "
                "source set task=None (--data.task null)"
            )
        if task is None and task_kwargs:
            raise ValueError("`task_kwargs` only apply to a synthetic task, but task=None")
        if source is None and (columns or val_split is not None):
            raise ValueError("`columns` and `val_split` only apply to a real source, but source=None")
        if source is not None and val_split is not None and Path(source).suffix.lower() in _LOCAL_SUFFIXES:
            raise ValueError(
                f"{source}: a local file has a single split; leave val_split=None to hold out data"
            )
        for name, value, minimum in (
            ("num_train", num_train, 1),
            ("num_val", num_val, 0),
            ("batch_size", batch_size, 1),
            ("max_length", max_length, 2),
            ("num_workers", num_workers, 0),
        ):
            if value < minimum:
                raise ValueError(f"{name} must be >= {minimum}, got {value}")
        if system_prompt == "task" and task is None:
            raise ValueError("system_prompt='task' states a synthetic task's format, but task=None")
        self.save_hyperparameters()
        self._task = get_task(task, **(task_kwargs or {})) if task is not None else None
        self._split: tuple[list[Example], list[Example]] | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._train_data: list[Any] | None = None
        self._val_data: list[Any] | None = None
        self._val_examples: list[Example] | None = None

    @property
    def task(self) -> Task | None:
        """The synthetic task (its ``score`` is the verifier), or None for a real source."""
        return self._task

    @property
    def system_prompt(self) -> PromptPrefix:
        """What is rendered before every prompt (evaluation callbacks generate with it too): the system message,
        or for ``system_prompt="task"`` the messages of :meth:`~lightning_llm.datamodules.tasks.Task.prompt_prefix`
        with the first training example."""
        if self.hparams.system_prompt == "task":
            assert self._task is not None  # refused at construction otherwise
            return self._task.prompt_prefix(self._examples()[0][0])
        return self.hparams.system_prompt

    @property
    def val_examples(self) -> list[Example]:
        """The held-out examples, in a fixed order (built by :meth:`setup`)."""
        if self._val_examples is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for val_examples")
        return self._val_examples

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer (see ``tokenizer`` in the class docstring), resolved on first use so that building a
        DataModule stays cheap."""
        if self._tokenizer is None:
            tokenizer = resolve_tokenizer(self, self.hparams.tokenizer)
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(
                    f"tokenizer {self.hparams.tokenizer or tokenizer.name_or_path!r} has no chat template; use a "
                    "chat/instruct model's tokenizer or set `tokenizer.chat_template`"
                )
            self._tokenizer = tokenizer
        return self._tokenizer

    def use_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Tokenize with this tokenizer object (e.g. a DataModule built inside another one's ``setup``, which has
        no Trainer of its own to take the model's from); call before :meth:`setup`."""
        if self._train_data is not None:
            raise RuntimeError(f"{type(self).__name__}: use_tokenizer() must come before setup()")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
        self._tokenizer = tokenizer

    @property
    def train_items(self) -> list[Any]:
        """The built training items (after :meth:`setup`), in their stored order."""
        return list(self._built(self._train_data))

    def replace_train_items(self, items: list[Any]) -> None:
        """Swap in new training items (a curriculum's rebuilt data); the next ``train_dataloader()`` uses them.

        Items must be what :meth:`_build` makes for this DataModule (e.g. ``input_ids``/``labels`` dicts for
        SFT). Lightning only asks for a new loader when ``reload_dataloaders_every_n_epochs`` says so.
        """
        if not items:
            raise ValueError(f"{type(self).__name__}: replace_train_items needs at least one item")
        self._train_data = list(items)

    def prepare_data(self) -> None:
        """Build (or download) the tokenizer once, on one process, before every process loads it."""
        self.tokenizer  # noqa: B018

    def setup(self, stage: str | None = None) -> None:
        fitted = model_tokenizer(self)
        if self.hparams.tokenizer is None and fitted is not None and fitted is not self._tokenizer:
            # "the model's tokenizer": data built earlier with another one (standalone use) is rebuilt
            self._tokenizer = None
            self._train_data = self._val_data = self._val_examples = None
        check_same_tokenizer(self, self.tokenizer, self.hparams.tokenizer)
        if self._train_data is not None:
            return
        train, val = self._examples()
        self._val_examples = val
        self._train_data, self._val_data = self._build(train, val)

    def train_dataloader(self) -> StatefulDataLoader:
        data = self._built(self._train_data)
        return StatefulDataLoader(
            data,
            batch_size=self.hparams.batch_size,
            sampler=epoch_sampler(data, self.trainer, shuffle=self.hparams.shuffle, seed=self.hparams.seed),
            collate_fn=self._collator(),
            num_workers=self.hparams.num_workers,
            # the loader draws its base seeds from this generator, not from the global RNG
            generator=torch.Generator().manual_seed(self.hparams.seed),
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self._built(self._val_data),
            batch_size=self.hparams.batch_size,
            shuffle=False,
            collate_fn=self._collator(),
            num_workers=self.hparams.num_workers,
        )

    @abstractmethod
    def _build(self, train: list[Example], val: list[Example]) -> tuple[list[Any], list[Any]]:
        """Turn the train and validation examples into dataset items (tokenized)."""

    @abstractmethod
    def _collator(self) -> Callable[[list[Any]], dict[str, Any]]:
        """The batch collator: a picklable object, so that worker processes can use it."""

    def _examples(self) -> tuple[list[Example], list[Example]]:
        hp = self.hparams
        if self._task is not None:
            if self._split is None:
                self._split = split_train_val(self._task, hp.num_train, hp.num_val, hp.seed)
            return self._split
        rng = random.Random(hp.seed)
        load = {"columns": hp.columns, "required": self._required, "string_columns": self._string_columns()}
        records = load_records(hp.source, split=hp.split, **load)
        if hp.val_split is None:
            rng.shuffle(records)
            val, records = records[: hp.num_val], records[hp.num_val :]
        else:
            val = load_records(hp.source, split=hp.val_split, **load)
            val = rng.sample(val, min(hp.num_val, len(val)))
            rng.shuffle(records)
        held_out = {example.prompt for example in val}
        train = [example for example in records if example.prompt not in held_out][: hp.num_train]
        if not train:
            raise DataSourceError(
                f"{hp.source}: no training records left after holding out validation prompts"
            )
        return train, val

    def _string_columns(self) -> tuple[str, ...]:
        """Source columns besides the fields that every record of a real source must hold as strings (checked
        at load, so a bad record is reported with its file and line)."""
        return ()

    def _built(self, data: list[Any] | None) -> list[Any]:
        if data is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for a dataloader")
        return data

    def _messages(self, prompt: str, completion: str | None = None) -> list[dict[str, str]]:
        messages = prefix_messages(self.system_prompt)
        messages.append({"role": "user", "content": prompt})
        if completion is not None:
            messages.append({"role": "assistant", "content": completion})
        return messages

    def _render_prompt(self, prompt: str) -> str:
        """The chat-templated prompt up to and including the assistant header, as at generation time."""
        return render_prompt(self.tokenizer, prompt, self.system_prompt)

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids without extra special tokens: the chat template already wrote the ones it wants."""
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    def _encode(self, examples: list[Example]) -> list[tuple[list[int], list[int]]]:
        """``(input_ids, labels)`` of each full conversation, untruncated."""
        tokenizer = self.tokenizer
        prompts = [self._render_prompt(example.prompt) for example in examples]
        responses = []
        for example, prompt in zip(examples, prompts, strict=True):
            full = apply_chat_template(tokenizer, self._messages(example.prompt, example.completion))
            if not full.startswith(prompt):
                raise ValueError(
                    f"the chat template of {tokenizer.name_or_path!r} renders a conversation that does not "
                    "start with its own generation prompt, so the response cannot be located: "
                    f"{prompt!r} vs {full[: len(prompt) + 20]!r}"
                )
            responses.append(full[len(prompt) :])
        # A response is trained up to and including its first stop token (the template's end of turn, or eos);
        # one the template did not close gets the end-of-turn token appended.
        stops = set(stop_token_ids(tokenizer))
        end_id = turn_end_token_id(tokenizer)
        docs = []
        for prompt_ids, response_ids in zip(self._tokenize(prompts), self._tokenize(responses), strict=True):
            ends = [i for i, token in enumerate(response_ids) if token in stops]
            if not ends and end_id is not None:
                response_ids = [*response_ids, end_id]
                ends = [len(response_ids) - 1]
            trained = ends[0] + 1 if ends else len(response_ids)
            labels = [IGNORE_INDEX] * len(prompt_ids) + response_ids[:trained]
            labels += [IGNORE_INDEX] * (len(response_ids) - trained)
            docs.append((prompt_ids + response_ids, labels))
        return docs

    def _truncate(self, ids: list[int], labels: list[int]) -> dict[str, torch.Tensor] | None:
        """The item cut to ``max_length``, or None when not one response token survives the cut."""
        max_length = self.hparams.max_length
        if all(label == IGNORE_INDEX for label in labels[:max_length]):
            return None
        return {"input_ids": torch.tensor(ids[:max_length]), "labels": torch.tensor(labels[:max_length])}
