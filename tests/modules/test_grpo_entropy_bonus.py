"""GRPOModule(entropy_coef=c) subtracts c × the token-mean entropy of the kept tokens (LARFT's −0.01·H term)."""

import pytest
import torch

from lightning_llm.datamodules import Example
from lightning_llm.modules.grpo import GRPOModule
from lightning_llm.rl import Rollout


def _rollout(pad_id: int) -> Rollout:
    torch.manual_seed(0)
    ids = torch.randint(3, 200, (2, 10))
    ids[1, :2] = pad_id
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 4:] = True
    rollout = Rollout(
        input_ids=ids,
        attention_mask=mask,
        loss_mask=loss_mask,
        prompt_length=4,
        group_ids=torch.tensor([0, 0]),
        completions=["", ""],
        examples=[Example("p", "c", "a")] * 2,
    )
    rollout.advantages = torch.tensor([[0.8], [-0.8]]) * loss_mask
    return rollout


def test_entropy_bonus_is_minus_coef_times_token_mean_entropy(tiny_backbone):
    plain = GRPOModule()
    bonus = GRPOModule(entropy_coef=0.1)
    rollout = _rollout(plain.tokenizer.pad_token_id)
    rows = torch.arange(2)
    loss0, stats0 = plain.policy_loss(rollout, rows)
    loss1, stats1 = bonus.policy_loss(rollout, rows)
    entropy = stats0["entropy"]  # same weights (the tiny backbone is deterministic), same tokens
    torch.testing.assert_close(stats1["entropy"], entropy)
    torch.testing.assert_close(loss1, loss0 - 0.1 * entropy, rtol=1e-5, atol=1e-6)
    # and it has a gradient that raises entropy: d(loss)/d(entropy) = -c
    loss1.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in bonus.model.parameters())


def test_negative_entropy_coef_is_refused(tiny_backbone):
    with pytest.raises(ValueError, match="entropy_coef"):
        GRPOModule(entropy_coef=-0.01)
