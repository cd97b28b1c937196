"""Synthetic tasks: seeded generators of prompts with a reference completion and an exact verifier.

A task is the cheapest possible environment for post-training research: it produces unlimited, deduplicated
data at no cost, and its verifier gives the reward (RL) or the accuracy (SFT evaluation) without a judge model.
Verifiers parse strictly with regular expressions and never evaluate model output.

Register a new task with :func:`register_task`; the DataModules look tasks up by name (``--data.task``).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar, TypeVar

from lightning_llm.text import extract_answer
from lightning_llm.types import Example

__all__ = [
    "Example",
    "Task",
    "available_tasks",
    "extract_answer",
    "get_task",
    "register_task",
    "split_train_val",
]


class Task(ABC):
    """A seeded generator of :class:`Example` s with an exact verifier.

    Subclasses set ``name`` and implement :meth:`generate` and :meth:`score`; their constructor arguments are
    the task's parameters (passed as ``task_kwargs`` by the DataModules).
    """

    name: ClassVar[str]

    #: The completion format, said in one sentence to a model that has never seen the task.
    answer_format: ClassVar[str] = "Give your final answer inside <answer></answer> tags."
    #: Whether :meth:`prompt_prefix` shows a worked example (a task may withhold it: instructions alone).
    show_example: ClassVar[bool] = True

    def prompt_prefix(self, example: Example | None = None) -> list[dict[str, str]]:
        """Chat messages that let an instruct model follow the task zero-shot: :attr:`answer_format` as the system
        message, then ``example`` (pass a training example, never a held-out one) as one worked user/assistant
        exchange. A worked exchange in its own turns is followed far more reliably than one described inside the
        system message (SmolLM2-135M-Instruct, 1-digit sums: 50% vs 8% of 24 answered in the format)."""
        messages = [{"role": "system", "content": self.answer_format}]
        if example is not None and self.show_example:
            messages += [
                {"role": "user", "content": example.prompt},
                {"role": "assistant", "content": example.completion},
            ]
        return messages

    #: Question phrasings the task can ask an item in (:meth:`rephrase`); 1: the prompt has one wording.
    num_phrasings: ClassVar[int] = 1

    def item_key(self, example: Example) -> Any:
        """What identifies the item an example asks about, whatever its wording: training and validation never
        share one (:func:`split_train_val`). The prompt itself unless the task has several phrasings."""
        return example.prompt

    def rephrase(self, example: Example, phrasing: int) -> Example:
        """``example`` asked in phrasing ``phrasing`` (0 … :attr:`num_phrasings` − 1), same answer."""
        if phrasing != 0:
            raise ValueError(f"task {self.name!r} has one phrasing (0), got {phrasing}")
        return example

    @abstractmethod
    def generate(self, n: int, seed: int) -> list[Example]:
        """Return ``n`` examples, a pure function of the task's parameters, ``n`` and ``seed``."""

    @abstractmethod
    def score(self, completion: str, example: Example) -> float:
        """Return 1.0 if ``completion`` states exactly ``example``'s answer, else 0.0."""


_TaskT = TypeVar("_TaskT", bound=type[Task])
_REGISTRY: dict[str, type[Task]] = {}


def register_task(cls: _TaskT) -> _TaskT:
    """Class decorator: make a :class:`Task` subclass available to :func:`get_task` under ``cls.name``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__qualname__} must set a non-empty class attribute `name` to be registered")
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"task name {name!r} is already registered by {existing.__qualname__}")
    _REGISTRY[name] = cls
    return cls


def available_tasks() -> list[str]:
    """Names of the registered tasks, sorted."""
    return sorted(_REGISTRY)


def get_task(name: str, **kwargs: Any) -> Task:
    """Instantiate the task registered as ``name`` with its parameters ``kwargs``."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(available_tasks())}") from None
    return cls(**kwargs)


def split_train_val(
    task: Task, num_train: int, num_val: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """Generate a validation set and a training set whose items never occur in it.

    Validation is ``task.generate(num_val, seed)``; training is drawn from seeds derived from ``seed`` and
    filtered against the validation items (:meth:`Task.item_key`: the prompt, or for a task with several
    phrasings what is asked, in any wording), so a memorised training item can never inflate validation
    accuracy. Training may repeat an item (small task spaces); it may not share one with validation.
    """
    if num_train < 1 or num_val < 0:
        raise ValueError(f"need num_train >= 1 and num_val >= 0, got {num_train} and {num_val}")
    val = task.generate(num_val, seed=seed) if num_val else []
    held_out = {task.item_key(example) for example in val}
    train: list[Example] = []
    # Each round draws at least as many as are still missing; if a whole round adds nothing, the task's
    # prompt space is (almost) exhausted by validation and no amount of drawing will help.
    for attempt in range(1, 1_000):
        missing = num_train - len(train)
        drawn = task.generate(max(2 * missing, 64), seed=_derive_seed(seed, attempt))
        fresh = [example for example in drawn if task.item_key(example) not in held_out]
        if not fresh:
            break
        train.extend(fresh[:missing])
        if len(train) == num_train:
            return train, val
    raise ValueError(
        f"task {task.name!r} ({task!r}) cannot supply {num_train} training examples disjoint from its "
        f"{num_val} validation prompts (got {len(train)}): its prompt space is too small; lower num_val or "
        "make the task harder"
    )


def _derive_seed(seed: int, stream: int) -> int:
    """A 63-bit seed for training round ``stream``, unrelated to ``seed`` itself (which validation uses)."""
    digest = hashlib.blake2b(f"{seed}/train/{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# Built-in tasks register themselves on import; they need the names above, hence the late import.
from lightning_llm.datamodules.tasks.arithmetic import ArithmeticTask  # noqa: E402
from lightning_llm.datamodules.tasks.copy import CopyTask  # noqa: E402
from lightning_llm.datamodules.tasks.forecasting import ForecastingTask  # noqa: E402
from lightning_llm.datamodules.tasks.gameable import GameableTask  # noqa: E402
from lightning_llm.datamodules.tasks.honeypot import HoneypotTask  # noqa: E402
from lightning_llm.datamodules.tasks.length import LengthTask, WordCountTask  # noqa: E402
from lightning_llm.datamodules.tasks.long_context import (  # noqa: E402
    AssociativeRecallTask,
    MultiKeyNeedleTask,
    NeedleTask,
)
from lightning_llm.datamodules.tasks.multihop_qa import MultiHopQATask  # noqa: E402
from lightning_llm.datamodules.tasks.puzzles import (  # noqa: E402
    FutoshikiTask,
    LatinSquareTask,
    MiniSudokuTask,
    Puzzle,
    format_grid,
    parse_grid,
)
from lightning_llm.datamodules.tasks.twenty_questions import TwentyQuestionsTask  # noqa: E402

__all__ += [
    "ArithmeticTask",
    "AssociativeRecallTask",
    "CopyTask",
    "ForecastingTask",
    "FutoshikiTask",
    "GameableTask",
    "HoneypotTask",
    "LatinSquareTask",
    "LengthTask",
    "MiniSudokuTask",
    "MultiHopQATask",
    "MultiKeyNeedleTask",
    "NeedleTask",
    "Puzzle",
    "TwentyQuestionsTask",
    "WordCountTask",
    "format_grid",
    "parse_grid",
]
