"""Behaviour: at a 25% KV budget, the learned indexer > StreamingLLM
(docs/methods.md §11); at 10%, where the indexer cannot keep the needle, the memory gives it back.

The tiny backbone is first taught single-needle retrieval (``train_retrieval_backbone``: batches of 32 chat prompts,
a one-digit code in 40 filler words, 73-88-token prompts, lr 3e-3 constant, stopping at the first 50-step check
with >= 98% full-cache accuracy). An :class:`~lightning_llm.modules.IndexMemModule` (frozen backbone; indexer
target "future"; memory as a softmax slot, its gate and mass scale distilled at budgets cycling through 10%, 25%
and 50% of the prompt; 2 sinks + 2 recent tokens) is trained for 120 steps of 16. Then 200 held-out prompts are
answered greedily with every layer's KV cache cut to ``ceil(ratio · prompt)`` tokens (2 sinks + 2 recent + the rest
chosen by the policy), re-evicting at every decoding step.

Measured at seed 0 (one thread, fp32): at 25%, StreamingLLM 0.14, indexer 1.00, indexer + memory 1.00; at 10%,
indexer 0.85, indexer + memory 1.00. The table over seeds, budgets and baselines, and how this recipe was found,
are in docs/methods.md §11. The backbone's retrieval is seed-dependent, so the test uses seed 0 only.

Asserted, at seed 0: full cache >= 0.95; at 25%, indexer >= StreamingLLM + 0.4; at 10%, indexer + memory >=
indexer + 0.1; more than 70% of the tokens evicted at 25%; the gates trained away from their initial value. At
25% the two tie (1.00 = 1.00: when the indexer keeps the needle there is nothing for the memory to add), so that
comparison is not asserted; that the memory uses no extra KV slots is a unit test
(``tests/eviction/test_indexmem.py``).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_llm.datamodules.needle import NeedleDataModule
from lightning_llm.datamodules.tasks import get_task
from lightning_llm.evaluation.retrieval_backbone import train_retrieval_backbone
from lightning_llm.eviction import FullCache, StreamingLLM, accuracy_under_budget
from lightning_llm.modules import IndexMemModule

pytestmark = pytest.mark.slow

TASK = {"haystack_words": 40, "value_digits": 1}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, quiet_trainer, tiny_backbone):
    path = train_retrieval_backbone(tmp_path_factory.mktemp("needle_tiny"), task_kwargs=TASK, seed=0)
    L.seed_everything(0, verbose=False)
    data = NeedleDataModule(
        task="needle", task_kwargs=TASK, num_train=4000, num_val=1, batch_size=16, max_length=512, seed=100
    )
    module = IndexMemModule(str(path), budget_ratio=[0.1, 0.25, 0.5], sinks=2, window=2, lr=3e-3)
    quiet_trainer(max_steps=120).fit(module, data)
    return module


def test_indexer_and_memory_beat_streaming_llm_and_memory_recovers_evicted_needles(trained):
    task = get_task("needle", **TASK)
    examples = task.generate(200, 12345)
    model, tokenizer = trained.model, trained.tokenizer

    def accuracy(policy, memory=None, ratio=0.25):
        result = accuracy_under_budget(
            model, tokenizer, task, examples, policy, budget_ratio=ratio, memory=memory
        )
        return result

    full = accuracy(FullCache(), ratio=None).accuracy
    streaming = accuracy(StreamingLLM(sinks=2, window=2)).accuracy
    indexer = accuracy(trained.policy())
    assert full >= 0.95, full
    assert indexer.accuracy >= streaming + 0.4, (indexer.accuracy, streaming)
    assert indexer.evicted_fraction > 0.7
    # a tenth of the prompt: the indexer keeps the needle less often, the memory's slot gives it back
    indexer_10 = accuracy(trained.policy(), ratio=0.1)
    with_memory_10 = accuracy(trained.policy(), trained.memory, ratio=0.1)
    assert with_memory_10.accuracy >= indexer_10.accuracy + 0.1, (
        with_memory_10.accuracy,
        indexer_10.accuracy,
    )
    gates = torch.cat([torch.sigmoid(g.bias) for g in trained.memory.gates])
    assert not torch.allclose(gates, torch.full_like(gates, torch.sigmoid(torch.tensor(-3.0)).item()))
