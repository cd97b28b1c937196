"""DPOModule: the loss equals its formula, sequence log-probs equal the logits' sum, the reference stays frozen,
training separates the pairs, and a mid-run checkpoint resumes exactly."""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_llm.datamodules import HoneypotPreferenceDataModule
from lightning_llm.lora import LoRAConfig, lora_layers
from lightning_llm.modules import DPOModule, dpo_loss, sequence_logprobs


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])


def _pairs(**kw) -> HoneypotPreferenceDataModule:
    defaults = dict(num_train=48, num_val=8, batch_size=4, max_length=96, seed=0)
    return HoneypotPreferenceDataModule(**{**defaults, **kw})


def test_dpo_loss_equals_a_hand_computed_value():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -2.0, -1.5, -1.5))
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # z = 0.5 * ((-1 + 1.5) - (-2 + 1.5)) = 0.5; loss = -log sigmoid(0.5) = log(1 + e^-0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.5)), abs=1e-6)
    assert (chosen.item(), rejected.item()) == pytest.approx((0.25, -0.25))
    smoothed, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.2)
    expected = 0.8 * math.log1p(math.exp(-0.5)) + 0.2 * math.log1p(math.exp(0.5))
    assert smoothed.item() == pytest.approx(expected, abs=1e-6)


def test_sequence_logprobs_equal_the_logits_sum(tiny_backbone):
    model, _ = tiny_backbone
    torch.manual_seed(0)
    ids = torch.randint(5, 200, (3, 11))
    attention = torch.ones_like(ids)
    attention[2, 8:] = 0
    labels = torch.full_like(ids, -100)
    labels[0, 4:] = ids[0, 4:]
    labels[1, 9:] = ids[1, 9:]
    labels[2, 3:8] = ids[2, 3:8]
    total, count = sequence_logprobs(model, ids, attention, labels)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits.float()
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    expected = (logp * (labels[:, 1:] != -100)).sum(-1)
    torch.testing.assert_close(total, expected, rtol=1e-4, atol=1e-4)
    assert count.tolist() == [7, 2, 5]


def test_initial_loss_is_log2_and_training_separates_pairs(tiny_backbone, quiet_trainer):
    L.seed_everything(0)
    module = DPOModule(beta=0.5, lr=1e-3, warmup_ratio=0.0)
    data = _pairs()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        assert module.objective(batch)[0].item() == pytest.approx(
            math.log(2), abs=1e-5
        )  # policy == reference
    with module.reference.model(module.model) as reference:
        ref_before = {k: v.clone() for k, v in reference.state_dict().items()}
    recorder = LossRecorder()
    quiet_trainer(max_steps=12, callbacks=[recorder]).fit(module, data)
    with module.reference.model(module.model) as reference:
        for key, value in reference.state_dict().items():
            assert torch.equal(value, ref_before[key]), key  # the reference never moves
        assert not reference.training
    with torch.no_grad():
        after = module.objective(batch)[0].item()
    assert after < math.log(2) - 0.1, after
    pc, pr, rc, rr, _ = module.pair_logprobs(batch)
    assert ((pc - rc) - (pr - rr) > 0).float().mean() > 0.7


def test_sft_weight_adds_the_chosen_tokens_mean_nll(tiny_backbone):
    """As TRL's loss_type=["sigmoid", "sft"]: the NLL averaged over all chosen tokens of the batch."""
    data = _pairs()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    plain, anchored = DPOModule(), DPOModule(sft_weight=2.0)
    with torch.no_grad():
        pc, _, _, _, lengths = plain.pair_logprobs(batch)
        expected = math.log(2) + 2.0 * (-pc.sum() / lengths.sum()).item()
        assert anchored.objective(batch)[0].item() == pytest.approx(expected, rel=1e-5)


def test_lora_reference_is_the_base_with_adapters_off_and_no_copy(tiny_backbone):
    L.seed_everything(0)
    module = DPOModule(lora=LoRAConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for layer in lora_layers(module.model).values():
            layer.lora_B.weight.normal_()  # the adapter moved the policy away from its base
    data = _pairs()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        pc, _pr, rc, _rr, _ = module.pair_logprobs(batch)
        base, *_ = DPOModule().pair_logprobs(batch)
    assert module.reference.kind == "adapters-off"
    torch.testing.assert_close(rc, base)  # the reference is the un-adapted model...
    assert not torch.allclose(pc, rc)  # ...while the policy is not
    assert module.reference._copy is None  # no second model in memory


@pytest.mark.parametrize("kwargs", [{"beta": 0.0}, {"label_smoothing": 0.5}, {"sft_weight": -1.0}])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        DPOModule(**kwargs)


def test_sft_batches_are_refused_clearly(tiny_backbone):
    with pytest.raises(ValueError, match="preference batches"):
        DPOModule().pair_logprobs({"input_ids": torch.ones(1, 3, dtype=torch.long)})


def test_resume_from_mid_run_checkpoint_is_exact(tiny_backbone, tmp_path, quiet_trainer):
    """Stop at step 3 of 6 (mid-epoch), resume: steps 4-6 give identical losses (reference restored too)."""
    L.seed_everything(0)
    full = LossRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, save_last=False)
    kw = dict(lr=1e-3, sft_weight=0.5)
    quiet_trainer(max_steps=6, callbacks=[full, ckpt], enable_checkpointing=True).fit(
        DPOModule(**kw), _pairs()
    )
    path = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    state = torch.load(path, weights_only=True)
    policy = {k for k in state["state_dict"]}
    assert all(key.startswith("model.") for key in policy)  # the reference is not in the checkpoint
    L.seed_everything(123)
    resumed = LossRecorder()
    quiet_trainer(max_steps=6, callbacks=[resumed]).fit(DPOModule(**kw), _pairs(), ckpt_path=str(path))
    assert sorted(resumed.losses) == [4, 5, 6]
    for step, loss in resumed.losses.items():
        assert loss == full.losses[step], (step, loss, full.losses[step])
