import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_llm.backbones import load_backbone
from lightning_llm.datamodules import ChatSFTDataModule, PCFGDataModule
from lightning_llm.modules import CausalLMModule
from lightning_llm.modules.causal_lm import warmup_cosine


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])


def _datamodule(**kw) -> ChatSFTDataModule:
    defaults = dict(task="arithmetic", num_train=96, num_val=16, batch_size=8, max_length=64, seed=3)
    return ChatSFTDataModule(**{**defaults, **kw})


def test_loss_matches_transformers_token_mean(tiny_backbone):
    module = CausalLMModule()
    dm = _datamodule()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    loss, logged = module._loss(batch)
    reference = module.model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    ).loss
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logged, reference.detach(), rtol=1e-5, atol=1e-5)


def test_prompt_tokens_get_no_loss(tiny_backbone):
    """Changing a label-masked (prompt) token's *target* must not change the loss."""
    module = CausalLMModule()
    dm = _datamodule()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    mask = batch["labels"] != -100
    base, _ = module._loss(batch)
    assert 0 < mask.sum() < mask.numel()
    # Only labelled positions reach the LM head: the number of log-probs equals the number of labels
    # (the first token of a row can never be a target).
    logprobs, entropy = module.token_logprobs(batch)
    assert logprobs.shape == entropy.shape == (int(mask[:, 1:].sum()),)
    assert torch.isfinite(base)


def test_gradient_checkpointing_gives_same_gradients(tiny_backbone):
    dm = _datamodule()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    grads = []
    for checkpointing in (False, True):
        module = CausalLMModule(gradient_checkpointing=checkpointing)
        module.model.train()
        loss, _ = module._loss(batch)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in module.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_warmup_cosine_schedule():
    assert warmup_cosine(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(9, 100, 10, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(10, 100, 10, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(55, 100, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(500, 100, 0, 0.0) == pytest.approx(0.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"lr": 0.0}, "lr"), ({"warmup_ratio": 1.0}, "warmup_ratio"), ({"min_lr_ratio": 2.0}, "min_lr_ratio")],
)
def test_bad_arguments_fail_at_construction(kwargs, match, tiny_backbone):
    with pytest.raises(ValueError, match=match):
        CausalLMModule(**kwargs)


def test_fit_saves_reloadable_model(tiny_backbone, tmp_path, quiet_trainer):
    save_dir = tmp_path / "model"
    module = CausalLMModule(save_dir=str(save_dir))
    quiet_trainer(max_steps=2).fit(module, _datamodule())
    assert (save_dir / "model.safetensors").is_file()
    reloaded, tokenizer = load_backbone(str(save_dir))
    ids = torch.tensor([tokenizer("What is 3 + 4?")["input_ids"]])
    module.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, module.model(ids).logits)
    # generation helper returns plain strings
    out = module.generate(["What is 3 + 4?"], max_new_tokens=4)
    assert isinstance(out, list) and isinstance(out[0], str)


def _pcfg_datamodule() -> PCFGDataModule:
    return PCFGDataModule(random_grammar={"levels": 3, "seed": 1}, num_train=96, num_val=16, batch_size=8)


@pytest.mark.parametrize("make_datamodule", [_datamodule, _pcfg_datamodule], ids=["chat_sft", "pcfg"])
def test_resume_from_mid_run_checkpoint_is_exact(tiny_backbone, tmp_path, quiet_trainer, make_datamodule):
    """Stop at step 3 of 7 (mid-epoch), resume from the checkpoint: steps 4-7 give identical losses."""
    L.seed_everything(0)
    full = LossRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, save_last=False)
    quiet_trainer(max_steps=7, callbacks=[full, ckpt], enable_checkpointing=True).fit(
        CausalLMModule(), make_datamodule()
    )
    path = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    assert path.is_file(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    state = torch.load(path, weights_only=True)  # checkpoints contain no pickled objects
    assert state["global_step"] == 3

    L.seed_everything(123)  # a different global seed must not matter: all randomness is restored
    resumed = LossRecorder()
    quiet_trainer(max_steps=7, callbacks=[resumed]).fit(
        CausalLMModule(), make_datamodule(), ckpt_path=str(path)
    )
    assert sorted(resumed.losses) == [4, 5, 6, 7]
    for step, loss in resumed.losses.items():
        assert loss == full.losses[step], (step, loss, full.losses[step])


def test_encode_prompts_left_pads_chat_rendered_prompts_and_generate_uses_them(tiny_backbone):
    module = CausalLMModule().eval()
    enc = module.encode_prompts(
        ["1+1?", "What is 12 + 30 - 7? Evaluate left to right."], system_prompt="Be brief."
    )
    assert set(enc) == {"input_ids", "attention_mask"}
    assert enc["attention_mask"][0, 0] == 0 and enc["attention_mask"][:, -1].all()  # left padding
    assert module.tokenizer.padding_side == "right"  # restored for training
    text = module.tokenizer.decode(enc["input_ids"][1], skip_special_tokens=False)
    assert "Be brief." in text and "12 + 30" in text
    ids = module.generate_ids(**enc, max_new_tokens=4)
    assert ids == module.generate(
        ["1+1?", "What is 12 + 30 - 7? Evaluate left to right."], max_new_tokens=4, system_prompt="Be brief."
    )
