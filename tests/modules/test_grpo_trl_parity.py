"""GRPOModule's loss equals TRL's GRPOTrainer loss on identical inputs, at a sampling temperature != 1.

TRL divides the logits by the sampling temperature before every policy quantity; so must we (the ratio is then
between the distributions the tokens were drawn from). Our token mean over the batch is TRL's ``bnpo``, our mean
of per-sequence means its ``grpo``; our KL is the k3 estimator, TRL's with ``use_bias_correction_kl=False``.

TRL 1.16 computes its per-token log-probs with a fused LM head that is off by up to ~4e-3 nats from
``log_softmax(logits / T)`` on this model (ours: 5e-7), which moves gradients by ~1 %. So the loss comparison feeds
TRL's loss formula the exact log-probs of its own model (``log_softmax(logits / T)`` through a plain forward,
differentiable), and a separate check shows TRL's fused values are those up to its approximation: within 1e-2
of the exact T = 0.7 values everywhere, and on average ten times closer to them than to the T = 1 values.
"""

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from lightning_llm.backbones import resolve_backbone  # noqa: E402
from lightning_llm.modules.grpo import GRPOModule  # noqa: E402
from lightning_llm.rl import Rollout  # noqa: E402
from lightning_llm.types import Example  # noqa: E402

TEMPERATURE = 0.7


def _trl_trainer(loss_type: str, beta: float, tmp_path):
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        temperature=TEMPERATURE,
        loss_type=loss_type,
        beta=beta,
        use_bias_correction_kl=False,  # TRL >= 1.x default weighs the KL by the ratio; the k3 estimator as GRPO has it
        epsilon=0.2,
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=7,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
    )
    return trl.GRPOTrainer(
        model=resolve_backbone("tiny"),
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 4),
    )


def _inputs(pad_id: int):
    """Four rows: equal-length prompts (TRL scores without position ids, so no left padding), right-padded
    completions, old log-probs away from the current ones (the clip is active), reference log-probs."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 300, (4, 6), generator=g)
    completion = torch.randint(5, 300, (4, 7), generator=g)
    completion_mask = torch.ones_like(completion)
    completion_mask[1, 5:] = 0
    completion_mask[3, 2:] = 0
    completion = completion.masked_fill(completion_mask == 0, pad_id)
    advantages = torch.tensor([1.3, -0.4, 0.8, -1.1])
    old = -torch.rand(4, 7, generator=g) * 4 - 0.5
    ref = -torch.rand(4, 7, generator=g) * 4 - 0.5
    return prompt, completion, completion_mask, advantages, old, ref


def _joined(prompt, completion, completion_mask):
    return torch.cat([prompt, completion], dim=1), torch.cat(
        [torch.ones_like(prompt), completion_mask], dim=1
    )


def _exact_logps(model, prompt, completion, completion_mask, temperature):
    """``log_softmax(logits / T)`` of each completion token, through a plain forward of ``model``."""
    ids, mask = _joined(prompt, completion, completion_mask)
    logits = (
        model(input_ids=ids, attention_mask=mask).logits[:, prompt.shape[1] - 1 : -1].float() / temperature
    )
    return logits.log_softmax(-1).gather(-1, completion[..., None])[..., 0]


@pytest.mark.parametrize(("loss_type", "aggregation"), [("bnpo", "token-mean"), ("grpo", "sequence-mean")])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_equal_trls(loss_type, aggregation, beta, tiny_backbone, tmp_path):
    trainer = _trl_trainer(loss_type, beta, tmp_path)
    module = GRPOModule(temperature=TEMPERATURE, beta=beta, epsilon=0.2, loss_aggregation=aggregation)
    prompt, completion, completion_mask, advantages, old, ref = _inputs(module.tokenizer.pad_token_id)

    inputs = {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": completion_mask.sum(),
    }
    trainer.current_gradient_accumulation_steps = 1  # set by its training loop; one step, no accumulation
    trl_model = trainer.model.train()
    fused, _, _ = trainer._get_per_token_logps_and_entropies(
        trl_model, *_joined(prompt, completion, completion_mask), completion.shape[1]
    )
    exact = _exact_logps(trl_model, prompt, completion, completion_mask, TEMPERATURE)
    at_one = _exact_logps(trl_model, prompt, completion, completion_mask, 1.0)
    keep = completion_mask.bool()
    fused_error = (fused - exact)[keep].abs()
    assert fused_error.max() < 1e-2 and fused_error.mean() < 0.1 * (fused - at_one)[keep].abs().mean()
    trainer._get_per_token_logps_and_entropies = lambda model, ids, mask, keep_n, **_: (
        _exact_logps(model, prompt, completion, completion_mask, TEMPERATURE),
        torch.zeros_like(completion, dtype=torch.float32),  # entropies: only logged by TRL here
        None,
    )
    theirs = trainer._compute_loss(trl_model, inputs)
    theirs.backward()

    ids = torch.cat([prompt, completion], dim=1)
    loss_mask = torch.cat([torch.zeros_like(prompt, dtype=torch.bool), completion_mask.bool()], dim=1)
    rollout = Rollout(
        input_ids=ids,
        attention_mask=torch.cat([torch.ones_like(prompt), completion_mask], dim=1),
        loss_mask=loss_mask,
        prompt_length=prompt.shape[1],
        group_ids=torch.tensor([0, 0, 1, 1]),
        completions=[""] * 4,
        examples=[Example("p", "c", "a")] * 4,
    )
    pad = torch.zeros(4, prompt.shape[1])
    rollout.advantages = advantages[:, None] * loss_mask
    rollout.old_logprobs = torch.cat([pad, old], dim=1) * loss_mask
    rollout.ref_logprobs = torch.cat([pad, ref], dim=1) * loss_mask if beta else None
    ours, _ = module.policy_loss(rollout, torch.arange(4))
    ours.backward()

    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        mine = dict(module.model.named_parameters())[name].grad
        reference = dict(trl_model.named_parameters())[name].grad
        assert (mine - reference).norm() <= 1e-5 * reference.norm(), name
