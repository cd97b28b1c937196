"""PromptDataModule: left-padded generation prompts that carry their examples."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_llm.datamodules import Example, PromptDataModule


def test_prompts_are_left_padded_generation_prompts(tmp_path):
    rows = [{"prompt": "What is" + " really" * i + " 2 + 2?", "answer": "4"} for i in range(5)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dm = PromptDataModule(task=None, source=str(path), num_val=0, batch_size=5, system_prompt="Be brief.")
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "prompt", "example"}
    assert batch["input_ids"].dtype == batch["attention_mask"].dtype == torch.long
    tokenizer = dm.tokenizer
    lengths = batch["attention_mask"].sum(1).tolist()
    assert len(set(lengths)) == 5 and batch["input_ids"].shape == (5, max(lengths))
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for row, (length, text, example) in enumerate(
        zip(lengths, batch["prompt"], batch["example"], strict=True)
    ):
        pad = max(lengths) - length
        assert batch["attention_mask"][row].tolist() == [0] * pad + [1] * length
        assert (batch["input_ids"][row, :pad] == tokenizer.pad_token_id).all()
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": example.prompt}]
        assert text == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert tokenizer.decode(batch["input_ids"][row, pad:]) == text
        assert batch["input_ids"][row, -len(header) :].tolist() == header  # every row ends at the header
        assert example.answer == "4" and example.completion == ""


def test_examples_carry_answers_and_validation_yields_the_same_objects():
    dm = PromptDataModule(
        task="arithmetic", task_kwargs={"operands": 3}, num_train=12, num_val=6, batch_size=4
    )
    dm.setup("fit")
    first = [example for batch in dm.val_dataloader() for example in batch["example"]]
    second = [example for batch in dm.val_dataloader() for example in batch["example"]]
    assert len(first) == 6 and all(a is b for a, b in zip(first, second, strict=True))
    assert all(dm.task.score(example.completion, example) == 1.0 for example in first)
    train = next(iter(dm.train_dataloader()))
    assert all(
        isinstance(example, Example) and example.metadata["task"] == "arithmetic"
        for example in train["example"]
    )
    # Lightning moves batches to the device; examples and text must come through untouched
    moved = move_data_to_device(train, torch.device("cpu"))
    assert (
        all(a is b for a, b in zip(moved["example"], train["example"], strict=True))
        and moved["prompt"] == train["prompt"]
    )


def test_too_long_prompts_are_dropped_with_a_warning(tmp_path):
    rows = [{"prompt": "word " * 50}, {"prompt": "short"}]
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(rows))
    dm = PromptDataModule(task=None, source=str(path), num_val=0, max_length=16)
    with pytest.warns(UserWarning, match="dropped 1 of 2 prompts longer than max_length=16"):
        dm.setup("fit")
    assert [item["example"].prompt for item in dm._train_data] == ["short"]


def test_loader_before_setup_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"call setup\(\)"):
        PromptDataModule().train_dataloader()


def test_task_property_exposes_the_verifier():
    dm = PromptDataModule(task="copy", task_kwargs={"length": 3})
    assert dm.task.name == "copy" and dm.task.length == 3


def test_system_prompt_task_states_the_format_with_a_training_example():
    from lightning_llm.datamodules import PromptDataModule

    data = PromptDataModule(
        task="arithmetic",
        task_kwargs={"digits": 2, "ops": "+"},
        system_prompt="task",
        num_train=16,
        num_val=8,
    )
    data.setup("fit")
    system, user, assistant = data.system_prompt
    assert system["role"] == "system" and "<answer></answer>" in system["content"]
    held_out = {ex.prompt for ex in data.val_examples}
    assert user["role"] == "user" and user["content"] not in held_out
    assert assistant["content"].endswith("</answer>")
    item = data.train_items[-1]
    # every prompt carries the exchange before its own question, rendered by the chat template
    assert item["prompt"].count(user["content"]) >= 1 and item["prompt"].count("<|im_start|>user") == 2


def test_system_prompt_task_needs_a_task():
    from lightning_llm.datamodules import PromptDataModule

    with pytest.raises(ValueError, match="system_prompt='task'"):
        PromptDataModule(task=None, source="data.jsonl", system_prompt="task")


def test_a_task_can_withhold_the_worked_example():
    from dataclasses import dataclass

    from lightning_llm.datamodules.tasks import NeedleTask

    @dataclass(frozen=True)
    class Bare(NeedleTask):
        show_example = False

    example = NeedleTask().generate(1, seed=0)[0]
    assert [m["role"] for m in NeedleTask().prompt_prefix(example)] == ["system", "user", "assistant"]
    assert [m["role"] for m in Bare().prompt_prefix(example)] == ["system"]
