import json

import pytest
import torch

from lightning_llm.backbones import TAG_TOKENS, TinyRecipe, eval_mode, load_backbone, load_tokenizer
from lightning_llm.backbones.tiny import tiny_directory


def test_tiny_is_small_llama_style(tiny_backbone):
    model, tokenizer = tiny_backbone
    n_params = sum(p.numel() for p in model.parameters())
    assert 500_000 < n_params < 5_000_000
    assert model.config.model_type == "llama"
    assert model.config.vocab_size >= len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_tiny_tokenizer_specials_and_chat_template(tiny_tokenizer):
    tok = tiny_tokenizer
    for tag in (*TAG_TOKENS, "<|im_start|>", "<|im_end|>"):
        ids = tok(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, tag
    # digits are single tokens, so "12345" is five tokens
    assert len(tok("12345", add_special_tokens=False)["input_ids"]) == 5
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    # tags survive decoding with skip_special_tokens, control tokens do not
    ids = tok("<|im_start|><think>a</think><answer>4</answer><|im_end|>", add_special_tokens=False)[
        "input_ids"
    ]
    assert tok.decode(ids, skip_special_tokens=True) == "<think>a</think><answer>4</answer>"


def test_tiny_build_is_deterministic(tmp_path, monkeypatch):
    digests = []
    for sub in ("a", "b"):
        monkeypatch.setenv("LIGHTNING_LLM_HOME", str(tmp_path / sub))
        manifest = json.loads((tiny_directory() / "manifest.json").read_text())
        digests.append(manifest["files"])
    assert digests[0] == digests[1]


def test_corrupt_or_partial_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_LLM_HOME", str(tmp_path))
    directory = tiny_directory()
    weights = directory / "model.safetensors"
    reference = weights.read_bytes()
    weights.write_bytes(reference[: len(reference) // 2])  # a truncated download / crashed write
    with pytest.warns(UserWarning, match="checksum mismatch"):
        assert tiny_directory() == directory
    assert weights.read_bytes() == reference
    (directory / "manifest.json").unlink()  # a build interrupted before its manifest
    with pytest.warns(UserWarning, match="no manifest"):
        tiny_directory()
    assert (directory / "manifest.json").is_file()


def test_recipe_changes_cache_key():
    assert TinyRecipe().key() != TinyRecipe(hidden_size=64).key()


def test_save_pretrained_round_trip_through_real_loader(tiny_backbone, tmp_path):
    model, tokenizer = tiny_backbone
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    reloaded, tok2 = load_backbone(str(tmp_path))
    ids = torch.tensor([tokenizer("What is 1 + 1?")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    assert tok2.get_vocab() == tokenizer.get_vocab()
    assert load_tokenizer(str(tmp_path)).chat_template == tokenizer.chat_template


def test_dtype_argument(tiny_backbone):
    model, _ = load_backbone("tiny", dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_eval_mode_restores_the_mode_also_on_errors():
    layer = torch.nn.Dropout(0.5)
    with eval_mode(layer):
        assert not layer.training
    assert layer.training
    layer.eval()
    with eval_mode(layer):
        pass
    assert not layer.training
    layer.train()
    with pytest.raises(RuntimeError, match="boom"), eval_mode(layer):
        raise RuntimeError("boom")
    assert layer.training


def test_tiny_moe_loads_is_moe_and_is_cached(monkeypatch):
    """``"tiny-moe"``: a cached tiny Mixtral (4 MoE layers × 8 experts); the second load reuses the cache."""
    import lightning_llm.backbones.tiny_moe as tiny_moe
    from lightning_llm.backbones.moe import moe_blocks

    model, tokenizer = load_backbone("tiny-moe")
    assert model.config.model_type == "mixtral"
    blocks = moe_blocks(model)
    assert sorted(blocks) == [0, 1, 2, 3]
    assert model.config.num_local_experts == 8 and model.config.num_experts_per_tok == 2
    assert tokenizer.eos_token == "<|im_end|>" and model.config.vocab_size >= len(tokenizer)
    assert load_tokenizer("tiny-moe").get_vocab() == tokenizer.get_vocab()

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached tiny-moe was rebuilt")

    monkeypatch.setattr(tiny_moe, "build_tiny_moe", no_rebuild)
    again, _ = load_backbone("tiny-moe")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
