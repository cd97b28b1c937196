"""GRPOModule's core contracts: the reference is the policy at RL start and never in checkpoints, silent no-ops
are refused or announced, hyper-parameters reload the same module, and the model is built in configure_model."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_llm.callbacks import EntropyDiscriminatorClipping, LLDSRegularizer, SFTWarmup
from lightning_llm.datamodules import PromptDataModule
from lightning_llm.lora import LoRAConfig
from lightning_llm.modules import CausalLMModule, DPOModule, GRPOModule
from lightning_llm.rewards import register_reward


def _prompts(**kw):
    defaults = dict(
        task="arithmetic", task_kwargs={"digits": 1, "ops": "+"}, num_train=40, num_val=4, batch_size=2
    )
    return PromptDataModule(**{**defaults, **kw})


class _KL(Callback):
    """Every logged train/kl (one value per rollout batch)."""

    def __init__(self) -> None:
        self.kl: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.kl.append(float(trainer.callback_metrics["train/kl"]))
        self.losses.append(float(trainer.callback_metrics["train/loss/policy"]))


@pytest.mark.parametrize(
    "lora", [None, LoRAConfig(r=4, target_modules=["q_proj", "v_proj"])], ids=["full", "lora"]
)
def test_kl_is_zero_at_the_first_rl_step_after_a_warmup(lora, tiny_backbone, quiet_trainer):
    """The reference is the warmed-up policy, not the pretrained one (the old deep copy at construction)."""
    L.seed_everything(0)
    module = GRPOModule(group_size=2, max_new_tokens=4, beta=0.1, lr=1e-3, lora=lora)
    kl = _KL()
    quiet_trainer(max_steps=1, callbacks=[SFTWarmup(steps=5, lr=3e-2, batch_size=8), kl]).fit(
        module, _prompts()
    )
    assert kl.kl == [0.0]
    kind = "adapters-off" if lora else "snapshot"
    assert module.reference.kind == kind


def test_lora_reference_needs_no_copy_and_full_reference_is_loaded(tiny_backbone, quiet_trainer):
    lora = GRPOModule(
        group_size=2, max_new_tokens=4, beta=0.1, lora=LoRAConfig(r=2, target_modules=["q_proj"])
    )
    full = GRPOModule(group_size=2, max_new_tokens=4, beta=0.1)
    for module in (lora, full):
        quiet_trainer(max_steps=1).fit(module, _prompts())
    assert lora.reference.kind == "adapters-off" and lora.reference._copy is None
    assert full.reference.kind == "loaded"


def _checkpoint_state(tmp_path, beta, lora=None):
    L.seed_everything(0)
    module = GRPOModule(group_size=2, max_new_tokens=4, beta=beta, lora=lora)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[ckpt],
        default_root_dir=tmp_path,
    ).fit(module, _prompts())
    path = next(tmp_path.glob("*.ckpt"))
    return path, torch.load(path, weights_only=True)


@pytest.mark.parametrize("lora", [None, LoRAConfig(r=2, target_modules=["q_proj"])], ids=["full", "lora"])
def test_reference_is_not_written_into_checkpoints(lora, tiny_backbone, tmp_path):
    with_kl, state = _checkpoint_state(tmp_path / "kl", 0.1, lora)
    without, plain = _checkpoint_state(tmp_path / "plain", 0.0, lora)
    assert sorted(state["state_dict"]) == sorted(plain["state_dict"])
    assert "weights" not in state["grpo_reference"]  # rebuilt on resume: from the name, or adapters off
    assert abs(with_kl.stat().st_size - without.stat().st_size) < 16_384


class _Rows(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})


@pytest.mark.parametrize("warmup", [False, True], ids=["loaded-reference", "snapshot-after-warmup"])
def test_resume_with_a_kl_penalty_is_exact(warmup, tiny_backbone, tmp_path, quiet_trainer):
    # a reward that varies within groups, so the policy moves away from the reference and the KL is not 0
    kw = dict(rewards=["test_core_length"], group_size=4, max_new_tokens=6, lr=1e-3, mini_batches=2, beta=0.2)

    def callbacks():
        return [SFTWarmup(steps=3, lr=1e-2, batch_size=8)] if warmup else []

    L.seed_everything(0)
    full = _Rows()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    quiet_trainer(max_steps=8, callbacks=[*callbacks(), full, ckpt], enable_checkpointing=True).fit(
        GRPOModule(**kw), _prompts()
    )
    L.seed_everything(1)  # must not matter
    resumed = _Rows()
    quiet_trainer(max_steps=8, callbacks=[*callbacks(), resumed]).fit(
        GRPOModule(**kw), _prompts(), ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    )
    assert resumed.rows == full.rows[2:]
    assert all(row["train/kl"] > 0 for row in resumed.rows)


def test_llds_without_several_updates_is_refused(tiny_backbone, quiet_trainer):
    with pytest.raises(ValueError, match="adds exactly 0"):
        quiet_trainer(max_steps=1, callbacks=[LLDSRegularizer()]).fit(GRPOModule(group_size=2), _prompts())


def test_clip_v_below_its_token_floor_warns(tiny_backbone, quiet_trainer):
    module = GRPOModule(group_size=2, max_new_tokens=4)
    with pytest.warns(UserWarning, match="drops nothing"):
        quiet_trainer(max_steps=1, callbacks=[EntropyDiscriminatorClipping(mode="vocab")]).fit(
            module, _prompts()
        )


@pytest.mark.parametrize("module_class", [CausalLMModule, DPOModule])
def test_rl_callbacks_on_modules_without_rl_are_refused(module_class, tiny_backbone, quiet_trainer):
    from lightning_llm.datamodules import ChatSFTDataModule, HoneypotPreferenceDataModule

    data = (
        ChatSFTDataModule(num_train=4, num_val=0)
        if module_class is CausalLMModule
        else HoneypotPreferenceDataModule(num_train=8, num_val=0)
    )
    with pytest.raises(ValueError, match="runs no RL loop"):
        quiet_trainer(max_steps=1, callbacks=[LLDSRegularizer()]).fit(module_class(), data)


def test_all_zero_variance_groups_warn_once(tiny_backbone, quiet_trainer):
    module = GRPOModule(rewards=["format"], group_size=2, max_new_tokens=2)  # 2 tokens: never a full <answer>
    with pytest.warns(UserWarning, match="identical rewards") as caught:
        quiet_trainer(max_steps=3).fit(module, _prompts())
    assert sum("identical rewards" in str(w.message) for w in caught) == 1


@register_reward("test_core_length")
def _length(completions, examples):
    return [len(c) / 10 for c in completions]


@register_reward("test_core_constant")
def _constant(completions, examples):
    return [0.5] * len(completions)


def test_load_from_checkpoint_rebuilds_the_same_module(tiny_backbone, tmp_path, quiet_trainer):
    kw = dict(rewards=["task", _constant], reward_weights=[1.0, 0.5], group_size=2, max_new_tokens=3, lr=2e-3)
    module = GRPOModule(**kw, lora=LoRAConfig(r=2, target_modules=["q_proj"]))
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, _prompts())
    path = tmp_path / "grpo.ckpt"
    trainer.save_checkpoint(path)
    loaded = GRPOModule.load_from_checkpoint(path, weights_only=True)
    assert loaded.hparams.rewards == loaded.reward_specs == ["task", "test_core_constant"]
    assert loaded.reward_weights == [1.0, 0.5]
    assert loaded.hparams.lora == module.hparams.lora and loaded.hparams.lr == 2e-3
    for (name, a), b in zip(module.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_unregistered_reward_callable_fails_clearly_on_reload(tiny_backbone, tmp_path, quiet_trainer):
    module = GRPOModule(
        rewards=[lambda completions, examples: [0.0] * len(completions)], group_size=2, max_new_tokens=2
    )
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, _prompts())
    trainer.save_checkpoint(tmp_path / "x.ckpt")
    with pytest.raises(ValueError, match="not registered"):
        GRPOModule.load_from_checkpoint(tmp_path / "x.ckpt", weights_only=True)


def test_the_model_is_built_in_configure_model(tiny_backbone):
    module = GRPOModule()
    assert not module.model_built  # construction loads the tokenizer only
    module.configure_model()
    assert module.model_built and module.model.training


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {"max_new_tokens": 0}, {"eval_max_new_tokens": 0}])
def test_bad_sampling_arguments_fail_at_construction(kwargs):
    with pytest.raises(ValueError):
        GRPOModule(**kwargs)
