"""LARFT's hindsight task: the λ schedule, the masked word-count samples, the CE term, and a run under GRPO."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_llm.callbacks import HindsightLengthAwareness
from lightning_llm.callbacks.larft import (
    build_hindsight_batch,
    count_label,
    greedy_completions,
    hindsight_lambda,
    hindsight_loss,
    parse_word_count,
    self_count_accuracy,
    self_count_predictions,
    self_count_ranked_accuracy,
)
from lightning_llm.datamodules import PromptDataModule
from lightning_llm.datamodules.sources import render_prompt
from lightning_llm.modules.grpo import GRPOModule
from lightning_llm.rewards import word_count

RESPONSES = ["the sea is blue", "<think>count them: one two three</think> one two", "", "word"]
COUNTS = [4, 2, 0, 1]


# ------------------------------------------------------------------------------------------ λ schedule


def test_lambda_schedule_values():
    assert hindsight_lambda(0, 100, 0.01, 0.1) == 0.0
    assert hindsight_lambda(5, 100, 0.01, 0.1) == pytest.approx(0.005)
    assert hindsight_lambda(10, 100, 0.01, 0.1) == pytest.approx(0.01)
    assert hindsight_lambda(55, 100, 0.01, 0.1) == pytest.approx(0.005)  # cosine half-way: λ_max / 2
    assert hindsight_lambda(100, 100, 0.01, 0.1) == pytest.approx(0.0, abs=1e-15)
    assert hindsight_lambda(150, 100, 0.01, 0.1) == pytest.approx(0.0, abs=1e-15)  # past the end: stays 0
    assert hindsight_lambda(0, 100, 0.01, 0.0) == 0.01  # no warm-up: cosine from the peak
    assert hindsight_lambda(100, 100, 0.01, 1.0) == 0.01  # all warm-up: linear to the peak


def test_lambda_schedule_is_monotone_in_each_piece():
    values = [hindsight_lambda(t, 200, 0.02, 0.1) for t in range(201)]
    warm, decay = values[:21], values[20:]
    assert all(a < b for a, b in itertools.pairwise(warm))
    assert all(a >= b for a, b in itertools.pairwise(decay))
    assert max(values) == pytest.approx(0.02)
    t = 20 + 90  # a point of the cosine piece, by hand
    assert values[t] == pytest.approx(0.01 * (1 + math.cos(math.pi * 90 / 180)))


@pytest.mark.parametrize(
    ("step", "total", "lambda_max", "warmup"), [(-1, 10, 0.01, 0.1), (0, 0, 0.01, 0.1), (0, 10, -1, 0.1)]
)
def test_lambda_schedule_rejects_bad_arguments(step, total, lambda_max, warmup):
    with pytest.raises(ValueError):
        hindsight_lambda(step, total, lambda_max, warmup)


def test_callback_rejects_bad_arguments():
    with pytest.raises(ValueError, match="lambda_max"):
        HindsightLengthAwareness(lambda_max=-0.1)
    with pytest.raises(ValueError, match="warmup"):
        HindsightLengthAwareness(warmup=1.5)
    with pytest.raises(ValueError, match="response"):
        HindsightLengthAwareness(prompt="Count the words.")
    with pytest.raises(ValueError, match="total_steps"):
        HindsightLengthAwareness(total_steps=0)
    with pytest.raises(ValueError, match="rows"):
        HindsightLengthAwareness(rows="some")


def test_total_updates_follows_the_trainer():
    cb = HindsightLengthAwareness()
    module = SimpleNamespace(hparams=SimpleNamespace(ppo_epochs=2, mini_batches=3))
    assert cb.total_updates(SimpleNamespace(max_steps=40), module) == 40
    assert cb.total_updates(SimpleNamespace(max_steps=-1, estimated_stepping_batches=5), module) == 30
    assert HindsightLengthAwareness(total_steps=7).total_updates(SimpleNamespace(max_steps=40), module) == 7


# --------------------------------------------------------------------------------------- labels, parse


def test_count_label_and_parse_round_trip():
    assert [count_label(r) for r in RESPONSES] == [f"<word_count>{n}</word_count>" for n in COUNTS]
    assert parse_word_count("blah <word_count> 12 </word_count> <word_count>3</word_count>") == 12
    assert parse_word_count("<word_count>twelve</word_count>") is None
    assert parse_word_count("") is None


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parse_never_raises_and_inverts_the_label(text):
    parse_word_count(text)
    assert parse_word_count(count_label(text)) == word_count(text)


def test_hindsight_labels_are_masked(tiny_tokenizer):
    tok = tiny_tokenizer
    batch = build_hindsight_batch(tok, RESPONSES)
    assert batch.counts.tolist() == COUNTS
    prompt_width = batch.input_ids.shape[1] - int(batch.label_mask.sum(1).max())
    for i, (response, n) in enumerate(zip(RESPONSES, COUNTS, strict=True)):
        ids, att, mask = batch.input_ids[i], batch.attention_mask[i].bool(), batch.label_mask[i]
        # only label tokens + eos are trainable, all attended, all after the prompt, starting in one column
        assert mask.sum() > 0 and bool(att[mask].all())
        assert int(mask.nonzero()[0]) == prompt_width
        assert tok.decode(ids[mask]) == f"<word_count>{n}</word_count>{tok.eos_token}"
        assert int(ids[mask][-1]) == tok.eos_token_id
        # the attended, untrained part is exactly the chat-rendered count prompt with the whole response
        prompt = render_prompt(
            tok, f"Count the words of this text. Answer as <word_count>N</word_count>.\n\n{response}"
        )
        assert tok.decode(ids[att & ~mask]) == prompt
        assert not bool(mask[~att].any())


def test_hindsight_batch_rejects_bad_input(tiny_tokenizer):
    with pytest.raises(ValueError, match="response"):
        build_hindsight_batch(tiny_tokenizer, ["a"], prompt="no placeholder")
    with pytest.raises(ValueError, match="no responses"):
        build_hindsight_batch(tiny_tokenizer, [])


# ------------------------------------------------------------------------------------------- CE term


def _hand_ce(model, batch, rows):
    ids, att, mask = batch.input_ids[rows], batch.attention_mask[rows], batch.label_mask[rows]
    position_ids = (att.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=att, position_ids=position_ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return -logp[mask[:, 1:]].mean()


def test_ce_equals_hand_computation(tiny_backbone):
    model, tok = tiny_backbone
    batch = build_hindsight_batch(tok, RESPONSES)
    with torch.no_grad():
        for rows in (None, torch.tensor([2, 0])):
            loss, logged = hindsight_loss(model, batch, rows)
            expected = _hand_ce(model, batch, rows if rows is not None else torch.arange(len(RESPONSES)))
            assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
            assert logged.item() == pytest.approx(expected.item(), rel=1e-5)


def test_callback_returns_lambda_times_ce(tiny_backbone, make_step, make_recorder):
    model, tok = tiny_backbone
    cb = HindsightLengthAwareness(lambda_max=0.5, warmup=0.5, total_steps=10)
    module = make_recorder(logprob_chunk_size=None)
    module.model, module.tokenizer = model, tok
    rollout = SimpleNamespace(
        completions=RESPONSES, input_ids=torch.zeros(4, 3, dtype=torch.long), num_rows=4, metadata={}
    )
    trainer = SimpleNamespace(global_step=2, max_steps=-1, world_size=1)
    cb.on_rollout_end(trainer, module, rollout)
    step = make_step([1, 3], [0, 0])  # the update's rows: 1 and 3
    with torch.no_grad():
        term = cb.on_policy_loss(trainer, module, rollout, step)
        expected = 0.2 * _hand_ce(model, rollout.metadata["larft_hindsight"], torch.tensor([1, 3]))
    assert term.item() == pytest.approx(expected.item(), rel=1e-5)
    assert module.logged["train/LARFT/lambda"] == pytest.approx(0.2)
    assert module.logged["train/LARFT/ce"] == pytest.approx(expected.item() / 0.2, rel=1e-5)


def test_callback_rows_all_trains_every_hindsight_sample(tiny_backbone, make_step, make_recorder):
    model, tok = tiny_backbone
    cb = HindsightLengthAwareness(lambda_max=0.5, warmup=0.5, total_steps=10, rows="all")
    module = make_recorder(logprob_chunk_size=None)
    module.model, module.tokenizer = model, tok
    rollout = SimpleNamespace(
        completions=RESPONSES, input_ids=torch.zeros(4, 3, dtype=torch.long), num_rows=4, metadata={}
    )
    trainer = SimpleNamespace(global_step=2, max_steps=-1, world_size=1)
    cb.on_rollout_end(trainer, module, rollout)
    with torch.no_grad():
        term = cb.on_policy_loss(trainer, module, rollout, make_step([1, 3], [0, 0]))
        expected = 0.2 * _hand_ce(model, rollout.metadata["larft_hindsight"], torch.arange(4))
    assert term.item() == pytest.approx(expected.item(), rel=1e-5)


# ------------------------------------------------------------------------------ evaluation, in a run


def test_self_count_accuracy_scores_parsed_answers(tiny_backbone, monkeypatch):
    model, tok = tiny_backbone
    predictions = self_count_predictions(model, tok, RESPONSES[:2], max_new_tokens=4)
    assert len(predictions) == 2 and all(p is None or isinstance(p, int) for p in predictions)
    import lightning_llm.callbacks.larft as larft

    monkeypatch.setattr(larft, "self_count_predictions", lambda *a, **k: [4, None, 1, 1])
    assert self_count_accuracy(model, tok, RESPONSES) == 0.5  # right, unparsable, wrong, right
    with pytest.raises(ValueError):
        self_count_accuracy(model, tok, [])


def test_callback_under_grpo_module(quiet_trainer):
    L.seed_everything(0)
    cb = HindsightLengthAwareness(lambda_max=0.01, warmup=0.5)
    trainer = quiet_trainer(max_steps=2, callbacks=[cb])
    data = PromptDataModule(
        task="length", task_kwargs={"min_words": 2, "max_words": 6}, num_train=8, batch_size=2
    )
    module = GRPOModule(rewards=["length"], group_size=2, max_new_tokens=8, entropy_coef=0.01, beta=0.001)
    trainer.fit(module, data)
    metrics = trainer.callback_metrics
    assert trainer.global_step == 2
    # second update: t = 1 of T = 2 with w = 1, the peak
    assert float(metrics["train/LARFT/lambda"]) == pytest.approx(0.01)
    assert float(metrics["train/LARFT/ce"]) > 0
    assert float(metrics["train/LARFT/loss"]) > 0


def test_ranked_accuracy_and_candidate_labels(tiny_backbone):
    model, tok = tiny_backbone
    batch = build_hindsight_batch(tok, ["a b", "c"], counts=[7, 12])
    assert batch.counts.tolist() == [7, 12]
    assert (
        tok.decode(batch.input_ids[1][batch.label_mask[1]]) == f"<word_count>12</word_count>{tok.eos_token}"
    )
    with pytest.raises(ValueError, match="counts"):
        build_hindsight_batch(tok, ["a"], counts=[1, 2])
    # one candidate (0): right for the empty text only
    assert self_count_ranked_accuracy(model, tok, ["", "a"], max_count=0) == 0.5
    assert 0.0 <= self_count_ranked_accuracy(model, tok, RESPONSES, max_count=5, batch_size=7) <= 1.0
    assert (
        len(greedy_completions(model, tok, ["Write exactly 3 words about the sea."], max_new_tokens=3)) == 1
    )
