"""Rollout.with_prompt: the same completions behind another prompt block, every [N, T] tensor re-aligned."""

import pytest
import torch

from lightning_llm.datamodules import Example
from lightning_llm.rl import Rollout, left_pad


def _rollout(prompt_length: int = 5, width: int = 12) -> Rollout:
    torch.manual_seed(0)
    ids = torch.randint(3, 200, (3, width))
    attention = torch.ones_like(ids)
    attention[1, :2] = 0  # left padding of row 1's prompt
    attention[2, -3:] = 0  # right padding of row 2's completion
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, prompt_length:] = True
    loss_mask[0, 7:9] = False  # an observation span inside row 0's completion
    loss_mask[2, -3:] = False
    rollout = Rollout(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        prompt_length=prompt_length,
        group_ids=torch.tensor([0, 0, 1]),
        completions=["a", "b", "c"],
        examples=[Example("p", "c", "a")] * 3,
        rewards=torch.tensor([1.0, 0.0, 0.5]),
        reward_components={"task": torch.tensor([1.0, 0.0, 0.5])},
        metadata={"env_states": [None] * 3},
    )
    rollout.advantages = torch.tensor([[1.5], [-0.7], [0.2]]) * loss_mask
    rollout.old_logprobs = torch.where(loss_mask, -torch.rand(3, width) * 5, torch.zeros(3, width))
    rollout.ref_logprobs = torch.where(loss_mask, -torch.rand(3, width) * 5, torch.zeros(3, width))
    return rollout


@pytest.mark.parametrize("new_width", [1, 3, 5, 9])
def test_with_prompt_realigns_every_token_tensor(new_width):
    rollout = _rollout()
    prompt_ids = torch.arange(3 * new_width).reshape(3, new_width) + 500
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, : new_width // 2] = 0
    new = rollout.with_prompt(prompt_ids, prompt_mask)

    completion = slice(rollout.prompt_length, None)
    assert new.prompt_length == new_width
    assert new.input_ids.shape == (3, new_width + 12 - 5)
    assert torch.equal(new.input_ids[:, :new_width], prompt_ids)
    assert torch.equal(new.attention_mask[:, :new_width], prompt_mask)
    for name in ("input_ids", "attention_mask", "loss_mask", "advantages", "old_logprobs", "ref_logprobs"):
        old, moved = getattr(rollout, name), getattr(new, name)
        assert moved.dtype == old.dtype, name
        assert torch.equal(moved[:, new_width:], old[:, completion]), name
    for name in ("loss_mask", "advantages", "old_logprobs", "ref_logprobs"):
        assert not getattr(new, name)[:, :new_width].any(), name  # prompt columns are never targets
    # each trainable token keeps its values: same multiset in the same row-major order
    for name in ("advantages", "old_logprobs", "ref_logprobs"):
        assert torch.equal(getattr(new, name)[new.loss_mask], getattr(rollout, name)[rollout.loss_mask])
    assert torch.equal(new.completion_lengths(), rollout.completion_lengths())
    # shared per-row data, and the original is untouched
    assert new.rewards is rollout.rewards and new.examples is rollout.examples
    assert new.metadata is rollout.metadata and new.completions == rollout.completions
    assert rollout.prompt_length == 5 and rollout.input_ids.shape == (3, 12)


def test_with_prompt_keeps_missing_logprobs_missing():
    rollout = _rollout()
    rollout.old_logprobs = rollout.ref_logprobs = rollout.advantages = None
    new = rollout.with_prompt(torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.long))
    assert new.old_logprobs is None and new.ref_logprobs is None and new.advantages is None


def test_with_prompt_rejects_bad_shapes():
    rollout = _rollout()
    with pytest.raises(ValueError, match=r"shape \[3, P'\]"):
        rollout.with_prompt(torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        rollout.with_prompt(torch.ones(3, 4, dtype=torch.long), torch.ones(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        rollout.with_prompt(torch.ones(3, 0, dtype=torch.long), torch.ones(3, 0, dtype=torch.long))


def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4], []], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
