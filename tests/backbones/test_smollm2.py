"""SmolLM2-135M-Instruct (``"smollm2-135m"``): the converted checkpoint is the GGUF model, and it is a chat model."""

import pytest
import torch

from lightning_llm.backbones import load_backbone, load_tokenizer

pytestmark = pytest.mark.pretrained


def test_converted_directory_gives_the_gguf_models_logits(smollm2_dir, smollm2, tmp_path):
    """The safetensors directory reproduces transformers' own GGUF load (max |Δlogit| <= 1e-5; measured 0.0)."""
    from transformers import AutoModelForCausalLM

    from lightning_llm.backbones.smollm2 import gguf_file

    gguf = gguf_file(tmp_path)
    direct = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.float32).eval()
    model, tokenizer = smollm2
    ids = tokenizer(["The capital of France is", "def fibonacci(n):"], return_tensors="pt", padding=True)
    with torch.no_grad():
        ours = model(**ids).logits
        theirs = direct(**ids).logits
    assert ours.shape == theirs.shape == (2, ids["input_ids"].shape[1], 49152)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("What is the capital of France?", "paris"),
        ("What colour is the sky on a clear day? Answer in one word.", "blue"),
        ("What is 2 + 2? Answer with the number only.", "4"),
    ],
)
def test_known_answers_greedy(smollm2, question, expected):
    model, tokenizer = smollm2
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert expected in answer.lower(), answer


def test_chat_template_round_trips(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n"
        "<|im_start|>assistant\nHello. How can I help?<|im_end|>\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"] == ids
    prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    assert text.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id is not None


def test_alias_loads_the_converted_directory(smollm2_dir):
    model, tokenizer = load_backbone("smollm2-135m", dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 2
