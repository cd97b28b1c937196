"""PhrasingAccuracy: held-out items in held-out wordings, strict and lenient, with and without the worked exchange."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_llm.callbacks import PhrasingAccuracy
from lightning_llm.callbacks import task_accuracy as module_under_test
from lightning_llm.datamodules import PromptDataModule
from lightning_llm.modules import GRPOModule


def _data(**task_kwargs):
    kwargs = {"digits": 1, "ops": "+", "phrasings": [0, 1, 2]} | task_kwargs
    return PromptDataModule(task="arithmetic", task_kwargs=kwargs, system_prompt="task", batch_size=2,
                            num_train=8, num_val=4, seed=0)  # fmt: skip


def _validate(callback, data):
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback]
    )
    trainer.validate(GRPOModule(group_size=2, max_new_tokens=4), data)
    return trainer.callback_metrics


def test_scores_strict_and_lenient_under_both_system_prompts(tiny_backbone, monkeypatch):
    """Replies are scripted (the tiny model answers nothing): the callback asks each held-out item in each
    held-out wording, under the DataModule's prompt (with its worked exchange) and under the format alone,
    and scores the tagged answer strictly and the last integer leniently."""
    seen = []

    def scripted(model, tokenizer, examples, *, sampling, system_prompt, batch_size):
        with_exchange = len(system_prompt) == 3  # system + worked user/assistant exchange
        seen.append((with_exchange, [ex.metadata["phrasing"] for ex in examples]))
        if with_exchange:  # tagged and right on every item
            return [[f"<answer>{ex.answer}</answer>"] for ex in examples]
        return [[f"I think it is {ex.answer}" if i % 2 else "no idea"] for i, ex in enumerate(examples)]

    monkeypatch.setattr(module_under_test, "sample_completions", scripted)
    metrics = _validate(PhrasingAccuracy(phrasings=[6, 7], num_examples=4), _data())
    assert sorted(seen) == [(False, [6] * 4 + [7] * 4), (True, [6] * 4 + [7] * 4)]
    assert float(metrics["val/phrasing/strict/exchange"]) == 1.0
    assert float(metrics["val/phrasing/lenient/exchange"]) == 1.0
    assert float(metrics["val/phrasing/strict/plain"]) == 0.0
    assert float(metrics["val/phrasing/lenient/plain"]) == 0.5


def test_runs_on_the_real_generation_path(tiny_backbone):
    metrics = _validate(
        PhrasingAccuracy(phrasings=[6, 7], num_examples=2, max_new_tokens=4, per_phrasing=True), _data()
    )
    for key in (
        "val/phrasing/strict/exchange",
        "val/phrasing/6/lenient/plain",
        "val/phrasing/7/strict/exchange",
    ):
        assert 0.0 <= float(metrics[key]) <= 1.0


@pytest.mark.parametrize(
    ("phrasings", "message"),
    [([1, 6], "also the task's training wordings"), ([8], "has phrasings 0..7")],
)
def test_refuses_trained_or_unknown_wordings(tiny_backbone, phrasings, message):
    with pytest.raises(ValueError, match=message):
        _validate(PhrasingAccuracy(phrasings=phrasings), _data())


def test_refuses_bad_arguments():
    with pytest.raises(ValueError, match="distinct"):
        PhrasingAccuracy(phrasings=[])
    with pytest.raises(ValueError, match=">= 1"):
        PhrasingAccuracy(phrasings=[6], num_examples=0)
