"""LoRA layers: one table of adapter configurations, every row gets the same merge/save/load/dtype tests.

PEFT compatibility is checked against PEFT itself: an adapter we save is loaded with
``peft.PeftModel.from_pretrained`` and must produce our logits, and one PEFT saves must load into ours.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from lightning_llm.backbones import load_backbone
from lightning_llm.lora import (
    LoRAConfig,
    LoRALinear,
    apply_lora,
    load_adapter,
    lora_layers,
    merge_lora,
    save_adapter,
    stable_rank,
)

# Output tolerances: fp32 ops on the same weights in a different association order.
ATOL_FP32 = 1e-5
# bf16 keeps 8 mantissa bits: logits of order 1-10 round at ~0.03-0.06.
ATOL_BF16 = 1e-1

CONFIGS = {
    "attention-r4": LoRAConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-linear-r8": LoRAConfig(r=8, alpha=16, target_modules="all-linear"),
    "mlp-rslora": LoRAConfig(
        r=3, alpha=6, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True
    ),
    "dropout": LoRAConfig(r=2, alpha=4, target_modules=["o_proj"], dropout=0.1),
}


@pytest.fixture
def base(tiny_backbone):
    model, _ = tiny_backbone
    return copy.deepcopy(model).eval()


def _randomize(model: nn.Module, seed: int = 0) -> None:
    """Give B nonzero values (it starts at 0, which would make every comparison trivial)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.1)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 1000, (2, 11), generator=torch.Generator().manual_seed(seed))


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_starts_at_base_model(base, name):
    ids = _ids()
    expected = _logits(base, ids)
    torch.manual_seed(0)
    model = apply_lora(copy.deepcopy(base), CONFIGS[name])
    torch.testing.assert_close(_logits(model, ids), expected, atol=ATOL_FP32, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_only_adapters_train(base, name):
    model = apply_lora(base, CONFIGS[name])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    config = CONFIGS[name]
    expected = config.r * sum(layer.in_features + layer.out_features for layer in lora_layers(model).values())
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected


@pytest.mark.parametrize("name", list(CONFIGS))
def test_merge_unmerge(base, name):
    model = apply_lora(base, CONFIGS[name])
    _randomize(model)
    ids = _ids()
    before = _logits(model, ids)
    weights = {n: layer.base_layer.weight.clone() for n, layer in lora_layers(model).items()}
    for layer in lora_layers(model).values():
        layer.merge()
    torch.testing.assert_close(_logits(model, ids), before, atol=ATOL_FP32, rtol=0)
    for n, layer in lora_layers(model).items():
        layer.unmerge()
        torch.testing.assert_close(layer.base_layer.weight, weights[n], atol=1e-6, rtol=0)
    torch.testing.assert_close(_logits(model, ids), before, atol=ATOL_FP32, rtol=0)
    merged = merge_lora(model)
    assert not lora_layers(merged)
    torch.testing.assert_close(_logits(merged, ids), before, atol=ATOL_FP32, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_load_roundtrip(base, name, tmp_path):
    fresh = copy.deepcopy(base)
    model = apply_lora(base, CONFIGS[name])
    _randomize(model)
    ids = _ids()
    save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == CONFIGS[name].r
    loaded = load_adapter(fresh, tmp_path)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), atol=ATOL_FP32, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_peft_loads_our_adapter(base, name, tmp_path):
    peft = pytest.importorskip("peft")
    fresh = copy.deepcopy(base)
    model = apply_lora(base, CONFIGS[name])
    _randomize(model)
    save_adapter(model, tmp_path)
    peft_model = peft.PeftModel.from_pretrained(fresh, tmp_path).eval()
    ids = _ids()
    torch.testing.assert_close(_logits(peft_model, ids), _logits(model, ids), atol=ATOL_FP32, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16(tiny_backbone, name):
    model, _ = tiny_backbone
    model = copy.deepcopy(model).to(torch.bfloat16).eval()
    reference = apply_lora(copy.deepcopy(model).float(), CONFIGS[name])
    _randomize(reference)
    lora = apply_lora(model, CONFIGS[name])
    lora.load_state_dict({k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()})
    assert all(layer.lora_A.weight.dtype == torch.bfloat16 for layer in lora_layers(lora).values())
    ids = _ids()
    out = _logits(lora, ids)
    torch.testing.assert_close(out, _logits(reference, ids), atol=ATOL_BF16, rtol=0)
    assert torch.isfinite(out).all()


def test_peft_saved_adapter_loads_into_ours(base, tmp_path):
    peft = pytest.importorskip("peft")
    fresh = copy.deepcopy(base)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["k_proj", "down_proj"], init_lora_weights=False
    )
    peft_model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    peft_model.save_pretrained(tmp_path)
    ours = load_adapter(fresh, tmp_path)
    ids = _ids()
    torch.testing.assert_close(_logits(ours, ids), _logits(peft_model, ids), atol=ATOL_FP32, rtol=0)


def test_gradients_reach_only_the_factors(base):
    model = apply_lora(base, LoRAConfig(r=2, target_modules=["q_proj"]))
    model.train()
    _randomize(model)
    model(input_ids=_ids()).logits.square().mean().backward()
    for layer in lora_layers(model).values():
        assert layer.lora_A.weight.grad is not None and layer.lora_B.weight.grad is not None
        assert layer.base_layer.weight.grad is None


def test_errors(base, tmp_path):
    with pytest.raises(ValueError, match="linear layers here"):
        apply_lora(copy.deepcopy(base), target_modules=["nope"])
    with pytest.raises(ValueError, match="output head"):
        apply_lora(copy.deepcopy(base), target_modules=["lm_head"])
    with pytest.raises(ValueError, match="rank"):
        LoRAConfig(r=0)
    model = apply_lora(base, r=2, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="not cumulative"):
        apply_lora(model, r=2, target_modules=["q_proj"])
    with pytest.raises(FileNotFoundError, match=r"adapter_config\.json"):
        load_adapter(model, tmp_path)
    with pytest.raises(TypeError, match=r"nn\.Linear"):
        LoRALinear(nn.Conv1d(2, 2, 1), r=1, scale=1.0)
    next(iter(lora_layers(model).values())).base_modified.fill_(True)
    with pytest.raises(ValueError, match="folded into the base weights"):
        save_adapter(model, tmp_path)


def test_stable_rank():
    assert stable_rank(torch.zeros(3, 4)) == 0.0
    assert stable_rank(torch.outer(torch.randn(5), torch.randn(7))) == pytest.approx(1.0)
    assert stable_rank(torch.eye(6)) == pytest.approx(6.0)


def test_module_lora_argument_and_save_dir(tmp_path, tiny_backbone):
    from lightning_llm.modules import CausalLMModule

    module = CausalLMModule(lora=LoRAConfig(r=2, target_modules=["q_proj", "v_proj"]), save_dir=str(tmp_path))
    assert module.hparams["lora"]["r"] == 2 and len(lora_layers(module.model)) == 8
    _randomize(module.model)
    ids = _ids()
    expected = _logits(module.model.eval(), ids)
    module.save_pretrained(tmp_path)
    reloaded, _ = load_backbone(str(tmp_path))
    torch.testing.assert_close(_logits(reloaded.eval(), ids), expected, atol=ATOL_FP32, rtol=0)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert lora_layers(module.model), "saving must not merge the live model"


def test_fused_op_path_matches_plain_path(base, monkeypatch):
    """On CUDA the layer calls the fused op; force that branch here (the op then runs its reference)."""
    import lightning_llm.lora as lora_module

    model = apply_lora(base, r=3, target_modules=["q_proj", "down_proj"])
    _randomize(model)
    model.train()
    ids = _ids()

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    plain_loss, plain_grads = loss_and_grads()
    monkeypatch.setattr(lora_module, "use_triton", lambda *tensors: True)
    fused_loss, fused_grads = loss_and_grads()
    torch.testing.assert_close(fused_loss, plain_loss, atol=ATOL_FP32, rtol=0)
    for fused, plain in zip(fused_grads, plain_grads, strict=True):
        torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("pattern", ["alpha_pattern", "rank_pattern"])
def test_per_layer_patterns_of_a_peft_adapter_are_refused(base, tmp_path, pattern):
    """One alpha and one rank for every layer here: a PEFT adapter with per-layer ones is refused, by name (an
    alpha_pattern used to load silently with the wrong scaling on its layers)."""
    peft = pytest.importorskip("peft")
    values = {"alpha_pattern": {"k_proj": 16}, "rank_pattern": {"k_proj": 2}}
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["k_proj", "down_proj"],
        init_lora_weights=False,
        **{pattern: values[pattern]},
    )
    peft.get_peft_model(copy.deepcopy(base), config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"{pattern}.*k_proj.*not supported"):
        load_adapter(copy.deepcopy(base), tmp_path)
