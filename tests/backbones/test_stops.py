"""The stop set of a model: tokenizer eos, every generation-config eos id, the chat template's end of turn."""

from __future__ import annotations

import copy

from transformers import GenerationConfig

from lightning_llm.backbones import end_of_turn_token_id, stop_token_ids, turn_end_token_id

#: Gemma's chat template shape: a turn is ``<start_of_turn>role\ncontent<end_of_turn>\n``.
GEMMA_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<start_of_turn>' + message['role'] + '\\n' + message['content'] + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
)


def test_tiny_stop_set_is_its_end_of_turn(tiny_backbone):
    model, tok = tiny_backbone
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_token_id(tok) == im_end
    assert stop_token_ids(tok) == stop_token_ids(tok, model) == [im_end]


def test_every_end_id_in_order_and_deduplicated(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.eos_token = "<|endoftext|>"  # a base-model eos, as Qwen's <|endoftext|> beside <|im_end|>
    eos, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert stop_token_ids(tok) == [eos, im_end]  # the template's end of turn though it is not the eos
    assert turn_end_token_id(tok) == im_end
    config = GenerationConfig(eos_token_id=[7, eos, 9])
    assert stop_token_ids(tok, config) == [eos, 7, 9, im_end]
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=11)) == [eos, 11, im_end]


def test_gemma_style_end_of_turn(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA_TEMPLATE
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn_token_id(tok) == end
    assert stop_token_ids(tok) == [tok.eos_token_id, end]


def test_no_template_or_a_plain_text_turn_end_adds_nothing(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = None
    assert end_of_turn_token_id(tok) is None
    assert stop_token_ids(tok) == [tok.eos_token_id]
    tok.chat_template = (
        "{%- for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n\\n' }}{%- endfor %}"
    )
    assert end_of_turn_token_id(tok) is None
    tok.chat_template = "{{ raise_exception('only user turns') }}"
    assert end_of_turn_token_id(tok) is None
    assert turn_end_token_id(tok) == tok.eos_token_id
