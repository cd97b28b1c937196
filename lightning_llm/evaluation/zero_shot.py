"""Zero-shot greedy accuracy of a backbone on a synthetic task, prompted with the task's own instructions.

The held-out examples are those a ``PromptDataModule`` with ``system_prompt="task"`` validates on (the worked
exchange of the prompt comes from the training split). Completions are greedy, one turn, scored by the task's
verifier. ``experiments/zero_shot.py`` runs it over every task and difficulty.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_llm.datamodules import PromptDataModule

__all__ = ["zero_shot_accuracy"]


@torch.no_grad()
def zero_shot_accuracy(
    model: Any,
    tokenizer: Any,
    task: str,
    task_kwargs: dict[str, Any],
    *,
    n: int,
    seed: int,
    max_new_tokens: int,
    batch_size: int = 16,
) -> float:
    """Fraction of ``n`` held-out examples (DataModule seed ``seed``) that greedy decoding answers correctly."""
    data = PromptDataModule(
        task=task,
        task_kwargs=task_kwargs,
        system_prompt="task",
        num_train=64,
        num_val=n,
        seed=seed,
        batch_size=batch_size,
        max_length=2048,
        shuffle=False,
    )
    data.use_tokenizer(tokenizer)
    data.setup("fit")
    correct = 0.0
    for batch in data.val_dataloader():
        out = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(data.task.score(text, ex) for text, ex in zip(texts, batch["example"], strict=True))
    return correct / len(data.val_examples)
