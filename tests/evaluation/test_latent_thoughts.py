"""``lightning_llm.evaluation.latent_thoughts`` on the tiny backbone: one arm's training, the trainable
``<thinking>`` row, and the SmolLM2 tokenization of ``<thinking>`` in the arms' data."""

import lightning as L
import pytest
import torch

from lightning_llm.backbones import load_backbone
from lightning_llm.datamodules import ChatSFTDataModule
from lightning_llm.evaluation import latent_thoughts as study
from lightning_llm.lora import LoRAConfig

TINY = dict(
    model="tiny",
    seed=0,
    num_train=16,
    num_eval=4,
    batch_size=8,
    ops="+",
    latent_steps=1,
    lora_r=4,
    lr=1e-2,
)


@pytest.mark.parametrize("train_row", [True, False])
def test_only_the_thinking_row_of_the_embeddings_trains_under_lora(tiny_backbone, train_row):
    module, _, record = study.train_arm("lt_tuning", train_thinking_row=train_row, **TINY)
    assert record["steps"] == 6
    pretrained = load_backbone("tiny")[0].get_input_embeddings().weight
    trained = module.model.get_input_embeddings().weight.detach()
    others = torch.ones(trained.shape[0], dtype=torch.bool)
    others[module.thinking_id] = False
    torch.testing.assert_close(trained[others], pretrained[others], rtol=0, atol=0)
    if train_row:  # the row moved from its initial draw (recorded when the model was built)
        assert (trained[module.thinking_id] - module.initial_thinking_row).abs().max() > 1e-4
    assert module.model.get_input_embeddings().weight.requires_grad is train_row


def test_thinking_row_needs_zero_weight_decay(tiny_backbone):
    module = study._StudyModule("tiny", weight_decay=0.01, lora=LoRAConfig(r=4))
    with pytest.raises(ValueError, match="weight_decay=0"):
        module.configure_model()


@pytest.mark.pretrained
def test_smollm2_data_tokenizes_thinking_as_one_token(smollm2_dir):
    # The DataModule (tokenizer=None) takes the fitted module's tokenizer, which has <thinking> added.
    module = study._StudyModule(smollm2_dir, num_latents=2, alpha=1.0, weight_decay=0.0)
    data = ChatSFTDataModule(
        task="arithmetic",
        task_kwargs={"digits": 1, "operands": 3, "ops": "+", "latent_steps": 1},
        num_train=8,
        num_val=4,
        batch_size=4,
    )
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    trainer.strategy.connect(module)
    data.trainer = trainer
    data.setup("fit")
    assert data.tokenizer is module.tokenizer
    thinking = module.tokenizer.convert_tokens_to_ids("<thinking>")
    assert thinking == module.thinking_id == len(module.tokenizer) - 1
    for item in data.train_items:
        ids = item["input_ids"]
        assert int((ids == thinking).sum()) == 2  # one token per placeholder, two reasoning steps
        first = int((ids == thinking).nonzero()[0])
        assert ids[first + 1] == thinking  # adjacent, as written: "<thinking><thinking><answer>"
        assert module.tokenizer.decode(ids[first + 2 :]).startswith("<answer>")
