"""GRPO rollouts end at every id of the model's stop set, not only the tokenizer's eos: a model whose generation
config lists two end ids stops on either, and masks, lengths, texts, rewards and the truncation metric exclude
what would have followed."""

from __future__ import annotations

import copy

import torch

from lightning_llm.datamodules.sources import render_prompt
from lightning_llm.lm import save_backbone
from lightning_llm.modules import GRPOModule
from lightning_llm.rl import HFEngine, Sampling, left_pad

BUDGET = 12


def _text_length(completions, examples):
    return [float(len(c)) for c in completions]


def _prompts(tok):
    rows = [
        tok(render_prompt(tok, p, None), add_special_tokens=False)["input_ids"] for p in ("2+3=?", "a colour")
    ]
    return left_pad(rows, tok.pad_token_id, torch.device("cpu"))


def _first_new(row: list[int], forbidden: list[int]) -> int:
    """Position of the first token of ``row`` (after the first) seen neither before in ``row`` nor in ``forbidden``."""
    return next(i for i in range(1, len(row)) if row[i] not in row[:i] and row[i] not in forbidden)


def test_rollouts_stop_on_either_end_id(tiny_backbone, tmp_path):
    model, tok = tiny_backbone
    ids, mask = _prompts(tok)
    torch.manual_seed(3)
    free = (
        HFEngine(model, tok)
        .generate(
            ids,
            mask,
            sampling=Sampling(BUDGET, 1.0),
            stop_token_ids=[tok.eos_token_id],
            pad_id=tok.pad_token_id,
        )
        .tolist()
    )
    assert all(len(row) == BUDGET and tok.eos_token_id not in row for row in free)  # a free run: no stop
    i = _first_new(free[0], free[1])
    j = _first_new(free[1], free[0][: i + 1])
    a, b = free[0][i], free[1][j]
    assert a not in free[1][: j + 1] and b not in free[0][: i + 1]

    two_ends = copy.deepcopy(model)
    two_ends.generation_config.eos_token_id = [a, b]
    save_backbone(two_ends, tok, tmp_path / "two_ends")
    module = GRPOModule(model=str(tmp_path / "two_ends"), rewards=[_text_length], group_size=2)
    assert module.stop_token_ids == [tok.eos_token_id, a, b]
    batch = {"input_ids": ids, "attention_mask": mask, "example": [None, None]}
    torch.manual_seed(3)  # the same samples as the free run, up to the stops
    rollout = module.make_rollout(batch, group_size=1, sampling=Sampling(BUDGET, 1.0, 1.0))

    kept = [free[0][: i + 1], free[1][: j + 1]]
    assert rollout.completion_lengths().tolist() == [i + 1, j + 1]
    completion = rollout.input_ids[:, rollout.prompt_length :]
    for row, expected in enumerate(kept):
        assert completion[row, : len(expected)].tolist() == expected
        assert (completion[row, len(expected) :] == tok.pad_token_id).all()  # nothing follows the stop
        assert rollout.loss_mask[row, rollout.prompt_length :].sum() == len(expected)
        assert rollout.attention_mask[row, rollout.prompt_length :].sum() == len(expected)
    texts = [tok.decode(row, skip_special_tokens=True) for row in kept]
    assert rollout.completions == texts
    assert rollout.rewards.tolist() == [float(len(t)) for t in texts]

    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, float(value))
    module._log_rollout(rollout)
    assert logged["train/completions/clipped_ratio"] == 0.0  # both ended at a stop id: none truncated
