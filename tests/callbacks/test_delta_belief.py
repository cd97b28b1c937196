"""ΔBelief-RL: per-turn rewards on a scripted dialogue, turn-wise advantages, the probe's log-belief, the callback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_llm.callbacks import DeltaBeliefReward
from lightning_llm.callbacks.delta_belief import (
    belief_logprobs,
    turn_rewards,
    turn_spans,
    turnwise_advantages,
)
from lightning_llm.datamodules import Example, PromptDataModule
from lightning_llm.datamodules.sources import render_prompt
from lightning_llm.envs import TwentyQuestionsEnvironment
from lightning_llm.modules.grpo import GRPOModule
from lightning_llm.rl import Rollout

FOX = Example("Game 7: find the secret item.", "", "fox", {"secret": "fox"})
# A scripted game for the secret "fox" on 8 items, 5 turns: a good question, a repeat, an invalid turn, a
# wrong guess, the right guess.
SCRIPT = ["<search>alive</search>", "<search>alive</search>", "<search>wings</search>", "<answer>cow</answer>",
          "<answer>fox</answer>"]  # fmt: skip


def test_turn_rewards_on_a_scripted_dialogue():
    env = TwentyQuestionsEnvironment(num_items=8, max_turns=6)
    state = env.reset(FOX)
    for turn in SCRIPT:
        env.step(state, turn)
    assert state.events == ["yes", "repeated", "invalid", "wrong", "win"]
    penalties = torch.tensor([[*env.turn_penalties(state), 0.0]])  # one padding turn
    assert penalties.tolist() == [[0.0, -1.0, -5.0, 0.0, 0.0, 0.0]]
    r_end = torch.tensor([env.end_reward(state)])  # 2 * 1 - 0.05 * 5 = 1.75
    assert r_end.item() == pytest.approx(1.75)
    delta = torch.tensor([[0.7, -0.2, 0.0, 0.4, 1.5, 9.0]])  # the last entry is past the episode
    rewards = turn_rewards(delta, penalties, r_end, torch.tensor([5]), coef=0.1)
    expected = [0.07, -1.0, -5.0, 0.04, 1.75 + 0.15, 0.0]  # penalty + [last] r_end + 0.1 max(ΔB, 0)
    assert rewards[0].tolist() == pytest.approx(expected)
    # coef = 0: the turn rewards add up to the environment's episode reward.
    plain = turn_rewards(delta, penalties, r_end, torch.tensor([5]), coef=0.0)
    assert plain.sum().item() == pytest.approx(env.reward(state, FOX, ""))


# Two groups: rows 0-2 (turns 3, 2, 1) and rows 3-4 (turns 2, 2).
REWARDS = torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 0.0], [5.0, 0.0, 0.0], [1.0, 1.0, 0.0], [3.0, 1.0, 0.0]])
TURNS = torch.tensor([3, 2, 1, 2, 2])
GROUPS = torch.tensor([0, 0, 0, 1, 1])


def test_turnwise_advantages_exclude_missing_turns():
    adv = turnwise_advantages(REWARDS, TURNS, GROUPS, scale="none")
    # group 0: turn 0 mean 3 over 3 rows; turn 1 mean 3 over rows 0-1; turn 2 only row 0 → 0. group 1: 2, 1.
    assert adv.tolist() == [
        [-2.0, -1.0, 0.0],
        [0.0, 1.0, 0.0],
        [2.0, 0.0, 0.0],
        [-1.0, 0.0, 0.0],
        [1.0, 0.0, 0.0],
    ]
    scaled = turnwise_advantages(REWARDS, TURNS, GROUPS, scale="group")
    std0, std1 = 2.0, 2.0**0.5  # unbiased stds of [1, 3, 5] and of [2, 4] / [1, 3]
    assert scaled[:, 0].tolist() == pytest.approx([-2 / std0, 0.0, 2 / std0, -1 / std1, 1 / std1], rel=1e-3)
    assert scaled[:2, 1].tolist() == pytest.approx([-1 / std1, 1 / std1], rel=1e-3)
    assert scaled[3:, 1].tolist() == [0.0, 0.0]  # equal rewards: no signal (0 / (0 + eps))


def test_turnwise_advantages_zero_missing_turns_and_discount():
    adv = turnwise_advantages(REWARDS, TURNS, GROUPS, scale="none", missing_turns="zero")
    # group 0, turn 1: rewards [2, 4, 0 (row 2 has no turn 1)] → mean 2; turn 2: [3, 0, 0] → mean 1.
    assert adv[:3].tolist() == [[-2.0, 0.0, 2.0], [0.0, 2.0, 0.0], [2.0, 0.0, 0.0]]
    ret = turnwise_advantages(REWARDS, TURNS, GROUPS, scale="none", gamma=0.5)
    # returns: row 0 [1 + .5 * (2 + .5 * 3), 2 + 1.5, 3] = [2.75, 3.5, 3]; row 1 [3 + 2, 4]; row 2 [5].
    assert ret[:3].tolist() == [[-1.5, -0.25, 0.0], [0.75, 0.25, 0.0], [0.75, 0.0, 0.0]]


def test_turn_spans():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert turn_spans(mask) == [[(1, 3), (4, 5)], [], [(0, 1), (3, 6)]]


def _scripted_rollout(tokenizer, turns, observations, example=FOX, pad_left=2):
    """One row: left-padded chat prompt, then turns (trainable) and observations (masked), right-padded."""
    prompt = tokenizer(render_prompt(tokenizer, example.prompt, None), add_special_tokens=False)["input_ids"]
    ids, mask = [tokenizer.pad_token_id] * pad_left + prompt, [0] * (pad_left + len(prompt))
    cuts = [len(ids)]
    for turn, obs in zip(turns, observations, strict=True):
        piece = tokenizer(turn, add_special_tokens=False)["input_ids"]
        ids, mask = ids + piece, mask + [1] * len(piece)
        if obs:
            piece = tokenizer(obs, add_special_tokens=False)["input_ids"]
            ids, mask = ids + piece, mask + [0] * len(piece)
        cuts.append(len(ids))
    attention = [0] * pad_left + [1] * (len(ids) - pad_left) + [0, 0]
    ids, mask = ids + [tokenizer.pad_token_id] * 2, [*mask, 0, 0]
    return ids, mask, attention, pad_left + len(prompt), cuts


def test_probe_log_belief_equals_a_direct_computation(tiny_backbone):
    model, tokenizer = tiny_backbone
    env = TwentyQuestionsEnvironment(num_items=8, max_turns=4)
    state = env.reset(FOX)
    turns = ["<search>alive</search>", "<search>big</search>", "<answer>fox</answer>"]
    observations = [env.step(state, t).observation for t in turns]
    rows, cuts_all, prompt_length = [], [], None
    for _row in range(2):  # two identical rows: one group, every turn has zero advantage
        ids, mask, attention, prompt_length, cuts = _scripted_rollout(tokenizer, turns, observations)
        rows.append((ids, mask, attention))
        cuts_all.append(cuts)
    rollout = Rollout(
        input_ids=torch.tensor([r[0] for r in rows]),
        attention_mask=torch.tensor([r[2] for r in rows]),
        loss_mask=torch.tensor([r[1] for r in rows], dtype=torch.bool),
        prompt_length=prompt_length,
        group_ids=torch.tensor([0, 0]),
        completions=["", ""],
        examples=[FOX, FOX],
        rewards=torch.tensor([env.reward(state, FOX, "")] * 2),
        metadata={"env_states": [state, state]},
    )
    logged = {}
    module = SimpleNamespace(
        model=model, tokenizer=tokenizer, env=env, log=lambda k, v, **kw: logged.__setitem__(k, float(v))
    )
    DeltaBeliefReward(coef=0.1).on_rollout_end(None, module, rollout)
    out = rollout.metadata["delta_belief"]

    # Direct: full logits of context + "<answer>" + "fox", summed log-softmax over the target's tokens.
    prefix = tokenizer("<answer>", add_special_tokens=False)["input_ids"]
    target = tokenizer("fox", add_special_tokens=False)["input_ids"]
    ids = rollout.input_ids[0].tolist()
    direct = []
    for cut in cuts_all[0]:
        seq = torch.tensor([ids[2:cut] + prefix + target])
        with torch.no_grad():
            logits = model(seq).logits.log_softmax(-1)[0]
        n = len(target)
        direct.append(sum(float(logits[seq.shape[1] - n - 1 + j, target[j]]) for j in range(n)))
    assert out["log_belief"][0, :4].tolist() == pytest.approx(direct, abs=1e-4)
    assert out["num_turns"].tolist() == [3, 3]
    delta = [direct[k + 1] - direct[k] for k in range(3)]
    assert out["delta_belief"][0].tolist() == pytest.approx(delta, abs=1e-4)
    r_end = 2.0 - 0.05 * 3
    expected = [0.1 * max(d, 0.0) for d in delta]
    expected[-1] += r_end
    assert out["turn_rewards"][0].tolist() == pytest.approx(expected, abs=1e-4)
    assert torch.all(rollout.advantages == 0)  # identical rows: no advantage anywhere
    assert logged["train/DeltaBelief/turns"] == 3.0
    assert logged["train/DeltaBelief/delta_belief"] == pytest.approx(sum(delta) / 3, abs=1e-4)

    # The batched helper agrees with itself under other padding and batch sizes.
    contexts = [ids[2:c] for c in cuts_all[0]]
    again = belief_logprobs(
        model, contexts, prefix, [target] * 4, pad_id=tokenizer.pad_token_id, batch_size=3
    )
    assert again.tolist() == pytest.approx(direct, abs=1e-4)
    mean = belief_logprobs(model, contexts[:1], prefix, [target], pad_id=0, reduction="mean")
    assert mean.item() == pytest.approx(direct[0] / len(target), abs=1e-4)


def test_advantages_are_constant_per_turn_and_follow_the_turn_rewards(tiny_backbone):
    model, tokenizer = tiny_backbone
    env = TwentyQuestionsEnvironment(num_items=8, max_turns=4)
    scripts = [
        ["<search>alive</search>", "<search>alive</search>", "<answer>fox</answer>"],  # repeat, then win
        ["<search>wings</search>", "<answer>cow</answer>"],  # invalid, wrong guess; ended by the test
    ]
    rows, states = [], []
    for script in scripts:
        state = env.reset(FOX)
        observations = [env.step(state, t).observation for t in script]
        rows.append(_scripted_rollout(tokenizer, script, observations))
        states.append(state)
    width = max(len(r[0]) for r in rows)
    right = [lambda v, fill: v + [fill] * (width - len(v))][0]
    rollout = Rollout(
        input_ids=torch.tensor([right(r[0], tokenizer.pad_token_id) for r in rows]),
        attention_mask=torch.tensor([right(r[2], 0) for r in rows]),
        loss_mask=torch.tensor([right(r[1], 0) for r in rows], dtype=torch.bool),
        prompt_length=rows[0][3],
        group_ids=torch.tensor([0, 0]),
        completions=["", ""],
        examples=[FOX, FOX],
        rewards=torch.tensor([env.reward(s, FOX, "") for s in states]),
        metadata={"env_states": states},
    )
    module = SimpleNamespace(model=model, tokenizer=tokenizer, env=env, log=lambda *a, **k: None)
    DeltaBeliefReward(coef=0.1, scale="none").on_rollout_end(None, module, rollout)
    out = rollout.metadata["delta_belief"]
    rewards = out["turn_rewards"]
    assert rewards[0, 1] == pytest.approx(-1.0 + 0.1 * max(float(out["delta_belief"][0, 1]), 0.0))
    assert rewards[1, 0] == pytest.approx(-5.0 + 0.1 * max(float(out["delta_belief"][1, 0]), 0.0))
    assert rewards[0, 2] > 1.8 and rewards[1, 1] < 0  # r_end on the last turn: win 2 - 0.15 vs lost - 0.1
    for i, spans in enumerate(turn_spans(rollout.loss_mask)):
        for k, (start, stop) in enumerate(spans):
            values = rollout.advantages[i, start:stop]
            assert torch.all(values == values[0])
            mean = rewards[:, k][out["num_turns"] > k].mean() if k < 2 else rewards[0, k]
            assert values[0].item() == pytest.approx(float(rewards[i, k] - mean), abs=1e-5)
    assert torch.all(rollout.advantages[~rollout.loss_mask] == 0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="coef"):
        DeltaBeliefReward(coef=-1)
    with pytest.raises(ValueError, match="target"):
        DeltaBeliefReward(probe="no slot")
    with pytest.raises(ValueError, match="missing_turns"):
        DeltaBeliefReward(missing_turns="drop")
    with pytest.raises(ValueError, match="gamma"):
        DeltaBeliefReward(gamma=2.0)


def test_callback_runs_under_grpo(tiny_backbone, quiet_trainer):
    task = {
        "task": "twenty_questions",
        "task_kwargs": {"num_items": 8, "max_turns": 4},
        "num_train": 8,
        "num_val": 2,
    }
    env = TwentyQuestionsEnvironment(num_items=8, max_turns=4)
    module = GRPOModule(
        group_size=4, max_new_tokens=6, env=env, rewards=["env", "task"], reward_weights=[1, 0]
    )
    seen = {}

    class Spy(DeltaBeliefReward):
        def on_rollout_end(self, trainer, pl_module, rollout):
            super().on_rollout_end(trainer, pl_module, rollout)
            seen["rollout"] = rollout

    quiet_trainer(max_steps=1, callbacks=[Spy()]).fit(module, PromptDataModule(**task, batch_size=2))
    rollout = seen["rollout"]
    out = rollout.metadata["delta_belief"]
    assert out["log_belief"].shape[0] == rollout.num_rows == 8
    assert torch.isfinite(out["log_belief"]).all() and (out["log_belief"] <= 0).all()
    assert torch.all(rollout.advantages[~rollout.loss_mask] == 0)
    metrics = module.trainer.callback_metrics
    assert "train/DeltaBelief/delta_belief" in metrics or out["num_turns"].sum() == 0
