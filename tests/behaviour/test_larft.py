"""Behaviour: LARFT's hindsight self-counting task against GRPO with the length reward alone (seeded, CPU).

Both arms: the same SFT warm-up (100 steps) on the ``length`` task (3-8 words), then 120 GRPO updates
(30 rollout batches of 4 prompts x 4 completions, ``ppo_epochs=2 x mini_batches=2``) with the length reward,
``entropy_coef=0.01`` and ``beta=0.001`` (the paper's loss); the LARFT arm adds
``HindsightLengthAwareness(lambda_max=0.1, warmup=0.1)``: ``lambda_max`` is not the paper's 0.01 because the
tiny model has never seen the count format, and at 0.01 the CE term barely moves it in 120 updates.

What is asserted: the hindsight task is learnt, i.e. the hindsight CE (nats per label token) on the reference
answers of the 32 held-out prompts ends far below the baseline's. Measured, baseline -> LARFT: seed 0:
9.79 -> 1.39; seed 1: 1.95 with LARFT (baseline 9.66 at seed 2).

What the paper claims does NOT show at this scale, and is not asserted (the test prints the numbers). Metrics:
length error = mean |L - c|/c of the greedy answers to the 32 held-out prompts; ranked self-count accuracy
(:func:`~lightning_llm.callbacks.larft.self_count_ranked_accuracy`, candidates 0-16) on the 32 reference answers
("ref") and on 64 of the policy's own sampled (T=1) answers to those prompts ("own"; in brackets the share of
the most frequent count among them, what a constant guess scores). Baseline (no callback), seeds 0-4:
error 0.49 / 0.27 / 0.36 / 0.18 / 0.64; ref 0.125 / 0.22 / 0.09 / 0.125 / 0.16; own 0.125 (0.30) / 0.17 (0.30) /
0.23 (0.23) / 0.11 (0.23) / 0.09 (0.20).

- ``lambda_max=0.1`` (this test's arm; hindsight CE over ``step.rows``), seeds 0-3: error 0.49 -> 0.14,
  0.27 -> 0.47, 0.36 -> 0.51, 0.18 -> 0.23; ref 0.125 -> 0.34, 0.22 -> 0.25, 0.09 -> 0.09, 0.125 -> 0.19;
  own (seeds 2, 3) 0.23 -> 0.125, 0.11 -> 0.125. With ``lambda_max=0.3, warmup=0.5``: error 0.49 -> 0.22,
  0.27 -> 0.81 (answers collapse into fragments of the count label), 0.36 -> 0.44; ref 0.125 -> 0.06,
  0.22 -> 0.09, 0.09 -> 0.19.
- ``rows="all"`` (the hindsight CE over every sample of the rollout batch at each of the 4 updates), seeds 0-4:
  ``lambda_max=0.1``: error 0.39 / 0.26 / 0.72 (seeds 0-2), ref 0.22 / 0.09 / 0.125. ``lambda_max=1``: error
  0.26 / 0.25 / 0.31 / 0.61 / 0.36, ref 0.19 / 0.06 / 0.19 / 0.22 / 0.125, own 0.19 (0.25) / 0.02 (0.23) /
  0.19 (0.25) / 0.22 (0.19) / 0.09 (0.28). ``lambda_max=0.3`` seed 0: error 0.32, ref 0.0; ``lambda_max=3``
  seed 0: error 0.81 (collapse), ref 0.16, own 0.125.
- 120 rollout batches of one update each (``ppo_epochs=mini_batches=1``, 4x the hindsight samples), seed 0:
  baseline error 0.77, ref 0.03, own 0.08 (0.17); ``lambda_max=1, rows="all"``: 0.78, 0.125, 0.19 (0.25).
- The one lead: shorter texts, ``task_kwargs={"min_words": 1, "max_words": 4}``, ``lambda_max=1,
  rows="all"``, otherwise as above, seeds 0-4: ref 0.19 -> 0.31, 0.125 -> 0.22, 0.25 -> 0.28, 0.0 -> 0.16,
  0.25 -> 0.44 and own 0.02 (0.50) -> 0.56 (0.56), 0.22 (0.22) -> 0.27 (0.34), 0.08 (0.36) -> 0.34 (0.34),
  0.03 (0.45) -> 0.55 (0.52), 0.08 (0.31) -> 0.25 (0.30): up at every seed, but by as little as 1 text of 32
  (ref, seed 2), and "own" mostly reaches the constant-guess level (the modal count is learnt, not counting).
  Length error 0.19 -> 0.44, 0.93 -> 0.38, 2.88 -> 0.34, 0.38 -> 0.57, 0.59 -> 0.59: no consistent sign.
  Not asserted: a one-text margin is not robust, and it was found too late to re-run the tutorial with it.
- Greedy self-count accuracy is 0 in every arm, seed and setting: the greedy answer is never a well-formed
  ``<word_count>N</word_count>`` (about 20 BPE tokens in the tiny tokenizer).

So neither "length error falls faster" nor "self-count accuracy rises" has a consistent sign over seeds, and the
ranked accuracy never clearly beats a constant guess. It is not capacity: supervised training on the hindsight
task alone (16 fresh reference-style texts per step, lr 3e-3, no RL) takes the same ranked accuracy from 0 to
0.53 in 100 steps and 0.97 in 500 (seed 0, ~18 s per 100 steps). Inside the RL run the count task gets 480
samples of the policy's own (mostly non-word) answers at a weight lambda(t) * lr, too little to learn counting
before it interferes with the policy.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_llm.callbacks import HindsightLengthAwareness, SFTWarmup
from lightning_llm.callbacks.larft import (
    build_hindsight_batch,
    greedy_completions,
    hindsight_loss,
    self_count_ranked_accuracy,
)
from lightning_llm.datamodules import PromptDataModule
from lightning_llm.modules.grpo import GRPOModule
from lightning_llm.rewards import word_count


def _run(quiet_trainer, seed: int, lambda_max: float) -> dict[str, float]:
    L.seed_everything(seed)
    torch.set_num_threads(1)
    callbacks = [SFTWarmup(steps=100, lr=3e-3, batch_size=32)]
    if lambda_max > 0:
        callbacks.append(HindsightLengthAwareness(lambda_max=lambda_max, warmup=0.1))
    data = PromptDataModule(
        task="length", task_kwargs={"min_words": 3, "max_words": 8}, num_train=512, num_val=32, batch_size=4,
        seed=seed,
    )  # fmt: skip
    module = GRPOModule(
        rewards=["length"], group_size=4, max_new_tokens=16, lr=1e-3, entropy_coef=0.01, beta=0.001,
        ppo_epochs=2, mini_batches=2,
    )  # fmt: skip
    quiet_trainer(max_steps=120, callbacks=callbacks).fit(module, data)
    examples = data.val_examples
    answers = greedy_completions(
        module.model, module.tokenizer, [e.prompt for e in examples], max_new_tokens=16
    )
    targets = [e.metadata["target_words"] for e in examples]
    error = sum(abs(word_count(a) - c) / c for a, c in zip(answers, targets, strict=True)) / len(targets)
    ranked = self_count_ranked_accuracy(
        module.model, module.tokenizer, [e.completion for e in examples], max_count=16
    )
    with torch.no_grad():
        batch = build_hindsight_batch(module.tokenizer, [e.completion for e in examples])
        ce = float(hindsight_loss(module.model, batch)[1])
    return {"length_error": error, "ranked_count_accuracy": ranked, "hindsight_ce": ce}


@pytest.mark.slow
def test_hindsight_task_is_learnt(quiet_trainer):
    base = _run(quiet_trainer, 0, 0.0)
    larft = _run(quiet_trainer, 0, 0.1)
    print("baseline", base, "LARFT", larft)
    assert larft["hindsight_ce"] < base["hindsight_ce"] / 3, (base, larft)
