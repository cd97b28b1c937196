"""Chat templates without a system role: the system text is folded into the first user turn, never lost."""

from __future__ import annotations

import copy

import pytest

from lightning_llm.backbones import apply_chat_template, fold_system_messages, keeps_system_messages
from lightning_llm.backbones.gemma3 import CHAT_TEMPLATE as GEMMA3_TEMPLATE
from lightning_llm.datamodules.sources import render_prompt

#: A Gemma-2-style template: refuses a system message outright.
REFUSING = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ raise_exception('System role not supported') }}{%- endif -%}"
    "{{ '<start_of_turn>' + message['role'] + '\\n' + message['content'] + '<end_of_turn>\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
#: A template that renders only user and assistant turns: a system message would vanish without a trace.
DROPPING = (
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{{ '[' + message['role'] + '] ' + message['content'] + '\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '[assistant] ' }}{%- endif -%}"
)
SYSTEM = "Answer with <answer>N</answer>."
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "<answer>5</answer>"},
    {"role": "user", "content": "What is 4+1?"},
]


def _with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def test_fold_prefixes_every_system_text_to_the_first_user_message():
    folded = fold_system_messages([{"role": "system", "content": "A"}, *CONVERSATION])
    assert [m["role"] for m in folded] == ["user", "assistant", "user"]
    assert folded[0]["content"] == f"A\n\n{SYSTEM}\n\nWhat is 2+3?"
    assert folded[2]["content"] == "What is 4+1?"  # later user turns untouched
    assert CONVERSATION[1]["content"] == "What is 2+3?"  # the input is not mutated
    assert fold_system_messages(CONVERSATION[1:]) == CONVERSATION[1:]
    with pytest.raises(ValueError, match="needs a user message"):
        fold_system_messages([{"role": "system", "content": "A"}])


def test_a_template_with_a_system_role_renders_unchanged(tiny_tokenizer):
    assert keeps_system_messages(tiny_tokenizer)
    ours = apply_chat_template(tiny_tokenizer, CONVERSATION, add_generation_prompt=True)
    assert ours == tiny_tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=False
    )
    assert ours.index(SYSTEM) < ours.index("What is 2+3?")


@pytest.mark.parametrize("template", [REFUSING, DROPPING], ids=["refuses-system", "drops-system"])
def test_templates_without_a_system_role_get_it_folded(tiny_tokenizer, template):
    tok = _with_template(tiny_tokenizer, template)
    assert not keeps_system_messages(tok)
    ours = apply_chat_template(tok, CONVERSATION, add_generation_prompt=True)
    folded = tok.apply_chat_template(
        fold_system_messages(CONVERSATION), add_generation_prompt=True, tokenize=False
    )
    assert ours == folded
    assert ours.count(SYSTEM) == 1 and ours.index(SYSTEM) < ours.index("What is 2+3?") < ours.index("4+1")
    # The data path renders prompts through the same function: the task's instructions reach the model.
    assert SYSTEM in render_prompt(tok, "What is 4+1?", SYSTEM)


def test_gemma3_template_writes_the_system_text_into_the_first_user_turn(tiny_tokenizer):
    tok = _with_template(tiny_tokenizer, GEMMA3_TEMPLATE)
    assert keeps_system_messages(tok)  # Gemma's own template folds; nothing is done twice
    text = apply_chat_template(tok, CONVERSATION, add_generation_prompt=True)
    bos = tok.bos_token or ""  # the tiny tokenizer has none; Gemma's is <bos>
    assert text == (
        f"{bos}<start_of_turn>user\n{SYSTEM}\n\nWhat is 2+3?<end_of_turn>\n"
        "<start_of_turn>model\n<answer>5</answer><end_of_turn>\n"
        "<start_of_turn>user\nWhat is 4+1?<end_of_turn>\n<start_of_turn>model\n"
    )
    plain = apply_chat_template(tok, CONVERSATION[1:2])
    assert plain == f"{bos}<start_of_turn>user\nWhat is 2+3?<end_of_turn>\n"


def test_a_tokenizer_without_a_template_is_refused_with_its_fix(tiny_tokenizer):
    tok = _with_template(tiny_tokenizer, None)
    with pytest.raises(ValueError, match="has no chat template"):
        apply_chat_template(tok, CONVERSATION)
