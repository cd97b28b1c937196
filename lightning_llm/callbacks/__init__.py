"""Callbacks, one file per method."""

from lightning_llm.callbacks.task_accuracy import TaskAccuracy

__all__ = ["TaskAccuracy"]
