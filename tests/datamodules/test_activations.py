"""ActivationDataModule: sequential vs block harvest, special flags, mixing buffer, cache, resume, DDP split."""

from __future__ import annotations

import inspect
import itertools
import json

import lightning as L
import pytest
import torch

from lightning_llm.callbacks.steering import decoder_layers
from lightning_llm.datamodules import ActivationDataModule, activation_harvest
from lightning_llm.datamodules.activation_store import ShardStore
from lightning_llm.datamodules.mixing import ActivationStream
from lightning_llm.datamodules.tasks import get_task, split_train_val

#: Small everywhere: 40 arithmetic dialogues of ~25 tokens (~1000 tokens), several shards, several buffer fills.
SMALL = dict(
    num_train=40,
    num_val=8,
    max_length=64,
    harvest_batch_size=8,
    batch_size=64,
    buffer_size=256,
    shard_tokens=300,
)


def _dm(**kwargs) -> ActivationDataModule:
    dm = ActivationDataModule(**{**SMALL, **kwargs})
    dm.setup("fit")
    return dm


def _dialogue_ids(tokenizer, examples) -> list[list[int]]:
    """Each dialogue rendered by the chat template and tokenized on its own."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": ex.prompt}, {"role": "assistant", "content": ex.completion}],
            tokenize=False,
        )
        for ex in examples
    ]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _epoch(loader) -> list[dict[str, torch.Tensor]]:
    return list(loader)


@pytest.fixture(scope="module")
def sequential() -> ActivationDataModule:
    return _dm()


@pytest.mark.parametrize("mode", ["sequential", "block"])
def test_sequential_rows_hold_one_dialogue_each_and_blocks_several(mode):
    """What attention sees: the ids and the mask reaching the first layer's self-attention during the harvest."""
    dm = ActivationDataModule(mode=mode, **SMALL)
    model = dm.backbone
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    ids: list[torch.Tensor] = []

    def on_embed(module, args):
        ids.append(args[0].cpu())

    def on_attention(module, args, kwargs):
        mask = kwargs["attention_mask"]  # [b, 1, T, T] boolean, or None when nothing is masked
        hidden = kwargs["hidden_states"]
        # keys the last query position of each row may attend to (causal): the row's visible tokens
        visible = torch.ones(hidden.shape[:2], dtype=torch.bool) if mask is None else mask[:, 0, -1].cpu()
        seen.append((ids[-1], visible))

    handles = [
        model.get_input_embeddings().register_forward_pre_hook(on_embed),
        decoder_layers(model)[0].self_attn.register_forward_pre_hook(on_attention, with_kwargs=True),
    ]
    try:
        dm.setup("fit")
    finally:
        for handle in handles:
            handle.remove()
    rows = [row[visible].tolist() for batch, mask in seen for row, visible in zip(batch, mask, strict=True)]
    train, val = split_train_val(get_task("arithmetic"), 40, 8, 0)
    train_ids, val_ids = _dialogue_ids(dm.tokenizer, train), _dialogue_ids(dm.tokenizer, val)
    assert max(map(len, train_ids + val_ids)) <= 64  # no truncation at these sizes
    start = dm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    if mode == "sequential":
        assert rows == train_ids + val_ids  # every row is exactly one dialogue, in order
    else:
        blocks, val_rows = rows[: -len(val_ids)], rows[-len(val_ids) :]
        assert all(len(block) == 64 for block in blocks)  # unpadded: the whole block is visible
        stream = list(itertools.chain.from_iterable(train_ids))
        assert list(itertools.chain.from_iterable(blocks)) == stream[: 64 * len(blocks)]
        assert all(block.count(start) >= 3 for block in blocks)  # >1 dialogue (2 turns each) per row
        assert val_rows == val_ids  # validation stays one dialogue per row


def test_activations_are_the_layer_output_at_real_tokens(sequential, tiny_backbone):
    model, tokenizer = tiny_backbone
    train, val = split_train_val(get_task("arithmetic"), 40, 8, 0)
    store = sequential._store
    offset = 0
    for dialogue in _dialogue_ids(tokenizer, train)[:3]:
        with torch.no_grad():
            hidden = model(torch.tensor([dialogue]), output_hidden_states=True).hidden_states[2][0]
        harvested = store.gather(torch.arange(offset, offset + len(dialogue)))[0]
        torch.testing.assert_close(harvested, hidden, atol=1e-5, rtol=1e-4)
        assert store.token_ids()[offset : offset + len(dialogue)].tolist() == dialogue
        offset += len(dialogue)
    batch = next(iter(sequential.val_dataloader()))
    first = _dialogue_ids(tokenizer, val)[0]
    with torch.no_grad():
        hidden = model(torch.tensor([first]), output_hidden_states=True).hidden_states[2][0]
    torch.testing.assert_close(batch["activations"][0, : len(first)], hidden, atol=1e-5, rtol=1e-4)


def test_special_flags_mark_exactly_the_template_tokens(sequential):
    tokenizer = sequential.tokenizer
    control = {tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert sequential.special_token_ids == frozenset(control)  # <|im_start|> is not in all_special_ids
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in tokenizer.all_special_ids
    batch = next(iter(sequential.val_dataloader()))
    answer = tokenizer.convert_tokens_to_ids("<answer>")
    rows = zip(
        batch["input_ids"], batch["attention_mask"], batch["special_mask"], batch["activations"], strict=True
    )
    for ids, mask, special, activations in rows:
        real = ids[mask.bool()]
        text = tokenizer.decode(real)
        flagged = special[mask.bool()].nonzero().flatten().tolist()
        expected = [i for i, t in enumerate(real.tolist()) if t in control]
        assert flagged == expected and len(flagged) == text.count("<|im_start|>") + text.count("<|im_end|>")
        assert (real == answer).any() and not special[mask.bool()][real == answer].any()  # tags are text
        assert not special[~mask.bool()].any() and not activations[~mask.bool()].any()  # padding
    store = sequential._store
    assert torch.equal(store.special, torch.isin(store.token_ids(), torch.tensor(sorted(control))))


def test_token_budget_is_exact_and_equal_in_both_modes():
    for mode in ("sequential", "block"):
        dm = _dm(mode=mode, num_tokens=640)
        assert dm.num_train_tokens == 640
        loader = dm.train_dataloader()
        batches = _epoch(loader)
        assert len(loader) == len(batches) == 10
        assert all(
            b["activations"].shape == (64, 128) and b["activations"].dtype == torch.float32 for b in batches
        )
        assert all(
            b["special_mask"].shape == (64,) and b["special_mask"].dtype == torch.bool for b in batches
        )


def test_an_epoch_is_a_permutation_and_epochs_differ():
    dm = _dm(num_tokens=960)  # 15 batches; 4 shards (300, 300, 300, 60); buffer of 256 refilled many times
    stream, store = dm._stream, dm._store
    loader = dm.train_dataloader()
    one, two = _epoch(loader), _epoch(loader)
    indices = [torch.cat([idx for idx, _, _ in stream.batches(epoch)]) for epoch in (0, 1)]
    for epoch, batches in zip(indices, (one, two), strict=True):
        assert torch.equal(epoch.sort().values, torch.arange(960))  # nothing lost or duplicated
        activations, special = store.gather(epoch)
        assert torch.equal(torch.cat([b["activations"] for b in batches]), activations)
        assert torch.equal(torch.cat([b["special_mask"] for b in batches]), special)
    assert not torch.equal(indices[0], indices[1])
    # not a multiple of the batch size: the last partial batch is dropped, the rest still has no duplicate
    dm = _dm(num_tokens=990)
    served = torch.cat([idx for idx, _, _ in dm._stream.batches(0)])
    assert len(served) == 960 and len(served.unique()) == 960


def test_cache_is_reused_without_the_backbone_and_rebuilt_when_needed(tmp_path, monkeypatch, sequential):
    first = ActivationDataModule(cache_dir=str(tmp_path), **SMALL)
    first.prepare_data()
    first.setup("fit")
    assert isinstance(first._store, ShardStore)  # training reads shards, one at a time
    assert sorted(p.name for p in first.cache_path.iterdir()) == [
        "manifest.json", "train-00000.safetensors", "train-00001.safetensors", "train-00002.safetensors",
        "train-00003.safetensors", "val.safetensors",
    ]  # fmt: skip
    # the same training stream as the in-memory harvest (same virtual shards)
    memory = ActivationDataModule(**SMALL)
    memory.setup("fit")
    assert all(
        torch.equal(a["activations"], b["activations"])
        for a, b in zip(first.train_dataloader(), memory.train_dataloader(), strict=True)
    )

    calls = []

    def no_backbone(*args, **kwargs):
        calls.append(kwargs)
        raise AssertionError("the backbone ran")

    real_harvest = activation_harvest.layer_activations
    monkeypatch.setattr(activation_harvest, "layer_activations", no_backbone)
    second = ActivationDataModule(cache_dir=str(tmp_path), **SMALL)
    second.prepare_data()
    second.setup("fit")
    assert second._backbone is None and not calls
    assert second.num_train_tokens == first.num_train_tokens and second.d_in == 128
    for a, b in zip(second.val_dataloader(), sequential.val_dataloader(), strict=True):
        assert all(torch.equal(a[key], b[key]) for key in a)
    with pytest.raises(AssertionError, match="the backbone ran"):  # another key harvests anew
        ActivationDataModule(cache_dir=str(tmp_path), **{**SMALL, "layer": 2}).prepare_data()

    calls.clear()
    monkeypatch.setattr(
        activation_harvest, "layer_activations", lambda *a, **k: (calls.append(1), real_harvest(*a, **k))[1]
    )
    manifest = first.cache_path / "manifest.json"
    manifest.write_text(manifest.read_text()[:-20])  # truncated
    with pytest.warns(UserWarning, match="unreadable manifest"):
        ActivationDataModule(cache_dir=str(tmp_path), **SMALL).prepare_data()
    data = json.loads(manifest.read_text())
    data["key"]["layer"] = 3  # a manifest that does not describe this harvest
    manifest.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="key differs"):
        ActivationDataModule(cache_dir=str(tmp_path), **SMALL).prepare_data()
    (first.cache_path / "train-00002.safetensors").write_bytes(b"\0" * 10)  # corrupt shard
    rebuilt = ActivationDataModule(cache_dir=str(tmp_path), **SMALL)
    with pytest.warns(UserWarning, match="size mismatch for train-00002"):
        rebuilt.setup("fit")
    assert len(calls) == 6  # three rebuilds, two harvest passes (train, validation) each
    assert torch.equal(rebuilt.sample_activations(50), memory.sample_activations(50))


def test_state_dict_resumes_at_the_exact_next_batch(tmp_path, sequential):
    def same(one: list[dict[str, torch.Tensor]], two: list[dict[str, torch.Tensor]]) -> bool:
        return len(one) == len(two) > 0 and all(
            torch.equal(a["activations"], b["activations"])
            and torch.equal(a["special_mask"], b["special_mask"])
            for a, b in zip(one, two, strict=True)
        )

    loader = _dm().train_dataloader()  # the uninterrupted run
    cached = ActivationDataModule(cache_dir=str(tmp_path), **SMALL)  # resumes from shards: reads on demand
    cached.setup("fit")
    for epoch, stop, other in ((0, 4, sequential), (1, 7, cached)):
        iterator = iter(loader)
        for _ in range(stop):
            next(iterator)
        state = loader.state_dict()
        expected = list(iterator)
        resumed = other.train_dataloader()  # another DataModule's loader: only the state carries over
        resumed.load_state_dict(state)
        assert same(list(resumed), expected) and other._stream.epoch == epoch
    assert same(list(resumed), list(loader))  # and the next epoch is the uninterrupted run's next epoch


class _Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["activations"].clone())
        return self.weight * batch["activations"].mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_checkpoint_resumes_the_stream_mid_epoch(tmp_path, quiet_trainer):
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    full = _Recorder()  # 15 batches an epoch: steps 3..6 of epoch 0
    quiet_trainer(max_steps=6, callbacks=[checkpoint], enable_checkpointing=True).fit(
        full, ActivationDataModule(**SMALL)
    )
    resumed = _Recorder()
    quiet_trainer(max_steps=6).fit(
        resumed, ActivationDataModule(**SMALL), ckpt_path=tmp_path / "epoch=0-step=3.ckpt"
    )
    assert len(full.seen) == 6 and len(resumed.seen) == 3
    assert all(torch.equal(a, b) for a, b in zip(full.seen[3:], resumed.seen, strict=True))


def test_ranks_get_equal_disjoint_round_robin_shares(sequential):
    stream = sequential._stream
    single = [idx for idx, _, _ in stream.batches(0)]
    assert len(single) == sequential.num_train_tokens // 64
    shares = [[idx for idx, _, _ in stream.batches(0, rank=rank, world_size=4)] for rank in range(4)]
    per_rank = len(single) // 4
    assert [len(share) for share in shares] == [per_rank] * 4 == [stream.num_batches(4)] * 4
    served = torch.cat([torch.cat(share) for share in shares])
    assert len(served.unique()) == len(served)  # disjoint
    for rank, share in enumerate(shares):  # rank r takes global batches r, r + 4, ...
        assert all(torch.equal(a, b) for a, b in zip(share, single[rank::4], strict=False))
    assert len(ActivationStream(stream.store, batch_size=64, buffer_size=256, seed=0,
                                world_size=4)) == per_rank  # fmt: skip


def test_validation_is_identical_for_sequential_and_block_training(sequential):
    block = _dm(mode="block", block_size=48)
    assert block.num_train_tokens != sequential.num_train_tokens  # the training data does differ
    pairs = list(zip(sequential.val_dataloader(), block.val_dataloader(), strict=True))
    assert len(pairs) == 1 and pairs[0][0]["input_ids"].shape[0] == 8
    for a, b in pairs:
        assert set(a) == {"input_ids", "attention_mask", "activations", "special_mask"}
        assert all(torch.equal(a[key], b[key]) for key in a)
        assert a["attention_mask"].dtype == torch.long and a["special_mask"].dtype == torch.bool


def test_backbone_is_frozen_and_the_sample_is_seeded(sequential):
    assert set(sequential.hparams) == set(inspect.signature(ActivationDataModule).parameters)
    assert sequential.layer == 1 and ActivationDataModule(**{**SMALL, "layer": -2}).layer == 2
    model = sequential.backbone
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    sample = sequential.sample_activations(100)
    assert sample.shape == (100, 128) and sample.dtype == torch.float32
    assert torch.equal(sample, sequential.sample_activations(100))  # every DDP rank gets the same sample


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"mode": "packed"}, ValueError, "unknown mode 'packed'"),
        ({"block_size": 32}, ValueError, "block_size only applies to mode='block'"),
        ({"buffer_size": 32}, ValueError, r"buffer_size \(32\) must be >= batch_size \(64\)"),
        ({"num_tokens": 0}, ValueError, "num_tokens must be >= 1"),
        ({"num_tokens": 50}, ValueError, r"num_tokens \(50\) must be >= batch_size \(64\)"),
        ({"harvest_batch_size": 0}, ValueError, "harvest_batch_size must be >= 1"),
        ({"layer": 1.5}, TypeError, "layer must be an int"),
        ({"task": None}, ValueError, "give exactly one of `task` and `source`"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        ActivationDataModule(**{**SMALL, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer": 4}, "layer 4 out of range for a model with 4 decoder layers"),
        ({"num_tokens": 100_000}, r"num_tokens=100000 but the sequential training data has only \d+ tokens"),
        (
            {"batch_size": 2000, "buffer_size": 2000},
            r"\d+ training tokens make fewer than one batch of batch_size=2000",
        ),
    ],
)
def test_bad_data_fails_at_setup(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ActivationDataModule(**{**SMALL, **kwargs}).setup("fit")


def test_using_it_before_setup_or_oversampling_is_a_clear_error(sequential):
    with pytest.raises(RuntimeError, match="call setup"):
        ActivationDataModule(**SMALL).sample_activations(1)
    with pytest.raises(ValueError, match=r"cannot sample 100000 activations from \d+ harvested tokens"):
        sequential.sample_activations(100_000)
