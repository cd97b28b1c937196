"""LT-Tuning (arXiv 2602.10229): fusion formula, Coconut reduction, the segment-wise latent forward, dynamic
generation, collapse statistics and the three-stage curriculum."""

import random
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_llm.callbacks import LatentThoughtsCurriculum
from lightning_llm.callbacks.latent_thoughts import insert_thinking, rebuild_with_thinking, token_confidence
from lightning_llm.datamodules import ChatSFTDataModule
from lightning_llm.datamodules.tasks import ArithmeticTask
from lightning_llm.modules import LatentThoughtsModule, fuse_latent, latent_collapse
from lightning_llm.modules.latent_thoughts import top_p_distribution
from lightning_llm.types import IGNORE_INDEX


@pytest.fixture(scope="module")
def module(tiny_backbone):
    torch.manual_seed(0)
    return LatentThoughtsModule(alpha=0.55).eval()


def test_fusion_equals_its_formula_on_a_hand_built_example():
    # V = 3 tokens (id 2 is <thinking>), H = 2.
    E = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    h = torch.tensor([[2.0, 4.0]])
    logits = torch.tensor([[0.0, torch.log(torch.tensor(3.0)).item(), 10.0]])
    # Without <thinking>: softmax over ids 0, 1 = (1/4, 3/4); top-p 1 keeps both.
    out = fuse_latent(h, logits, E, alpha=0.5, temperature=1.0, top_p=1.0, thinking_id=2)
    expected = 0.5 * h + 0.5 * torch.tensor([[0.25, 0.75]])
    torch.testing.assert_close(out, expected)
    # top-p 0.5: the nucleus is token 1 alone (mass before it is 0 < 0.5; before token 0 it is 0.75).
    out = fuse_latent(h, logits, E, alpha=0.25, top_p=0.5, thinking_id=2)
    torch.testing.assert_close(out, 0.25 * h + 0.75 * E[1])


def test_nucleus_is_the_authors_largest_prefix_within_top_p():
    # Sorted probabilities 0.5, 0.3, 0.2: cumulative 0.5, 0.8, 1.0. The authors keep the tokens whose cumulative
    # mass is <= 0.9 (the first two), not the smallest prefix reaching 0.9 (all three).
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    q = top_p_distribution(logits, top_p=0.9)
    torch.testing.assert_close(q, torch.tensor([[0.625, 0.375, 0.0]]))
    # The top token alone exceeds top_p: it is still kept.
    torch.testing.assert_close(top_p_distribution(logits, top_p=0.4), torch.tensor([[1.0, 0.0, 0.0]]))


def test_temperature_flattens_the_prediction_part():
    logits = torch.tensor([[2.0, 0.0]])
    sharp = top_p_distribution(logits, temperature=0.5, top_p=1.0)
    flat = top_p_distribution(logits, temperature=4.0, top_p=1.0)
    assert sharp[0, 0] > flat[0, 0] > 0.5
    torch.testing.assert_close(sharp.sum(), torch.tensor(1.0))


def test_alpha_one_is_coconut_the_hidden_state_itself():
    h = torch.randn(3, 4)
    assert fuse_latent(h, torch.randn(3, 7), torch.randn(7, 4), alpha=1.0, match_embedding_norm=True) is h


def test_match_embedding_norm_rescales_only_the_context_part():
    E = torch.tensor([[3.0, 4.0], [0.0, 5.0]])  # both rows have norm 5
    h = torch.tensor([[0.0, 100.0]])
    logits = torch.tensor([[0.0, 50.0]])  # q = one-hot on token 1
    out = fuse_latent(h, logits, E, alpha=0.5, top_p=1.0, match_embedding_norm=True)
    torch.testing.assert_close(out, 0.5 * torch.tensor([[0.0, 5.0]]) + 0.5 * E[1])


@pytest.mark.parametrize(
    "kwargs", [dict(alpha=1.5), dict(alpha=0.5, temperature=0.0), dict(alpha=0.5, top_p=0.0)]
)
def test_bad_fusion_settings_fail_clearly(kwargs):
    with pytest.raises(ValueError, match=r"alpha|temperature|top_p"):
        fuse_latent(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(3, 2), **kwargs)


def test_latent_forward_equals_a_full_forward_on_the_fed_latents(module):
    th = module.thinking_id
    ids = torch.tensor([[5, 6, 7, th, th, 8, 9, 10], [5, 6, th, 7, 8, th, 9, 10]])
    hidden, latents = module.latent_forward(ids)
    decoder, embed = module.model.get_decoder(), module.model.get_input_embeddings()
    fed = embed(ids).detach().clone()
    for t in range(1, ids.shape[1]):  # the sequential definition, one full forward per position
        prefix = decoder(inputs_embeds=fed[:, :t]).last_hidden_state
        for row in range(ids.shape[0]):
            if ids[row, t] == th:
                fed[row, t] = module._fuse(prefix[row, -1:])[0]
    reference = decoder(inputs_embeds=fed).last_hidden_state
    torch.testing.assert_close(hidden, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(latents[ids == th], fed[ids == th], atol=1e-5, rtol=1e-5)
    assert torch.all(latents[ids != th] == 0)


def test_gradients_flow_through_the_latent_chain(module, monkeypatch):
    th = module.thinking_id
    fed = []
    plain = module._fuse

    def recording(hidden):
        fed.append(plain(hidden))
        return fed[-1]

    monkeypatch.setattr(module, "_fuse", recording)
    hidden, _ = module.latent_forward(torch.tensor([[5, 6, th, th, th, 9]]))
    assert len(fed) == 3  # one decoder call per latent column
    # The third latent is computed from the pass that read the first: the chain is differentiable end to end.
    (grad,) = torch.autograd.grad(fed[2].sum(), fed[0], retain_graph=True)
    assert grad.abs().sum() > 0
    (grad,) = torch.autograd.grad(hidden[0, -1].sum(), fed[0])
    assert grad.abs().sum() > 0


def test_coconut_mode_does_not_train_thinking_targets(tiny_backbone):
    module = LatentThoughtsModule(alpha=1.0, num_latents=2)
    th = module.thinking_id
    batch = {
        "input_ids": torch.tensor([[5, 6, th, th, 8, 9]]),
        "labels": torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, th, th, 8, 9]]),
    }
    assert module._targets(batch).tolist() == [[False, False, False, False, True, True]]
    dynamic = LatentThoughtsModule(alpha=0.55)
    assert dynamic._targets(batch).tolist() == [[False, False, True, True, True, True]]


def test_generation_forces_coconut_latents_and_caps_dynamic_ones(tiny_backbone):
    torch.manual_seed(0)
    coconut = LatentThoughtsModule(alpha=1.0, num_latents=3)
    enc = coconut.tokenizer(
        ["<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt"
    )
    out = coconut.generate_latent(enc["input_ids"], enc["attention_mask"], max_new_tokens=6)
    assert out["latent_steps"] == [3] and out["explicit_tokens"][0] <= 3
    assert out["latents"][0].shape == (3, coconut.model.config.hidden_size)
    # A model whose argmax is always <thinking> takes exactly max_latent_steps latents, then has to talk.
    dynamic = LatentThoughtsModule(alpha=0.55, max_latent_steps=2)
    plain = dynamic._logits

    def always_thinking(hidden):
        logits = plain(hidden).clone()
        logits[:, dynamic.thinking_id] = 1e4
        return logits

    dynamic._logits = always_thinking
    out = dynamic.generate_latent(enc["input_ids"], enc["attention_mask"], max_new_tokens=5)
    assert out["latent_steps"] == [2] and out["explicit_tokens"][0] == 3


def test_dynamic_generation_enters_latent_mode_exactly_where_thinking_is_the_argmax(tiny_backbone):
    # The authors' switch: a step is latent iff the argmax is <thinking>. Make it the argmax at step 2 only.
    torch.manual_seed(0)
    module = LatentThoughtsModule(alpha=0.6)
    plain = module._logits
    calls = []

    def thinking_at_step_two(hidden):
        logits = plain(hidden).clone()
        if len(calls) == 2:
            logits[:, module.thinking_id] = 1e4
        calls.append(len(calls))
        return logits

    module._logits = thinking_at_step_two
    enc = module.tokenizer(
        ["<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt"
    )
    reference = LatentThoughtsModule(alpha=0.6)
    reference.model.load_state_dict(module.model.state_dict())
    ref = reference.generate_latent(enc["input_ids"], enc["attention_mask"], max_new_tokens=2)
    out = module.generate_latent(enc["input_ids"], enc["attention_mask"], max_new_tokens=5)
    assert out["latent_steps"] == [1] and out["explicit_tokens"] == [4]
    # Steps 0 and 1 are the unsteered model's tokens; the latent came third.
    assert ref["explicit_tokens"] == [2]
    first_two = module.tokenizer(out["texts"][0], add_special_tokens=False)["input_ids"][:2]
    assert first_two == module.tokenizer(ref["texts"][0], add_special_tokens=False)["input_ids"][:2]


def _bigram_model(vocab: int, hard_after: int, thinking_id: int):
    """A stub causal LM whose next-token distribution depends on the current token only: after token ``u`` it
    predicts ``u + 1`` with logit 10 against 0 for every other token, except after ``hard_after``, where all
    logits are 0 (confidence ``1 / vocab`` for any next token)."""
    weight = torch.zeros(vocab, vocab)  # weight[v, u]: logit of next token v after token u
    for u in range(vocab):
        if u != hard_after and u + 1 < vocab and u + 1 != thinking_id:
            weight[u + 1, u] = 10.0
    head = torch.nn.Linear(vocab, vocab, bias=False)
    head.weight.data = weight

    class Decoder(torch.nn.Module):
        def forward(self, input_ids, **_):
            return SimpleNamespace(last_hidden_state=torch.nn.functional.one_hot(input_ids, vocab).float())

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder, self.head = Decoder(), head

        def get_decoder(self):
            return self.decoder

        def get_output_embeddings(self):
            return self.head

    return Bigram()


def test_rebuild_inserts_thinking_where_the_model_confidence_is_below_threshold():
    # Tokens 0..6, <thinking> = 7. The model is sure of every next token except after token 3 (p = 1/8).
    model = _bigram_model(8, hard_after=3, thinking_id=7)
    item = {"input_ids": torch.arange(7), "labels": torch.tensor([IGNORE_INDEX, IGNORE_INDEX, 2, 3, 4, 5, 6])}
    (conf,) = token_confidence(model, [item], pad_id=0)
    assert conf[4].item() == pytest.approx(1 / 8) and bool(
        (conf[2:4] > 0.99).all() and (conf[5:] > 0.99).all()
    )
    (out,) = rebuild_with_thinking(model, [item], threshold=0.3, thinking_id=7, pad_id=0)
    assert out["input_ids"].tolist() == [0, 1, 2, 3, 7, 4, 5, 6]  # the latent goes right before token 4
    assert out["labels"].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 2, 3, 7, 4, 5, 6]
    # Below the 1/8 confidence, nothing is hard enough.
    (none,) = rebuild_with_thinking(model, [item], threshold=0.1, thinking_id=7, pad_id=0)
    assert none["input_ids"].tolist() == item["input_ids"].tolist()
    # The authors' second <thinking> at a site (probability 1 here) doubles it.
    (two,) = rebuild_with_thinking(model, [item], threshold=0.3, thinking_id=7, pad_id=0, second_prob=1.0)
    assert two["input_ids"].tolist() == [0, 1, 2, 3, 7, 7, 4, 5, 6]


def test_insert_thinking_caps_sites_and_draws_them_as_the_authors_do():
    n = 12
    item = {"input_ids": torch.arange(n), "labels": torch.arange(n)}
    conf = torch.full((n,), 0.01)
    conf[0] = float("nan")
    capped = insert_thinking(item, conf, threshold=0.3, thinking_id=99, max_sites=4, rng=random.Random(0))
    assert int((capped["input_ids"] == 99).sum()) == 4
    # The same sites as the authors' draw: a sorted random.sample of the candidates from the same generator.
    sites = sorted(random.Random(0).sample(list(range(1, n)), 4))
    after = [
        int(capped["input_ids"][i + 1]) for i in (capped["input_ids"] == 99).nonzero().flatten().tolist()
    ]
    assert after == sites
    never = insert_thinking(
        item, conf, threshold=0.3, thinking_id=99, insertion_prob=0.0, rng=random.Random(0)
    )
    assert never["input_ids"].tolist() == item["input_ids"].tolist()
    # With insertion probability 0.5, about half of 11 sites over many draws.
    kept = [
        int(
            (
                insert_thinking(
                    item, conf, threshold=0.3, thinking_id=99, insertion_prob=0.5, rng=random.Random(s)
                )["input_ids"]
                == 99
            ).sum()
        )
        for s in range(200)
    ]
    assert 5.0 < sum(kept) / len(kept) < 6.0
    with pytest.raises(ValueError, match="rng"):
        insert_thinking(item, conf, threshold=0.3, thinking_id=99, max_sites=4)


def test_latent_collapse_on_parallel_and_orthogonal_chains():
    parallel = torch.tensor([[[1.0, 0.0, 0.0], [2.0, 0.0, 0.0], [3.0, 0.0, 0.0]]])
    orthogonal = torch.eye(3)[None]
    p, o = latent_collapse(parallel), latent_collapse(orthogonal)
    assert p["mean_cosine"] == pytest.approx(1.0) and p["effective_rank"] == pytest.approx(1.0, abs=1e-4)
    assert o["mean_cosine"] == pytest.approx(0.0) and o["effective_rank"] == pytest.approx(3.0, abs=1e-4)
    masked = latent_collapse(torch.cat([orthogonal, parallel]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert masked["chains"] == 1 and masked["effective_rank"] == pytest.approx(2.0, abs=1e-4)


def test_arithmetic_latent_steps_writes_coconut_placeholders():
    (example,) = ArithmeticTask(digits=1, operands=3, latent_steps=2).generate(1, seed=0)
    assert example.completion.startswith("<thinking>" * 4 + "<answer>")
    with pytest.raises(ValueError, match="latent_steps"):
        ArithmeticTask(latent_steps=1, chain_of_thought=True)


def test_insert_thinking_before_low_confidence_label_tokens():
    item = {
        "input_ids": torch.tensor([1, 2, 3, 4, 5]),
        "labels": torch.tensor([IGNORE_INDEX, IGNORE_INDEX, 3, 4, 5]),
    }
    conf = torch.tensor([float("nan"), float("nan"), 0.1, 0.9, 0.05])
    out = insert_thinking(item, conf, threshold=0.3, thinking_id=99, skip=[5])
    assert out["input_ids"].tolist() == [1, 2, 99, 3, 4, 5]
    assert out["labels"].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 99, 3, 4, 5]


def test_token_confidence_matches_the_model_probability(tiny_backbone):
    model, tokenizer = tiny_backbone
    item = {
        "input_ids": torch.tensor([5, 6, 7, 8]),
        "labels": torch.tensor([IGNORE_INDEX, IGNORE_INDEX, 7, 8]),
    }
    (conf,) = token_confidence(model, [item], pad_id=tokenizer.pad_token_id)
    with torch.no_grad():
        probs = model(input_ids=item["input_ids"][None]).logits[0].softmax(-1)
    assert torch.isnan(conf[:2]).all()
    torch.testing.assert_close(conf[2:], torch.stack([probs[1, 7], probs[2, 8]]), atol=1e-5, rtol=1e-4)


def _curriculum_run(tmp_path, max_epochs, ckpt_path=None, curriculum=None):
    torch.manual_seed(0)
    data = ChatSFTDataModule(
        task="arithmetic",
        task_kwargs={"digits": 1, "operands": 3, "chain_of_thought": True},
        num_train=16,
        num_val=4,
        batch_size=8,
        max_length=96,
        seed=0,
    )
    module = LatentThoughtsModule(lr=3e-3)
    curriculum = curriculum or LatentThoughtsCurriculum(stage_epochs=(1, 1), thresholds=(0.3, 0.2), alpha=0.6)
    trainer = L.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        reload_dataloaders_every_n_epochs=1,
        default_root_dir=tmp_path,
        callbacks=[curriculum],
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, module, data, curriculum


def test_curriculum_stages_rebuild_data_from_explicit_items(tmp_path):
    _, module, data, curriculum = _curriculum_run(tmp_path, max_epochs=3)
    assert curriculum.stage == 3 and module.hparams.alpha == pytest.approx(0.6)
    th = module.thinking_id
    items = data.train_items
    assert curriculum.inserted > 0
    assert sum(int((item["input_ids"] == th).sum()) for item in items) == curriculum.inserted
    for item in items:  # every inserted <thinking> is a trained target; stripping it gives the explicit item
        assert torch.all(item["labels"][item["input_ids"] == th] == th)
    # The rebuild entering stage 3 restarted from explicit items: at most the authors' two <thinking> per site
    # (a run of three would be a stage-2 insertion kept), at most 16 sites per item.
    for item in items:
        ids = item["input_ids"].tolist()
        assert not any(a == b == c == th for a, b, c in zip(ids, ids[1:], ids[2:], strict=False))
        sites = sum(1 for i, t in enumerate(ids) if t == th and (i == 0 or ids[i - 1] != th))
        assert sites <= 16
    state = curriculum.state_dict()
    restored = LatentThoughtsCurriculum()
    restored.load_state_dict(torch.load(_saved(tmp_path, state), weights_only=True))
    assert restored.stage == 3
    assert [i["input_ids"].tolist() for i in restored._items] == [i["input_ids"].tolist() for i in items]


def _saved(tmp_path, state):
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return path


def test_curriculum_needs_dataloader_reloads(tmp_path, tiny_backbone):
    data = ChatSFTDataModule(task="arithmetic", num_train=8, num_val=2, batch_size=4, max_length=64)
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        callbacks=[LatentThoughtsCurriculum()],
    )
    with pytest.raises(ValueError, match="reload_dataloaders_every_n_epochs"):
        trainer.fit(LatentThoughtsModule(), data)


def test_checkpoint_keeps_the_stage_fusion(tmp_path, tiny_backbone):
    module = LatentThoughtsModule(alpha=1.0)
    module.set_fusion(alpha=0.5, top_p=0.8)
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    fresh = LatentThoughtsModule(alpha=1.0)
    fresh.on_load_checkpoint(checkpoint)
    assert (fresh.hparams.alpha, fresh.hparams.top_p) == (0.5, 0.8)


def _split_tag_model(tmp_path, tiny_backbone):
    """The tiny backbone whose tokenizer knows ``<thinking>`` as a vocabulary entry that encoding never produces
    (a BPE entry, not an added token: the text splits into several pieces)."""
    import json

    model, tokenizer = tiny_backbone
    directory = tmp_path / "split_tag"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    path = directory / "tokenizer.json"
    spec = json.loads(path.read_text())
    (entry,) = [t for t in spec["added_tokens"] if t["content"] == "<thinking>"]
    spec["added_tokens"].remove(entry)
    spec["model"]["vocab"]["<thinking>"] = entry["id"]
    path.write_text(json.dumps(spec))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.get("added_tokens_decoder", {}).pop(str(entry["id"]), None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory)


def test_a_latent_tag_that_is_not_one_token_is_refused(tmp_path, tiny_backbone):
    """Before: such a tokenizer trained with zero latent positions, silently."""
    with pytest.raises(ValueError, match=r"'<thinking>'.*single token"):
        LatentThoughtsModule(_split_tag_model(tmp_path, tiny_backbone))
