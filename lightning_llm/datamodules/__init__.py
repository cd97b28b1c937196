"""Shared DataModules: chat SFT and RL prompts, from synthetic tasks (``tasks``) or real data (``sources``)."""

from lightning_llm.datamodules.activations import ActivationDataModule
from lightning_llm.datamodules.chat_corpus import load_chat_corpus, make_chat_corpus
from lightning_llm.datamodules.chat_sft import ChatSFTDataModule
from lightning_llm.datamodules.forecasting import ForecastingDataModule
from lightning_llm.datamodules.needle import NeedleDataModule
from lightning_llm.datamodules.pcfg import PCFGDataModule
from lightning_llm.datamodules.preference import (
    HoneypotPreferenceDataModule,
    PreferenceDataModule,
    PreferencePair,
    honeypot_pairs,
)
from lightning_llm.datamodules.prompt import PromptDataModule
from lightning_llm.datamodules.puzzles import PuzzleDataModule
from lightning_llm.datamodules.sources import DataSourceError, ExampleDataModule, load_records
from lightning_llm.datamodules.tasks import (
    ArithmeticTask,
    CopyTask,
    Example,
    HoneypotTask,
    MultiHopQATask,
    Task,
    available_tasks,
    extract_answer,
    get_task,
    register_task,
    split_train_val,
)

__all__ = [
    "ActivationDataModule",
    "ArithmeticTask",
    "ChatSFTDataModule",
    "CopyTask",
    "DataSourceError",
    "Example",
    "ExampleDataModule",
    "ForecastingDataModule",
    "HoneypotPreferenceDataModule",
    "HoneypotTask",
    "MultiHopQATask",
    "NeedleDataModule",
    "PCFGDataModule",
    "PreferenceDataModule",
    "PreferencePair",
    "PromptDataModule",
    "PuzzleDataModule",
    "Task",
    "available_tasks",
    "extract_answer",
    "get_task",
    "honeypot_pairs",
    "load_chat_corpus",
    "load_records",
    "make_chat_corpus",
    "register_task",
    "split_train_val",
]
