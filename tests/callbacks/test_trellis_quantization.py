"""TrellisQuantization: quantises the tiny backbone at the end of fit, saves it, and the reload matches."""

from __future__ import annotations

import pytest
import torch

from lightning_llm.callbacks.trellis_quantization import TrellisQuantization
from lightning_llm.quantization import TrellisLinear, load_quantized


def test_quantizes_at_fit_end_and_saves(quiet_trainer, tmp_path):
    from lightning_llm.datamodules import ChatSFTDataModule
    from lightning_llm.modules.causal_lm import CausalLMModule

    module = CausalLMModule()
    data = ChatSFTDataModule(task="arithmetic", num_train=4, num_val=0, batch_size=2)
    cb = TrellisQuantization("qtip-1mad", L=6, save_dir=tmp_path / "q", chunk_tiles=4096)
    quiet_trainer(max_steps=1, callbacks=[cb]).fit(module, datamodule=data)
    assert len(cb.quantized_layers) == 28
    assert isinstance(module.model.get_submodule(cb.quantized_layers[0]), TrellisLinear)
    assert (tmp_path / "q" / "tokenizer_config.json").exists()
    reloaded = load_quantized(tmp_path / "q")
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    module.model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, module.model(ids).logits)
    restored = TrellisQuantization()
    restored.load_state_dict(cb.state_dict())
    assert restored.quantized_layers == cb.quantized_layers


def test_on_demand_and_errors(tiny_backbone):
    from lightning_llm.backbones import load_backbone

    model, _ = load_backbone("tiny")
    cb = TrellisQuantization("rtn", at_fit_end=False, skip=("lm_head", "mlp"))
    cb.quantize(model)
    assert len(cb.quantized_layers) == 16 and all("mlp" not in n for n in cb.quantized_layers)
    with pytest.raises(ValueError, match="method"):
        TrellisQuantization("gptq")


def test_calibration_distills_after_quantising(quiet_trainer, tmp_path):
    from lightning_llm.datamodules import ChatSFTDataModule
    from lightning_llm.modules.causal_lm import CausalLMModule

    module = CausalLMModule()
    data = ChatSFTDataModule(task="arithmetic", num_train=8, num_val=0, batch_size=4)
    cb = TrellisQuantization(
        "proteus",
        L=6,
        calibration=1,
        distill_steps=3,
        save_dir=tmp_path / "q",
        chunk_tiles=4096,
        proxy_tiles=1,
    )
    quiet_trainer(max_steps=1, callbacks=[cb]).fit(module, datamodule=data)
    assert cb.distillation["steps"] == 3 and cb.distillation["kl_after"] <= cb.distillation["kl_before"]
    reloaded = load_quantized(tmp_path / "q")
    assert reloaded.trellis_quantization["distillation"] == cb.distillation
    restored = TrellisQuantization()
    restored.load_state_dict(cb.state_dict())
    assert restored.distillation == cb.distillation


def test_fast_dev_run_uses_a_short_trellis(quiet_trainer):
    from lightning_llm.datamodules import ChatSFTDataModule
    from lightning_llm.modules.causal_lm import CausalLMModule

    module = CausalLMModule()
    data = ChatSFTDataModule(task="arithmetic", num_train=4, num_val=0, batch_size=2)
    cb = TrellisQuantization("qtip-1mad", L=16, chunk_tiles=4096)
    quiet_trainer(callbacks=[cb], fast_dev_run=True).fit(module, datamodule=data)
    layer = module.model.get_submodule(cb.quantized_layers[0])
    assert layer.L == 8 and len(cb.quantized_layers) == 28


def test_bad_calibration_is_rejected():
    for bad in (0, True, "text", [], [1, 2]):
        with pytest.raises(ValueError, match="calibration"):
            TrellisQuantization(calibration=bad)
