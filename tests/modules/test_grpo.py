import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_llm.datamodules import Example, PromptDataModule, get_task
from lightning_llm.lm import position_ids_from_mask
from lightning_llm.modules.grpo import GRPOModule, group_advantages
from lightning_llm.rl import Rollout, Sampling, run_episodes


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    centred = torch.tensor([2 / 3, -1 / 3, -1 / 3, -4 / 3, 2 / 3, 2 / 3])
    torch.testing.assert_close(group_advantages(rewards, groups, "none"), centred)
    std0 = torch.tensor([1.0, 0.0, 0.0]).std()  # unbiased, as TRL
    std1 = torch.tensor([0.0, 2.0, 2.0]).std()
    expected = centred / torch.tensor([std0, std0, std0, std1, std1, std1]).add(1e-4)
    torch.testing.assert_close(group_advantages(rewards, groups, "group"), expected)
    torch.testing.assert_close(group_advantages(rewards, groups, "batch"), centred / (rewards.std() + 1e-4))
    # a group with identical rewards gets zero advantage, not NaN
    same = group_advantages(torch.ones(4), torch.tensor([0, 0, 1, 1]), "group")
    assert torch.equal(same, torch.zeros(4))


def _hand_rollout(tokenizer) -> Rollout:
    """Two rows: left-padded prompts, completions with an observation span masked out of the loss."""
    torch.manual_seed(0)
    ids = torch.randint(3, 200, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding of row 1
    ids[1, :2] = tokenizer.pad_token_id
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 5:] = True
    loss_mask[0, 8:10] = False  # "tool output" inside the completion of row 0
    rollout = Rollout(
        input_ids=ids,
        attention_mask=mask,
        loss_mask=loss_mask,
        prompt_length=5,
        group_ids=torch.tensor([0, 0]),
        completions=["", ""],
        examples=[Example("p", "c", "a")] * 2,
    )
    rollout.advantages = torch.tensor([[1.5], [-0.7]]) * loss_mask
    rollout.old_logprobs = torch.where(loss_mask, -torch.rand(2, 12) * 5, torch.zeros(2, 12))
    rollout.ref_logprobs = torch.where(loss_mask, -torch.rand(2, 12) * 5, torch.zeros(2, 12))
    return rollout


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean"])
def test_policy_loss_matches_hand_computation(aggregation, tiny_backbone):
    module = GRPOModule(beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_aggregation=aggregation)
    rollout = _hand_rollout(module.tokenizer)
    loss, stats = module.policy_loss(rollout, torch.arange(2))

    # Reference: full logits from the HF model, same positions as generation uses.
    logits = module.model(
        input_ids=rollout.input_ids,
        attention_mask=rollout.attention_mask,
        position_ids=position_ids_from_mask(rollout.attention_mask),
    ).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, rollout.input_ids[:, 1:, None])[..., 0]
    m = rollout.loss_mask[:, 1:]
    old, ref, adv = (
        t[:, 1:].double() for t in (rollout.old_logprobs, rollout.ref_logprobs, rollout.advantages)
    )
    ratio = torch.exp(logp - old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token = (-surrogate + 0.04 * kl) * m
    if aggregation == "token-mean":
        expected = per_token.sum() / m.sum()
    else:
        expected = (per_token.sum(1) / m.sum(1)).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    assert 0 <= stats["clip_ratio/region_mean"] <= 1


def test_tool_tokens_carry_zero_gradient(tiny_backbone):
    """The final hidden state that predicts an observation token gets exactly zero gradient (read from the one
    whole-row pass; the shared-prefix pass gives the same gradients, tests/rl/test_shared_prefix.py)."""
    module = GRPOModule(shared_prefix=False)
    rollout = _hand_rollout(module.tokenizer)
    rollout.old_logprobs = None  # ratio 1: no token is clipped, so every trainable token has a gradient
    captured = {}

    def keep(_module, _inputs, output):
        output.retain_grad()
        captured["h"] = output

    handle = module.model.model.norm.register_forward_hook(keep)
    try:
        loss, _ = module.policy_loss(rollout, torch.arange(2))
        loss.backward()
    finally:
        handle.remove()
    grad = captured["h"].grad  # [2, 12, H]; position t predicts token t + 1
    predicts_target = torch.zeros(2, 12, dtype=torch.bool)
    predicts_target[:, :-1] = rollout.loss_mask[:, 1:]
    assert grad[~predicts_target].abs().max() == 0
    assert grad[predicts_target].abs().sum(-1).min() > 0


class _ScriptedEngine:
    """A RolloutEngine that plays fixed turns, to test the episode loop without sampling."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, 0

    def generate(self, input_ids, attention_mask, *, sampling, stop_token_ids, pad_id):
        text = self.turns[self.calls]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor([ids] * input_ids.shape[0])


def test_multi_turn_episode_masks_observations(tiny_tokenizer):
    task = get_task("multihop_qa", num_entities=20, hops=1)
    env = task.make_env(max_turns=3)
    example = task.generate(1, seed=0)[0]
    turns = [
        f"<search>{example.metadata['titles'][0]}</search>",
        f"<answer>{example.answer}</answer><|im_end|>",
    ]
    engine = _ScriptedEngine(tiny_tokenizer, turns)
    prompt = tiny_tokenizer(["hi"], return_tensors="pt")
    ids, loss_mask, states = run_episodes(
        engine,
        tiny_tokenizer,
        prompt["input_ids"],
        prompt["attention_mask"],
        [example],
        sampling=Sampling(16),
        env=env,
    )
    text = tiny_tokenizer.decode(ids[0][loss_mask[0]])
    # exactly the model's own turns are trainable; the answer turn ends at its stop string "</answer>"
    assert text == "".join(turns).removesuffix("<|im_end|>")
    observation = tiny_tokenizer.decode(ids[0][~loss_mask[0] & (ids[0] != tiny_tokenizer.pad_token_id)])
    assert "<information>" in observation and "</information>" in observation
    assert env.reward(states[0], example, tiny_tokenizer.decode(ids[0])) == 1.0


class _Metrics(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})


def _trainer(tmp_path, steps, callbacks=()):
    return L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        callbacks=list(callbacks),
    )


def _prompts(**kw):
    return PromptDataModule(
        task="arithmetic", task_kwargs={"digits": 1, "ops": "+"}, num_train=40, num_val=8, batch_size=2, **kw
    )


def test_resume_is_exact(tiny_backbone, tmp_path):
    """Stopped after 2 of 4 rollout batches and resumed: the same rollouts, rewards and updates follow."""
    kw = dict(group_size=4, max_new_tokens=6, lr=1e-3, ppo_epochs=1, mini_batches=2)  # 2 updates per batch
    L.seed_everything(0)
    full = _Metrics()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    _trainer(tmp_path / "a", 8, [full, ckpt]).fit(GRPOModule(**kw), _prompts())
    assert len(full.rows) == 4  # max_steps counts optimizer updates: 8 updates = 4 rollout batches
    L.seed_everything(1)  # must not matter: the sampling RNG is restored from the checkpoint
    resumed = _Metrics()
    _trainer(tmp_path / "b", 8, [resumed]).fit(
        GRPOModule(**kw), _prompts(), ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    )
    assert len(resumed.rows) == 2
    assert resumed.rows == full.rows[2:]


def test_bad_arguments(tiny_backbone):
    with pytest.raises(ValueError, match="group_size"):
        GRPOModule(group_size=1)
    with pytest.raises(ValueError, match="reward_weights"):
        GRPOModule(rewards=["task", "format"], reward_weights=[1.0])
    with pytest.raises(ValueError, match="environment"):
        GRPOModule(rewards=["env"])
    with pytest.raises(ValueError, match="unknown reward"):
        GRPOModule(rewards=["nope"])
