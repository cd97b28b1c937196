"""The shipped templated chat corpus: reproducible from its generator, multi-turn, well-formed."""

from __future__ import annotations

import pytest

from lightning_llm.datamodules.chat_corpus import load_chat_corpus, make_chat_corpus, write_chat_corpus


def test_shipped_corpus_is_the_generator_output(tmp_path):
    shipped = load_chat_corpus()
    assert shipped == make_chat_corpus()
    assert write_chat_corpus(tmp_path / "c.jsonl").read_text(encoding="utf-8").count("\n") == len(shipped)
    assert make_chat_corpus(20, seed=1) != make_chat_corpus(20, seed=0)


def test_conversations_are_multi_turn_alternating_and_end_with_the_assistant():
    corpus = load_chat_corpus()
    assert len(corpus) == 300 and len({item["topic"] for item in corpus}) == 8
    turns = []
    for item in corpus:
        messages = item["messages"]
        if messages[0]["role"] == "system":
            messages = messages[1:]
        roles = [m["role"] for m in messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2), item
        assert all(m["content"].strip() for m in messages)
        turns.append(len(roles) // 2)
    assert min(turns) >= 2 and max(turns) <= 4
    assert sum(t >= 3 for t in turns) > len(corpus) // 4  # plenty of longer conversations
    assert sum(item["messages"][0]["role"] == "system" for item in corpus) > 30


def test_invalid_size_fails():
    with pytest.raises(ValueError, match="num_conversations"):
        make_chat_corpus(0)
