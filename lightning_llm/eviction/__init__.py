"""Eviction-aware inference (docs/methods.md §11): a budgeted KV cache, eviction policies, ``generate_with_budget``
and ``accuracy_under_budget``."""

from lightning_llm.eviction.accuracy import BudgetResult, accuracy_under_budget
from lightning_llm.eviction.base import BudgetedCache, EvictionPolicy, FullCache, LayerStats
from lightning_llm.eviction.generate import GenerationResult, Prefill, generate_with_budget, record_prefill
from lightning_llm.eviction.h2o import H2O
from lightning_llm.eviction.indexer import IndexerPolicy, LightningIndexer, indexer_kl
from lightning_llm.eviction.memory import LatentMemory
from lightning_llm.eviction.snapkv import SnapKV
from lightning_llm.eviction.streaming_llm import StreamingLLM
from lightning_llm.kernels.budgeted_attention import memory_readout

__all__ = [
    "H2O",
    "BudgetResult",
    "BudgetedCache",
    "EvictionPolicy",
    "FullCache",
    "GenerationResult",
    "IndexerPolicy",
    "LatentMemory",
    "LayerStats",
    "LightningIndexer",
    "Prefill",
    "SnapKV",
    "StreamingLLM",
    "accuracy_under_budget",
    "generate_with_budget",
    "indexer_kl",
    "memory_readout",
    "record_prefill",
]
