"""Behaviour: LARFT's hindsight task raises the policy's self-counting accuracy against GRPO with the length reward alone.

Setup (seeded, CPU). The ``length`` task with 1-4-word targets. Both arms start from one shared SFT warm-up: 150
steps on the task's reference answers *and* on the ``word_count`` task (count the words of a 1-8-word
reference text; ``SFTWarmup(extra_tasks=...)``), the rough counting skill an instruct model brings and the tiny
model trained from scratch lacks. Then 200 GRPO updates (50 rollout batches of 4 prompts x 4 completions,
``ppo_epochs=2 x mini_batches=2``, lr 1e-4) with the length reward, ``entropy_coef=0.01`` and ``beta=0.001`` (the
paper's loss); the LARFT arm adds ``HindsightLengthAwareness(lambda_max=0.01, warmup=0.1)``, the paper's values.

Metric: self-count accuracy, ranked (:func:`~lightning_llm.callbacks.larft.self_count_ranked_accuracy`,
candidates 0-12) on 64 fixed fresh reference texts of 1-4 words, so both arms are judged on the same texts; in
brackets the greedy self-count accuracy on each arm's own greedy answers to the 32 held-out prompts (the paper's
reading, but on different texts per arm); then the greedy length error mean |L - c| / c on those prompts.

=========  =========================  =========================  =========================
seed       after warm-up              GRPO (length reward)       + LARFT hindsight task
=========  =========================  =========================  =========================
0          0.75 (0.31), 0.14          0.53 (0.31), 0.117         0.70 (0.44), 0.174
1          0.83 (1.00), 0.27          0.80 (1.00), 0.112         0.89 (0.75), 0.042
=========  =========================  =========================  =========================

With ``lambda_max=0.1``: 0.72 (0.59), 0.242 and 0.84 (0.59), 0.099. With a longer warm-up (400 steps) and
``rows="all"`` (ranked, baseline -> LARFT): seed 0 0.27 -> 1.00 at ``lambda_max`` 0.1 and at 1; seeds 1 and 2
0.73 -> 1.00 and 0.81 -> 0.89 at 0.01; length error 0.21 -> 0.26, 0.135 -> 0.161, 0.505 -> 0.521. So the
counting skill ends higher with the hindsight task in all five runs (under the length reward alone it drifts
down or stays), while the paper's other claim, that length error falls faster, does not show: it is worse with
the hindsight task in 4 of 5 runs.

Without the counting warm-up neither effect showed (seeds 0-4; the earlier version of this test): the tiny
model's hindsight CE was learnt (9.8 -> 1.4 nats/token) but its ranked self-count never beat a constant guess,
and the count label's tokens leaked into its answers ("councoun…") as lambda grew. The test runs seed 0 (about
1.5 min on 2 shared cores, 1 thread).
"""

from __future__ import annotations

import lightning as L
import pytest

from lightning_llm.callbacks import HindsightLengthAwareness, SFTWarmup
from lightning_llm.callbacks.larft import greedy_completions, self_count_ranked_accuracy
from lightning_llm.datamodules import PromptDataModule, get_task
from lightning_llm.modules.grpo import GRPOModule
from lightning_llm.rewards import word_count

LENGTH = {"min_words": 1, "max_words": 4}
COUNTING = {"min_words": 1, "max_words": 8}


def _module() -> GRPOModule:
    return GRPOModule(
        rewards=["length"], group_size=4, max_new_tokens=16, lr=1e-4, entropy_coef=0.01, beta=0.001,
        ppo_epochs=2, mini_batches=2,
    )  # fmt: skip


def _data(seed: int) -> PromptDataModule:
    return PromptDataModule(
        task="length", task_kwargs=LENGTH, num_train=512, num_val=32, batch_size=4, seed=seed
    )


def evaluate(module: GRPOModule, data: PromptDataModule) -> dict[str, float]:
    """Ranked self-count accuracy on 64 fixed reference texts, and greedy length error on the held-out prompts."""
    examples = data.val_examples
    answers = greedy_completions(
        module.model, module.tokenizer, [e.prompt for e in examples], max_new_tokens=16
    )
    targets = [e.metadata["target_words"] for e in examples]
    error = sum(abs(word_count(a) - c) / c for a, c in zip(answers, targets, strict=True)) / len(targets)
    texts = [e.completion for e in get_task("length", **LENGTH).generate(64, seed=1234)]
    ranked = self_count_ranked_accuracy(module.model, module.tokenizer, texts, max_count=12)
    return {"self_count": ranked, "length_error": error}


@pytest.fixture(scope="module")
def warm(quiet_trainer, tiny_backbone):
    L.seed_everything(0)
    module, data = _module(), _data(0)
    warmup = SFTWarmup(steps=150, lr=3e-3, batch_size=32, extra_tasks={"word_count": COUNTING})
    quiet_trainer(0, [warmup]).fit(module, data)
    return {k: v.clone() for k, v in module.model.state_dict().items()}, evaluate(module, data)


def _arm(quiet_trainer, weights, lambda_max: float) -> dict[str, float]:
    L.seed_everything(0)
    module = _module()
    module.model.load_state_dict(weights)
    callbacks = [HindsightLengthAwareness(lambda_max=lambda_max, warmup=0.1)] if lambda_max > 0 else []
    data = _data(0)
    quiet_trainer(200, callbacks).fit(module, data)
    return evaluate(module, data)


@pytest.mark.slow
def test_hindsight_task_raises_self_count_accuracy(quiet_trainer, warm):
    weights, after_warmup = warm
    baseline = _arm(quiet_trainer, weights, 0.0)
    larft = _arm(quiet_trainer, weights, 0.01)
    print("warm-up", after_warmup, "GRPO", baseline, "LARFT", larft)
    # the length reward alone lets the counting skill drift; the hindsight task on the policy's own answers
    # raises it (measured 0.53 vs 0.70; 64 texts, so the margin is 7 texts)
    assert larft["self_count"] > baseline["self_count"] + 0.1, (baseline, larft)
    # both arms still follow the length instruction (the paper's "falls faster" does not show here, see above)
    assert larft["length_error"] < 0.5 and baseline["length_error"] < 0.5, (baseline, larft)
