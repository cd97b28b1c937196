"""Callbacks, one file per method."""

from lightning_llm.callbacks.entropy import EntropyDiscriminatorClipping, EntropyDynamicsMonitor
from lightning_llm.callbacks.llds import LLDSRegularizer
from lightning_llm.callbacks.rl import PolicyLossStep, RLCallback
from lightning_llm.callbacks.sft_warmup import SFTWarmup
from lightning_llm.callbacks.task_accuracy import TaskAccuracy

__all__ = [
    "EntropyDiscriminatorClipping",
    "EntropyDynamicsMonitor",
    "LLDSRegularizer",
    "PolicyLossStep",
    "RLCallback",
    "SFTWarmup",
    "TaskAccuracy",
]
