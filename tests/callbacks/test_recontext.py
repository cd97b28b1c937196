"""Recontextualization: prompt specs, the GRPO hook points, and the expert-iteration path."""

import json

import pytest
import torch

from lightning_llm.callbacks import Recontextualization
from lightning_llm.callbacks.recontext import (
    best_of_n,
    contextualize,
    prompt_block,
    sample_completions,
    write_sft_jsonl,
)
from lightning_llm.datamodules import ChatSFTDataModule, Example, PromptDataModule
from lightning_llm.datamodules.sources import render_prompt
from lightning_llm.lm import target_logprobs
from lightning_llm.modules import CausalLMModule
from lightning_llm.modules.grpo import GRPOModule
from lightning_llm.rl import RLCallback, Sampling

GEN = "Never answer pass. {instruction}"
TRAIN = "You may answer pass. {instruction}"
EXAMPLE = Example("What is 1 + 2?", "<answer>3</answer>", "3", {"instruction": "What is 1 + 2?", "n": 7})


def test_contextualize_templates_callables_and_none():
    assert contextualize(None, EXAMPLE) == "What is 1 + 2?"
    assert contextualize("Be honest. {prompt}", EXAMPLE) == "Be honest. What is 1 + 2?"
    assert contextualize(GEN, EXAMPLE) == "Never answer pass. What is 1 + 2?"
    assert contextualize("{instruction} ({n})", EXAMPLE) == "What is 1 + 2? (7)"
    assert contextualize(lambda ex: ex.answer + "!", EXAMPLE) == "3!"
    with pytest.raises(ValueError, match=r"needs field 'style'.*instruction"):
        contextualize("{style}: {prompt}", EXAMPLE)
    with pytest.raises(TypeError, match="returned int"):
        contextualize(lambda ex: 3, EXAMPLE)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "both None"),
        ({"generation_prompt": "Never cheat."}, ValueError, "has no field"),
        ({"training_prompt": "{prompt"}, ValueError, "not a valid format template"),
        ({"generation_prompt": 3}, TypeError, "template string, a callable"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        Recontextualization(**kwargs)


def test_prompt_block_renders_like_the_datamodule(tiny_tokenizer):
    data = PromptDataModule(task="gameable", num_train=8, num_val=0, batch_size=8, system_prompt="Be brief.")
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    ids, mask, texts = prompt_block(tiny_tokenizer, batch["example"], None, system_prompt="Be brief.")
    assert texts == batch["prompt"]
    assert torch.equal(ids, batch["input_ids"]) and torch.equal(mask, batch["attention_mask"])
    _, _, gen = prompt_block(tiny_tokenizer, batch["example"], GEN, system_prompt="Be brief.")
    ex = batch["example"][0]
    assert gen[0] == render_prompt(
        tiny_tokenizer, "Never answer pass. " + ex.metadata["instruction"], "Be brief."
    )


class _Spy(RLCallback):
    """Records the prompt batch, the rollout and (at the first update) the step it is shown."""

    def __init__(self):
        self.batch = self.rollout = self.step = None
        self.direct = {}

    def on_rollout_start(self, trainer, pl_module, batch):
        self.batch = batch

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.rollout = rollout

    def on_policy_loss(self, trainer, pl_module, rollout, step):
        if self.step is None:
            self.step = step
            self.rollout_seen_by_loss = rollout


def _direct(model, rollout, rows):
    """Log-probs of the trainable tokens of ``rows`` (in that order, as a step lists them), by a plain forward."""
    with torch.no_grad():
        return target_logprobs(
            model, rollout.input_ids[rows], rollout.attention_mask[rows], rollout.loss_mask[rows]
        )[0]


def test_generation_under_x_gen_loss_under_x_train(tiny_backbone, quiet_trainer):
    """Rollouts are sampled under x_gen; old/ref log-probs are x_gen's; the loss forward sees x_train ids."""
    before, recontext, after = _Spy(), Recontextualization(GEN, TRAIN), _Spy()
    module = GRPOModule(
        rewards=["gameable", "hack"], reward_weights=[1, 0], group_size=2, max_new_tokens=4, beta=0.04
    )
    captured = {}

    class _Checker(RLCallback):  # runs last, before the first optimiser step: the model is still π_old
        def on_policy_loss(self, trainer, pl_module, rollout, step):
            if not captured:
                captured["gen_policy"] = _direct(pl_module.model, before.rollout, step.rows)
                with pl_module.reference.model(pl_module.model) as reference:
                    captured["gen_ref"] = _direct(reference, before.rollout, step.rows)
                captured["train_policy"] = _direct(pl_module.model, rollout, step.rows)

    data = PromptDataModule(task="gameable", num_train=4, num_val=0, batch_size=2)
    trainer = quiet_trainer(max_steps=1, callbacks=[before, recontext, after, _Checker()])
    trainer.fit(module, data)
    tok = module.tokenizer
    gen, train = before.rollout, after.rollout
    # on_rollout_start: the spy after the callback saw x_gen; the spy before it, the DataModule's prompt
    for row, ex in enumerate(after.batch["example"]):
        assert after.batch["prompt"][row] == render_prompt(
            tok, "Never answer pass. " + ex.metadata["instruction"]
        )
        assert before.batch["prompt"][row] == render_prompt(tok, ex.prompt)
    for row, ex in enumerate(gen.examples):
        gen_prompt = tok.decode(
            gen.input_ids[row, : gen.prompt_length][gen.attention_mask[row, : gen.prompt_length].bool()]
        )
        train_prompt = tok.decode(
            train.input_ids[row, : train.prompt_length][
                train.attention_mask[row, : train.prompt_length].bool()
            ]
        )
        assert gen_prompt == render_prompt(tok, "Never answer pass. " + ex.metadata["instruction"])
        assert train_prompt == render_prompt(tok, "You may answer pass. " + ex.metadata["instruction"])
    # the same completion tokens, masks and advantages behind both prompts; the loss used the x_train rollout
    assert torch.equal(gen.input_ids[:, gen.prompt_length :], train.input_ids[:, train.prompt_length :])
    assert torch.equal(gen.loss_mask[:, gen.prompt_length :], train.loss_mask[:, train.prompt_length :])
    assert torch.equal(gen.advantages[gen.loss_mask], train.advantages[train.loss_mask])
    assert after.rollout_seen_by_loss is train
    # old and reference log-probs are those of the completions under x_gen...
    step = after.step
    torch.testing.assert_close(step.old_logprobs, captured["gen_policy"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.ref_logprobs, captured["gen_ref"], rtol=1e-5, atol=1e-5)
    # ...while the policy log-probs are under x_train: no importance correction, ratio = π(y|x_train)/π_old(y|x_gen)
    torch.testing.assert_close(step.logprobs.detach(), captured["train_policy"], rtol=1e-5, atol=1e-5)
    assert (captured["train_policy"] - captured["gen_policy"]).abs().max() > 1e-3
    torch.testing.assert_close(
        step.ratio.detach(), torch.exp(captured["train_policy"] - captured["gen_policy"])
    )


def test_training_prompt_only_keeps_the_datamodule_generation_prompt(tiny_backbone, quiet_trainer):
    before, after = _Spy(), _Spy()
    module = GRPOModule(rewards=["hack"], group_size=2, max_new_tokens=3)
    data = PromptDataModule(task="gameable", num_train=2, num_val=0, batch_size=2)
    trainer = quiet_trainer(
        max_steps=1, callbacks=[before, Recontextualization(training_prompt="{instruction}"), after]
    )
    trainer.fit(module, data)
    assert after.batch is before.batch  # no generation prompt: the batch passes through untouched
    row = after.rollout
    text = module.tokenizer.decode(
        row.input_ids[0, : row.prompt_length][row.attention_mask[0, : row.prompt_length].bool()]
    )
    assert text == render_prompt(module.tokenizer, row.examples[0].metadata["instruction"])


def test_best_of_n_picks_the_best_under_x_gen_for_x_train(tiny_backbone, tmp_path, quiet_trainer):
    model, tokenizer = tiny_backbone
    examples = [
        Example(f"What is {i} + 1?", "", str(i + 1), {"instruction": f"What is {i} + 1?"}) for i in range(3)
    ]
    seen = []

    def reward(completions, exs):
        seen.append(list(completions))
        return [float(len(c)) for c in completions]

    torch.manual_seed(0)
    out = best_of_n(
        model,
        tokenizer,
        examples,
        reward,
        n=3,
        generation_prompt=GEN,
        training_prompt=TRAIN,
        sampling=Sampling(5, 1.0, 1.0),
    )
    assert len(out) == 3 and len(seen) == 3
    for ex, got, completions in zip(examples, out, seen, strict=True):
        assert got.prompt == "You may answer pass. " + ex.metadata["instruction"]
        assert got.completion == max(completions, key=len)
        assert got.metadata["best_of_n_reward"] == max(len(c) for c in completions)
        assert got.answer == ex.answer
    assert best_of_n(model, tokenizer, examples, reward, n=2, min_reward=1e9, sampling=Sampling(3)) == []
    with pytest.raises(ValueError, match="n >= 1"):
        best_of_n(model, tokenizer, examples, reward, n=0)

    # expert iteration's SFT step: the JSONL goes through ChatSFTDataModule into CausalLMModule
    path = write_sft_jsonl(out, tmp_path / "round0.jsonl")
    first = json.loads(path.read_text().splitlines()[0])
    assert first["prompt"] == out[0].prompt and first["completion"] == out[0].completion
    data = ChatSFTDataModule(task=None, source=str(path), num_val=0, batch_size=3)
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(CausalLMModule(), data)
    assert trainer.global_step == 1
    with pytest.raises(ValueError, match="no examples"):
        write_sft_jsonl([], tmp_path / "empty.jsonl")


def test_sample_completions_greedy_is_deterministic(tiny_backbone):
    model, tokenizer = tiny_backbone
    exs = [EXAMPLE, EXAMPLE]
    a = sample_completions(model, tokenizer, exs, GEN, num_samples=2, sampling=Sampling(4, 0.0), batch_size=3)
    b = sample_completions(model, tokenizer, exs, GEN, num_samples=2, sampling=Sampling(4, 0.0))
    assert a == b and len(a) == 2 and all(len(s) == 2 and s[0] == s[1] for s in a)
    with pytest.raises(ValueError, match="num_samples"):
        sample_completions(model, tokenizer, exs, num_samples=0)
