"""Behaviour: at a 25% KV budget, the learned indexer + latent memory >= the indexer > StreamingLLM (METHODS §11).

The tiny backbone is first taught single-needle retrieval (``train_retrieval_backbone``: 300 steps of 32 chat
prompts, a one-digit code in 40 filler words, 73-88-token prompts), which it answers 100% of the time with the
full cache. An :class:`~lightning_llm.modules.IndexMemModule` (frozen backbone; indexer target "future", memory gate
distilled at budgets cycling between 10% and 25% of the prompt) is trained for 120 steps of 16. Then 200 held-out
prompts are answered greedily with every layer's KV cache cut to ``ceil(0.25 · prompt)`` tokens (4 sinks + 4 recent
+ the rest chosen by the policy), re-evicting at every decoding step.

Measured on the development machine (2 CPU cores, one thread per process, fp32), accuracy at 25% budget,
seeds 0 / 1 / 2 of this recipe (seed 0 with 250 backbone and 150 IndexMem steps):

==============  ======  ======  ======
policy           seed 0  seed 1  seed 2
==============  ======  ======  ======
full cache       1.00    1.00    1.00
StreamingLLM     0.09    0.245   0.12
H2O              0.09    0.975   0.26
SnapKV           0.98    0.995   0.365
indexer          1.00    0.93    0.90
indexer+memory   1.00    1.00    0.98
==============  ======  ======  ======

At 10% (8-9 tokens: almost only sinks and window) everything is near chance (0.075-0.24), memory included
(indexer 0.145 / 0.195 / 0.20 vs +memory 0.23 / 0.19 / 0.20). The test asserts, at seed 0: full cache >= 0.95,
indexer >= StreamingLLM + 0.4, indexer + memory >= indexer (equality allowed: when the indexer keeps the needle there
is nothing for the memory to add), equal budgets and peak cache bytes with and without memory, and that the
gates were trained away from their initial value.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_llm.datamodules.needle import NeedleDataModule
from lightning_llm.datamodules.tasks import get_task
from lightning_llm.eviction import FullCache, StreamingLLM
from lightning_llm.eviction.study import accuracy_under_budget, train_retrieval_backbone
from lightning_llm.modules import IndexMemModule

pytestmark = pytest.mark.slow

TASK = {"haystack_words": 40, "value_digits": 1}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, quiet_trainer, tiny_backbone):
    path = train_retrieval_backbone(
        tmp_path_factory.mktemp("needle_tiny"), task_kwargs=TASK, steps=400, seed=0
    )
    L.seed_everything(0, verbose=False)
    data = NeedleDataModule(
        task="needle", task_kwargs=TASK, num_train=4000, num_val=1, batch_size=16, max_length=512, seed=100
    )
    module = IndexMemModule(str(path), budget_ratio=[0.1, 0.25], sinks=4, window=4, lr=3e-3)
    quiet_trainer(max_steps=120).fit(module, data)
    return module


def test_indexer_and_memory_beat_streaming_llm_at_a_quarter_budget(trained):
    task = get_task("needle", **TASK)
    examples = task.generate(200, 12345)
    model, tokenizer = trained.model, trained.tokenizer

    def accuracy(policy, memory=None, ratio=0.25):
        result = accuracy_under_budget(
            model, tokenizer, task, examples, policy, budget_ratio=ratio, memory=memory
        )
        return result

    full = accuracy(FullCache(), ratio=None).accuracy
    streaming = accuracy(StreamingLLM(sinks=4, window=4)).accuracy
    indexer = accuracy(trained.policy())
    with_memory = accuracy(trained.policy(), trained.memory)
    assert full >= 0.95, full
    assert indexer.accuracy >= streaming + 0.4, (indexer.accuracy, streaming)
    assert with_memory.accuracy >= indexer.accuracy, (with_memory.accuracy, indexer.accuracy)
    # the same cache budget: the memory does not buy accuracy with extra KV slots
    assert with_memory.budgets == indexer.budgets and with_memory.peak_cache_bytes == indexer.peak_cache_bytes
    assert indexer.evicted_fraction > 0.7
    gates = torch.cat([torch.sigmoid(g.bias) for g in trained.memory.gates])
    assert not torch.allclose(gates, torch.full_like(gates, torch.sigmoid(torch.tensor(-3.0)).item()))
