"""ChatSFTDataModule: label masking, padding, truncation, block packing, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_llm.backbones
from lightning_llm.datamodules import ChatSFTDataModule
from lightning_llm.types import IGNORE_INDEX

END = "<|im_end|>"


def _source(tmp_path: Path, rows: list[dict[str, str]]) -> str:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _items(dm: ChatSFTDataModule) -> list[dict[str, torch.Tensor]]:
    dm.setup("fit")
    return list(dm._train_data)


def _labelled(labels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return ids[labels != IGNORE_INDEX]


def test_only_the_response_and_its_end_token_are_trained():
    dm = ChatSFTDataModule(
        num_train=20, num_val=4, system_prompt="Be brief.", task_kwargs={"chain_of_thought": True}
    )
    dm.setup("fit")
    tokenizer = dm.tokenizer
    train, _ = dm._examples()
    for example, item in zip(train, dm._train_data, strict=True):
        ids, labels = item["input_ids"], item["labels"]
        trained = (labels != IGNORE_INDEX).nonzero().flatten()
        start = int(trained[0])
        assert torch.equal(labels[trained], ids[trained])
        assert trained.tolist() == list(range(start, int(trained[-1]) + 1))  # one contiguous span
        prompt = tokenizer.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": example.prompt}],
            add_generation_prompt=True,
            tokenize=False,
        )
        assert tokenizer.decode(ids[:start]) == prompt  # everything up to the assistant header is masked
        assert tokenizer.decode(_labelled(labels, ids)) == example.completion + END
        assert tokenizer.decode(ids[int(trained[-1]) + 1 :]) == "\n"  # ChatML's newline: kept, not trained


def test_batches_are_right_padded_with_masked_padding(tmp_path):
    rows = [{"prompt": "Hi" + " there" * i, "completion": "Hello" + "!" * (3 * i)} for i in range(6)]
    dm = ChatSFTDataModule(task=None, source=_source(tmp_path, rows), num_val=0, batch_size=6, shuffle=False)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(value.dtype == torch.long for value in batch.values())
    lengths = [len(item["input_ids"]) for item in dm._train_data]
    assert len(set(lengths)) > 1 and batch["input_ids"].shape == (6, max(lengths))
    for row, length in enumerate(lengths):
        assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (max(lengths) - length)
        assert (batch["input_ids"][row, length:] == dm.tokenizer.pad_token_id).all()
        assert (batch["labels"][row, length:] == IGNORE_INDEX).all()
        assert torch.equal(batch["input_ids"][row, :length], dm._train_data[row]["input_ids"])


def test_truncation_cuts_the_response_keeps_the_prompt_and_warns(tmp_path):
    rows = [{"prompt": "Q", "completion": "a long answer " * 20}, {"prompt": "R", "completion": "short"}]
    dm = ChatSFTDataModule(task=None, source=_source(tmp_path, rows), num_val=0, max_length=24, shuffle=False)
    with pytest.warns(
        UserWarning, match=r"1 of 2 conversations exceed max_length=24 .* 0 of them were dropped"
    ):
        items = _items(dm)
    long, short = sorted(items, key=lambda item: -len(item["input_ids"]))
    assert len(long["input_ids"]) == 24 and dm.tokenizer.decode(short["input_ids"]).endswith(
        "short" + END + "\n"
    )
    text = dm.tokenizer.decode(long["input_ids"])
    assert text.startswith("<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\na long answer")
    assert not text.endswith(END)
    assert (long["labels"][-1] != IGNORE_INDEX).item()


def test_conversations_whose_prompt_fills_max_length_are_dropped(tmp_path):
    rows = [{"prompt": "word " * 40, "completion": "x"}, {"prompt": "Q", "completion": "y"}]
    dm = ChatSFTDataModule(task=None, source=_source(tmp_path, rows), num_val=0, max_length=24)
    with pytest.warns(UserWarning, match="1 of them were dropped"):
        items = _items(dm)
    assert (
        len(items) == 1
        and dm.tokenizer.decode(_labelled(items[0]["labels"], items[0]["input_ids"])) == "y" + END
    )
    dm = ChatSFTDataModule(task=None, source=_source(tmp_path, rows[:1]), num_val=0, max_length=24)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no training conversation fits"):
        dm.setup("fit")


def test_block_packing_concatenates_and_cuts_into_full_blocks():
    common = {"num_train": 30, "num_val": 5, "seed": 1, "task_kwargs": {"chain_of_thought": True}}
    docs = _items(ChatSFTDataModule(**common))
    packed = ChatSFTDataModule(packing="block", block_size=40, batch_size=4, **common)
    blocks = _items(packed)
    stream_ids = torch.cat([doc["input_ids"] for doc in docs])
    stream_labels = torch.cat([doc["labels"] for doc in docs])
    # every block is exactly block_size; the stream is preserved in order; only a partial last block is dropped
    assert all(block["input_ids"].shape == (40,) for block in blocks)
    assert len(blocks) == len(stream_ids) // 40
    assert torch.equal(torch.cat([block["input_ids"] for block in blocks]), stream_ids[: len(blocks) * 40])
    assert torch.equal(torch.cat([block["labels"] for block in blocks]), stream_labels[: len(blocks) * 40])
    # labels of consecutive conversations follow each other: decoded, they are the responses back to back
    train, _ = packed._examples()
    labelled = torch.cat([_labelled(block["labels"], block["input_ids"]) for block in blocks])
    expected = "".join(example.completion + END for example in train)
    assert expected.startswith(packed.tokenizer.decode(labelled))
    # no padding: attention spans the whole block, across conversation boundaries
    batch = next(iter(packed.train_dataloader()))
    assert batch["input_ids"].shape == (4, 40) and batch["attention_mask"].all()
    user = packed.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert max(int((block["input_ids"] == user).sum()) for block in blocks) >= 3  # >1 conversation per block


def test_block_size_defaults_to_max_length_and_a_too_short_stream_fails():
    assert ChatSFTDataModule(packing="block", max_length=64).block_size == 64
    dm = ChatSFTDataModule(packing="block", block_size=10_000, num_train=2, num_val=0)
    with pytest.raises(ValueError, match=r"train conversations total \d+ tokens, fewer than one block"):
        dm.setup("fit")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"packing": "greedy"}, "unknown packing 'greedy'"),
        ({"packing": "block", "block_size": 1}, "block_size must be >= 2"),
        ({"block_size": 32}, "only applies to packing='block'"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"num_val": -1}, "num_val must be >= 0"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ChatSFTDataModule(**kwargs)


def test_hyperparameters_record_every_argument():
    hparams = ChatSFTDataModule(packing="block", task="copy", seed=3).hparams
    assert hparams["packing"] == "block" and hparams["task"] == "copy" and hparams["seed"] == 3
    assert {"block_size", "max_length", "num_workers", "tokenizer"} <= set(hparams)


def test_same_seed_same_batches_and_another_seed_others():
    def first_batch(seed: int) -> torch.Tensor:
        dm = ChatSFTDataModule(num_train=16, num_val=0, seed=seed)
        dm.setup("fit")
        return next(iter(dm.train_dataloader()))["input_ids"]

    assert torch.equal(first_batch(0), first_batch(0))
    assert not torch.equal(first_batch(0), first_batch(1))


def test_stateful_loader_resumes_mid_epoch_at_the_exact_next_batch():
    def loader() -> torch.utils.data.DataLoader:
        dm = ChatSFTDataModule(num_train=40, num_val=0, batch_size=4)
        dm.setup("fit")
        return dm.train_dataloader()

    first = loader()
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    state = first.state_dict()
    expected = next(iterator)

    resumed = loader()
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))["input_ids"], expected["input_ids"])


def test_each_epoch_is_reshuffled_not_replayed():
    dm = ChatSFTDataModule(num_train=40, num_val=0, batch_size=4)
    dm.setup("fit")
    loader = dm.train_dataloader()
    one, two = ([batch["input_ids"] for batch in loader] for _ in range(2))
    assert not all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


class _Recorder(L.LightningModule):
    """Records the batches it trains on; the loss is a dummy."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["input_ids"].clone())
        return self.weight * batch["input_ids"].float().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_checkpoint_resumes_the_data_order_mid_epoch(tmp_path):
    def trainer(**kwargs) -> L.Trainer:
        return L.Trainer(
            max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, default_root_dir=tmp_path, **kwargs,
        )  # fmt: skip

    def data() -> ChatSFTDataModule:
        return ChatSFTDataModule(num_train=40, num_val=0, batch_size=4)  # 10 batches per epoch

    full = _Recorder()
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    trainer(callbacks=[checkpoint]).fit(full, data())
    resumed = _Recorder()
    trainer(enable_checkpointing=False).fit(resumed, data(), ckpt_path=tmp_path / "epoch=0-step=3.ckpt")
    assert len(full.seen) == 6 and len(resumed.seen) == 3
    assert all(torch.equal(a, b) for a, b in zip(full.seen[3:], resumed.seen, strict=True))


def test_tokenizer_without_chat_template_is_a_clear_error(monkeypatch):
    def no_template(name: str, **kwargs):
        tokenizer = real_load(name, **kwargs)
        tokenizer.chat_template = None
        return tokenizer

    real_load = lightning_llm.backbones.load_tokenizer
    monkeypatch.setattr(lightning_llm.backbones, "load_tokenizer", no_template)
    with pytest.raises(ValueError, match=r"tiny.* has no chat template"):
        ChatSFTDataModule(num_train=2).setup("fit")


def test_template_without_end_token_gets_eos_appended(monkeypatch):
    def plain_template(name: str, **kwargs):
        tokenizer = real_load(name, **kwargs)
        tokenizer.chat_template = (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}"
        )
        return tokenizer

    real_load = lightning_llm.backbones.load_tokenizer
    monkeypatch.setattr(lightning_llm.backbones, "load_tokenizer", plain_template)
    dm = ChatSFTDataModule(task="copy", num_train=2, num_val=0)
    (item, *_) = _items(dm)
    train, _ = dm._examples()
    assert dm.tokenizer.decode(item["input_ids"]).startswith(f"user: {train[0].prompt}\nassistant: ")
    assert (
        dm.tokenizer.decode(_labelled(item["labels"], item["input_ids"])) == train[0].completion + "\n" + END
    )


def test_response_is_trained_up_to_the_templates_end_of_turn_not_a_different_eos(tiny_tokenizer):
    """A Gemma-style template closes the turn with ``<end_of_turn>`` while eos is another token: the label ends at
    ``<end_of_turn>`` (what the model's stop set stops on), with no eos appended after it."""
    import copy

    from lightning_llm.types import Example

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = (
        "{%- for message in messages %}"
        "{{ '<start_of_turn>' + message['role'] + '\\n' + message['content'] + '<end_of_turn>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<start_of_turn>assistant\\n' }}{%- endif %}"
    )
    dm = ChatSFTDataModule(task="arithmetic", num_train=4, num_val=1)
    dm.use_tokenizer(tok)
    ((ids, labels),) = dm._encode([Example(prompt="1+1", completion="2", answer="2")])
    trained = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    assert trained == tok("2", add_special_tokens=False)["input_ids"] + [end]
    assert tok.eos_token_id not in ids


def test_a_loader_state_taken_in_a_later_epoch_resumes_that_epochs_order():
    dm = ChatSFTDataModule(num_train=40, num_val=0, batch_size=4)
    dm.setup("fit")
    loader = dm.train_dataloader()
    list(loader)  # epoch 0
    it = iter(loader)
    head = [next(it)["input_ids"] for _ in range(3)]  # epoch 1, three batches in
    state = loader.state_dict()
    rest = [batch["input_ids"] for batch in it]
    fresh = dm.train_dataloader()
    fresh.load_state_dict(state)
    resumed = [batch["input_ids"] for batch in fresh]
    assert len(head) + len(rest) == 10 and len(resumed) == len(rest)
    assert all(torch.equal(a, b) for a, b in zip(rest, resumed, strict=True))
