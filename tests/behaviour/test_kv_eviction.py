"""Behaviour: at a 25% KV budget, the learned indexer + latent memory >= the indexer > StreamingLLM (METHODS §11).

The tiny backbone is first taught single-needle retrieval (``train_retrieval_backbone``: batches of 32 chat prompts,
a one-digit code in 40 filler words, 73-88-token prompts, lr 3e-3 constant, stopping at the first 50-step check
with >= 98% full-cache accuracy; seed 0 stopped at step 250 in a one-thread run, 450 in a two-thread one). An
:class:`~lightning_llm.modules.IndexMemModule` (frozen backbone; indexer target "future", memory gate distilled
at budgets cycling between 10% and 25% of the prompt) is trained for 120 steps of 16. Then 200 held-out prompts
are answered greedily with every layer's KV cache cut to ``ceil(0.25 · prompt)`` tokens (4 sinks + 4 recent + the
rest chosen by the policy), re-evicting at every decoding step.

Measured on the development machine (2 CPU cores, one thread per process, fp32), accuracy at 25% budget. Column
"final" is this test's recipe at seed 0; the other columns are the same pipeline on backbones trained for a fixed
number of steps with a cosine schedule (the recipe before the stopping rule; "250" and "300" steps, seeds 0-2):

==============  ======  =========  =========  =========  =========
policy          final   250, s0    300, s1    300, s2    400, s0
==============  ======  =========  =========  =========  =========
full cache      1.00    1.00       1.00       1.00       1.00
StreamingLLM    0.06    0.09       0.245      0.12       0.16
H2O             0.92    0.09       0.975      0.26       0.16
SnapKV          1.00    0.98       0.995      0.365      0.36
indexer         1.00    1.00       0.93       0.90       0.60
indexer+memory  1.00    1.00       1.00       0.98       0.995
==============  ======  =========  =========  =========  =========

That table is for the memory as first built (``memory_mode="residual"``: the gated readout *added* to the head outputs).
Where the indexer lost the needle it gave most of it back on those backbones (+0.07, +0.08, +0.395), but **it was not
reliable**: in tutorial 17's run (seed 0 with two threads, whose backbone needed 450 steps) it *lowered* accuracy,
0.91 → 0.85 at 25% and 0.985 → 0.825 at 50%. The default is now ``memory_mode="softmax"``: the readout is one more
slot of the attention softmax, weighed against the attended keys' mass, so a confident kept match outweighs it.
Same backbones and IndexMem recipe (120 steps; this test's pipeline), accuracy indexer / residual / softmax:

=====================  ======================  ======================
backbone               25% budget              50% budget
=====================  ======================  ======================
seed 0, one thread     1.00 / 1.00 / 1.00      1.00 / 1.00 / 1.00
seed 0, two threads    0.91 / 0.85 / 0.915     0.985 / 0.825 / 0.965
seed 1, one thread     0.96 / 0.975 / 1.00     1.00 / 1.00 / 1.00
seed 2, one thread     0.995 / 0.99 / 1.00     1.00 / 0.97 / 1.00
=====================  ======================  ======================

The softmax slot is at least as good as the residual everywhere and at least as good as the indexer alone in 7 of 8
cells; in one it is 0.02 below (0.965 vs 0.985). At 10% (8-9 slots: the sinks and the window only) every setting is
at or below chance (0-0.24). The backbone's retrieval itself is seed-dependent: at seeds 1 and 3 a cosine run
plateaued at 0.93 and 0.72 full-cache accuracy (60 prompts, 700 steps), so the test uses seed 0 only.

Asserted, at seed 0 (where the ">=" is a tie, 1.00 = 1.00: the table above is the evidence beyond it): full cache >= 0.95;
indexer >= StreamingLLM + 0.4; indexer + memory >= indexer (equality allowed: when the indexer keeps the needle there
is nothing for the memory to add); equal budgets and peak cache bytes with
and without memory; more than 70% of the tokens evicted; the gates trained away from their initial value.
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
