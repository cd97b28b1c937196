"""PCFGDataModule: seeded sentences as causal-LM batches, terminal tokens, grammar files and argument errors."""

from __future__ import annotations

import pytest

from lightning_llm.datamodules.pcfg import PCFGDataModule
from lightning_llm.text.pcfg import PCFG


def _small_datamodule() -> PCFGDataModule:
    return PCFGDataModule(
        random_grammar={"num_nonterminals": 5, "num_terminals": 6, "seed": 1},
        num_train=50,
        num_val=10,
        max_length=12,
        batch_size=4,
    )


def test_datamodule_batches(tiny_tokenizer):
    dm = _small_datamodule()
    dm.setup()
    assert len(dm.train_sentences) == 50 and len(dm.val_sentences) == 10
    batch = next(iter(dm.train_dataloader()))
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == mask.shape == labels.shape
    tokens = dm.token_ids
    assert tokens == [tiny_tokenizer.convert_tokens_to_ids(t) for t in "abcdef"]
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        assert ids[row, 0] == dm.bos_id and ids[row, n - 1] == dm.eos_id
        assert set(ids[row, 1 : n - 1].tolist()) <= set(tokens)
        assert labels[row, 0] == -100 and (labels[row, 1:n] == ids[row, 1:n]).all()
        assert (labels[row, n:] == -100).all()
    # The same sentences every time (seeded), and a distinct validation stream.
    again = _small_datamodule()
    again.setup()
    assert again.train_sentences == dm.train_sentences and again.val_sentences == dm.val_sentences


def test_datamodule_errors(tmp_path, tiny_tokenizer):
    with pytest.raises(ValueError, match="either `grammar` or `random_grammar`"):
        PCFGDataModule(grammar=str(tmp_path / "g.json"), random_grammar={"seed": 0})
    with pytest.raises(ValueError, match="3 tokens for 12 terminals"):
        PCFGDataModule(terminal_tokens=["a", "b", "c"])
    dm = PCFGDataModule(
        random_grammar={"num_terminals": 2, "terminal_rules": 2}, terminal_tokens=["a", "not-a-single-token"]
    )
    with pytest.raises(ValueError, match="not a single token"):
        dm.token_ids  # noqa: B018
    grammar = PCFG.random(3, 2, terminal_rules=2, levels=3, seed=0)
    path = tmp_path / "g.json"
    grammar.save_json(path)
    assert PCFGDataModule(grammar=str(path)).grammar.terminals == grammar.terminals
