"""Behaviour: at a 25% KV budget, the learned indexer + latent memory >= the indexer > StreamingLLM (METHODS §11);
at 10%, where the indexer cannot keep the needle, the memory gives it back.

The tiny backbone is first taught single-needle retrieval (``train_retrieval_backbone``: batches of 32 chat prompts,
a one-digit code in 40 filler words, 73-88-token prompts, lr 3e-3 constant, stopping at the first 50-step check
with >= 98% full-cache accuracy; seed 0 stopped at step 250 in a one-thread run, 450 in a two-thread one). An
:class:`~lightning_llm.modules.IndexMemModule` (frozen backbone; indexer target "future"; memory as a softmax slot,
its gate and mass scale distilled at budgets cycling through 10%, 25% and 50% of the prompt; 2 sinks + 2 recent
tokens) is trained for 120 steps of 16. Then 200 held-out prompts are answered greedily with every layer's KV cache
cut to ``ceil(ratio · prompt)`` tokens (2 sinks + 2 recent + the rest chosen by the policy), re-evicting at every
decoding step.

Measured on the development machine (fp32; one process per backbone; this recipe), accuracy
StreamingLLM / H2O / SnapKV / indexer / indexer + memory, all with 2 sinks + 2 recent tokens:

==========  ================================  ================================  ==================================
budget      seed 0, one thread (this test)    seed 1, one thread                seed 0, two threads (tutorial 17)
==========  ================================  ================================  ==================================
10%         0 / .79 / .865 / .85 / **1.00**   0 / .07 / .31 / .365 / **1.00**   .09 / .185 / .315 / .31 / **.90**
15%         0 / .835 / 1.00 / 1.00 / 1.00     0 / .135 / .565 / .365 / **1.00** .06 / .77 / .645 / .81 / **.92**
25%         .14 / .975 / 1.00 / 1.00 / 1.00   .165 / .47 / .845 / 1.00 / 1.00   .135 / .935 / .925 / .91 / .935
35%         .26 / 1.00 / 1.00 / 1.00 / 1.00   .26 / .76 / .975 / 1.00 / 1.00    .265 / .965 / .995 / .95 / .945
50%         .455 / 1.00 / 1.00 / 1.00 / 1.00  .46 / 1.00 / 1.00 / 1.00 / 1.00   .44 / 1.00 / 1.00 / .985 / .975
==========  ================================  ================================  ==================================

Where the indexer keeps the needle (>= 25% here) the memory has nothing to add and stays out of the way (within
0.01 of the indexer, once 0.005 and 0.01 below it); where the budget is too small for it (10-15%), the memory
recovers almost everything: 0.85 -> 1.00, 0.365 -> 1.00, 0.31 -> 0.90. How we got here (same backbones):

* the memory as first built, its gated readout *added* to the head outputs (``memory_mode="residual"``), trained at
  10%/25% with 4 sinks + 4 recent tokens: on the tutorial's backbone it *lowered* accuracy (indexer 0.91 -> 0.85 at
  25%, 0.985 -> 0.825 at 50%);
* as a softmax slot (the default now), same 4 + 4 recipe: 0.915 at 25% and 0.965 at 50% there, >= the indexer in 7
  of 8 (backbone, budget) cells, but useless at 10%: 4 sinks + 4 recent filled all 8-9 slots, so the indexer chose
  nothing and the memory's slot was weighed against 4 attention-sink tokens that soak up the softmax (0.09-0.16);
* 2 sinks + 2 recent: the indexer chooses 4-5 of the 8-9 slots at 10%, and the memory's slot is weighed against
  less sink mass. Trained at 10%/25% only, the gate then opened too far at high budgets (0.94 vs 0.985 at 50% on
  the tutorial's backbone); adding 50% to the training budgets fixed that (the table).

The backbone's retrieval itself is seed-dependent: at seeds 1 and 3 a cosine run plateaued at 0.93 and 0.72
full-cache accuracy (60 prompts, 700 steps), so the test uses seed 0 only.

Asserted, at seed 0: full cache >= 0.95; at 25%, indexer >= StreamingLLM + 0.4 and indexer + memory >= indexer
(a tie here, 1.00 = 1.00: when the indexer keeps the needle there is nothing for the memory to add); at 10%,
indexer + memory >= indexer + 0.1; equal budgets and peak cache bytes with and without memory; more than 70% of
the tokens evicted at 25%; the gates trained away from their initial value.
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
    with_memory = accuracy(trained.policy(), trained.memory)
    assert full >= 0.95, full
    assert indexer.accuracy >= streaming + 0.4, (indexer.accuracy, streaming)
    assert with_memory.accuracy >= indexer.accuracy, (with_memory.accuracy, indexer.accuracy)
    # the same cache budget: the memory does not buy accuracy with extra KV slots
    assert with_memory.budgets == indexer.budgets and with_memory.peak_cache_bytes == indexer.peak_cache_bytes
    assert indexer.evicted_fraction > 0.7
    # a tenth of the prompt: the indexer keeps the needle less often, the memory's slot gives it back
    indexer_10 = accuracy(trained.policy(), ratio=0.1)
    with_memory_10 = accuracy(trained.policy(), trained.memory, ratio=0.1)
    assert with_memory_10.accuracy >= indexer_10.accuracy + 0.1, (
        with_memory_10.accuracy,
        indexer_10.accuracy,
    )
    assert with_memory_10.peak_cache_bytes == indexer_10.peak_cache_bytes
    gates = torch.cat([torch.sigmoid(g.bias) for g in trained.memory.gates])
    assert not torch.allclose(gates, torch.full_like(gates, torch.sigmoid(torch.tensor(-3.0)).item()))
