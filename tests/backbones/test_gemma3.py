"""Gemma 3 270M (``"gemma3-270m"``): the converted checkpoint is the GGUF model, with Gemma's turn format and stops."""

import pytest
import torch

from lightning_llm.backbones import end_of_turn_token_id, stop_token_ids
from lightning_llm.datamodules.sources import render_prompt

pytestmark = pytest.mark.pretrained


def test_converted_weights_are_the_gguf_tensors_dequantised(gemma3_dir, tmp_path):
    """Weights of three quantisation types and layer kinds equal the GGUF's own dequantisation exactly.

    (The whole model's logits equal transformers' direct GGUF load, max |Δlogit| 0.0, measured once: that load
    takes ~100 s, too long for this tier.)"""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    from lightning_llm.backbones.gemma3 import gguf_file

    tensors = {t.name: t for t in GGUFReader(gguf_file(tmp_path)).tensors}
    pairs = {
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
        "blk.5.attn_k.weight": "model.layers.5.self_attn.k_proj.weight",  # a global-attention layer
        "blk.17.ffn_down.weight": "model.layers.17.mlp.down_proj.weight",
    }
    with safe_open(f"{gemma3_dir}/model.safetensors", "pt") as converted:
        for ours, theirs in pairs.items():
            weight = converted.get_tensor(theirs)
            reference = torch.from_numpy(dequantize(tensors[ours].data, tensors[ours].tensor_type).copy())
            assert torch.equal(reference.reshape(weight.shape), weight), ours
    assert {t.tensor_type.name for n, t in tensors.items() if n in pairs} == {"Q5_0", "Q6_K"}


def test_it_is_the_hybrid_architecture_it_claims(gemma3, gemma3_dir):
    model, _ = gemma3
    config = model.config
    assert config.model_type == "gemma3_text" and config.tie_word_embeddings
    assert (config.num_hidden_layers, config.num_key_value_heads, config.sliding_window) == (18, 1, 512)
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert 260e6 < sum(p.numel() for p in model.parameters()) < 275e6
    assert "Gemma Terms of Use" in (open(f"{gemma3_dir}/GEMMA_TERMS.html", encoding="utf-8").read())


def test_turn_format_stops_and_the_system_text(gemma3):
    model, tokenizer = gemma3
    end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn_token_id(tokenizer) == end
    assert stop_token_ids(tokenizer, model) == [tokenizer.eos_token_id, end]
    text = render_prompt(tokenizer, "What is 2+3?", "Reply with a number.")
    assert (
        text
        == "<bos><start_of_turn>user\nReply with a number.\n\nWhat is 2+3?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_it_is_a_language_model(gemma3):
    """The base model predicts text: " Paris" in its top 5 after "The capital of France is" (measured: 3rd), and an
    English sentence costs far fewer nats per token than its tokens shuffled (measured 2.66 vs 8.86)."""
    model, tokenizer = gemma3
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logprobs = model(**ids).logits[0, -1].log_softmax(-1)
    paris = tokenizer.encode(" Paris", add_special_tokens=False)[0]
    assert (logprobs > logprobs[paris]).sum().item() < 5
    sentence = "The quick brown fox jumps over the lazy dog, and then it runs back into the forest to sleep."
    ids = tokenizer(sentence, return_tensors="pt").input_ids
    order = torch.randperm(ids.shape[1] - 1, generator=torch.Generator().manual_seed(0)) + 1
    shuffled = torch.cat([ids[:, :1], ids[:, order]], dim=1)
    with torch.no_grad():
        natural, scrambled = (model(input_ids=x, labels=x).loss.item() for x in (ids, shuffled))
    assert natural < scrambled - 3.0, (natural, scrambled)
