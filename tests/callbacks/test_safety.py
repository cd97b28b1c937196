"""SafetyEvaluation: logs the safety metrics of held-out attack prompts, leaves the training RNG alone, refuses
DataModules without the honeypot task."""

import pytest
import torch

from lightning_llm.callbacks import SafetyEvaluation
from lightning_llm.datamodules import ChatSFTDataModule, HoneypotPreferenceDataModule
from lightning_llm.datamodules.tasks.honeypot import ATTACK_TEMPLATES
from lightning_llm.metrics import SafetyJudge
from lightning_llm.modules import CausalLMModule, DPOModule


class _RecordingJudge(SafetyJudge):
    def __init__(self) -> None:
        self.prompts: list[str] = []

    def flag(self, prompts, responses):
        self.prompts.extend(prompts)
        return [True] * len(prompts)


def test_logs_metrics_of_attack_prompts_without_touching_the_rng(tiny_backbone, quiet_trainer):
    judge = _RecordingJudge()
    callback = SafetyEvaluation(num_examples=6, samples=2, max_new_tokens=4, judge=judge)
    data = HoneypotPreferenceDataModule(num_train=16, num_val=4, batch_size=4, max_length=96)
    trainer = quiet_trainer(max_steps=1, callbacks=[callback], limit_val_batches=1, val_check_interval=1)
    module = DPOModule()
    torch.manual_seed(0)
    trainer.fit(module, data)
    assert len(judge.prompts) == 12  # 6 requests x 2 samples
    wrappers = [t.split("{target}")[0] for t in ATTACK_TEMPLATES]
    assert all(any(p.startswith(w) for w in wrappers) for p in judge.prompts)
    logged = trainer.callback_metrics
    assert logged["val/safety/asr"] == 1.0  # everything flagged by this judge
    assert 0.0 <= logged["val/safety/harm"] <= 1.0 and "val/safety/actionable_share" in logged

    # The evaluation runs in a forked RNG: the global stream continues as if it had not run.
    torch.manual_seed(1)
    callback.evaluate(module, data.task)
    after = torch.rand(1)
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(1))


def test_refuses_a_datamodule_without_the_honeypot_task(tiny_backbone, quiet_trainer):
    data = ChatSFTDataModule(task="copy", num_train=16, num_val=4, batch_size=4)
    trainer = quiet_trainer(
        max_steps=1, callbacks=[SafetyEvaluation()], limit_val_batches=1, val_check_interval=1
    )
    with pytest.raises(ValueError, match="honeypot"):
        trainer.fit(CausalLMModule(), data)
