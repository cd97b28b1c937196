"""Span targets come from the Viterbi parse; probes read labels that are linearly present and not ones that are
absent; both PCFG callbacks run inside a Trainer, log, and keep their state in checkpoints."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_llm.callbacks.pcfg import (
    GrammarKLMonitor,
    LayerwiseProbe,
    hidden_states,
    probe_accuracy,
    span_targets,
)
from lightning_llm.datamodules.pcfg import PCFGDataModule
from lightning_llm.modules import CausalLMModule
from lightning_llm.text.pcfg import PCFG

_GRAMMAR = {"num_nonterminals": 5, "num_terminals": 6, "levels": 3, "binary_mass": 0.8, "seed": 0}


def test_span_targets_follow_the_viterbi_parse():
    grammar = PCFG.random(**_GRAMMAR)
    sentences = grammar.sample(10, max_length=8, seed=0)
    targets = span_targets(grammar, sentences, max_span=4)
    for sentence, spans, (_, nodes) in zip(sentences, targets, grammar.viterbi(sentences), strict=True):
        parse = {(c.start, c.end): c.label for c in nodes}
        expected = sum(max(0, len(sentence) - k + 1) for k in range(2, 5))
        assert len(spans) == expected
        for start, end, label in spans:
            assert 2 <= end - start <= 4
            assert label == parse.get((start, end), grammar.num_nonterminals)


def test_probe_reads_a_linearly_encoded_label_and_not_noise():
    gen = torch.Generator().manual_seed(0)
    classes, dim, layers = 3, 16, 2
    codes = torch.randn(classes, dim, generator=gen)
    states, targets = [], []
    for _ in range(60):
        spans = [(i, i + 2, int(torch.randint(classes, (), generator=gen))) for i in range(5)]
        h = torch.randn(layers, 8, dim, generator=gen)
        # Layer 1 writes each span's label code at its last word; layer 0 holds only noise.
        for _, end, label in spans:
            h[1, end] = codes[label] + 0.1 * torch.randn(dim, generator=gen)
        states.append(h)
        targets.append(spans)
    accuracy = probe_accuracy(states, targets, num_classes=classes, max_span=2)
    assert accuracy.shape == (layers, 3)
    assert torch.isnan(accuracy[:, :2]).all()
    assert accuracy[1, 2] == 1.0
    assert abs(accuracy[0, 2] - 1 / classes) < 0.2


def test_hidden_states_line_up_with_the_input(tiny_backbone):
    model, _ = tiny_backbone
    sentences = [[0, 1, 2], [3]]
    states = hidden_states(model, sentences, token_ids=[67, 68, 69, 70], bos_id=2, pad_id=0)
    assert [tuple(s.shape) for s in states] == [(5, 4, 128), (5, 2, 128)]
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([[2, 70]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(states[1], torch.stack(alone, 1)[0], rtol=1e-4, atol=1e-4)


def test_callbacks_run_in_a_trainer_and_resume(quiet_trainer, tiny_backbone, tmp_path):
    dm = PCFGDataModule(random_grammar=_GRAMMAR, num_train=64, num_val=24, max_length=8, batch_size=16)
    monitor, probe = GrammarKLMonitor(num_sentences=8), LayerwiseProbe(num_sentences=24, max_span=3)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = quiet_trainer(
        max_steps=4,
        callbacks=[monitor, probe, checkpoint],
        limit_val_batches=1,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        enable_checkpointing=True,
    )
    trainer.fit(CausalLMModule(lr=1e-3), dm)
    logged = trainer.callback_metrics
    expected = {"val/grammar_kl", "val/grammar_kl_bigram", "val/grammar_kl_trigram", "probe/layer0"}
    assert expected | {"probe/layer4_span3"} <= set(logged)
    assert [step for step, _ in monitor.history] == [2, 4]
    assert logged["val/grammar_kl"] > 0
    assert probe.accuracy.shape == (5, 4)
    # The callbacks' state travels in a checkpoint that loads with weights_only=True (no pickled objects).
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"]
    restored_monitor, restored_probe = GrammarKLMonitor(), LayerwiseProbe()
    restored_monitor.load_state_dict(state[monitor.state_key])
    restored_probe.load_state_dict(state[probe.state_key])
    assert restored_monitor.history == monitor.history
    torch.testing.assert_close(restored_probe.accuracy, probe.accuracy, equal_nan=True)


def test_callbacks_need_a_pcfg_datamodule(quiet_trainer):
    from lightning_llm.datamodules import ChatSFTDataModule

    trainer = quiet_trainer(max_steps=1, callbacks=[GrammarKLMonitor()], limit_val_batches=1)
    with pytest.raises(TypeError, match="GrammarKLMonitor needs a PCFGDataModule"):
        trainer.validate(CausalLMModule(), ChatSFTDataModule(num_train=4, num_val=4, batch_size=2))
