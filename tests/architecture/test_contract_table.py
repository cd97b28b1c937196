"""The contract table: small random-init models of several architectures, saved by transformers and loaded by
path as a user would, each checked for the library's contract.

=====================  =======================================================================================
architecture           what it exercises
=====================  =======================================================================================
``llama``              tied head, the fused log-prob path
``qwen2-gqa-untied``   grouped-query attention, q/k/v biases, an untied head
``gemma2-softcap``     ``final_logit_softcapping``: the plain log-prob path (the model's own logits)
``two-end-ids``        a generation config listing two end-of-turn ids: rollouts stop on either
``gemma3-hybrid``      Gemma 3: sliding-window + global layers, one KV head, Gemma's turn format (no system role,
                       ``<end_of_turn>`` in the stop set), the shared-prefix GRPO pass on a hybrid mask
=====================  =======================================================================================

Per architecture: log-probs from ``target_logprobs`` equal ``log_softmax`` of the model's own logits, one
GRPO training step runs (rollouts ending at the model's stop set) and one SFT step runs.
"""

from __future__ import annotations

import copy
import logging

import lightning as L
import pytest
import torch

from lightning_llm.backbones import load_backbone
from lightning_llm.backbones.gemma3 import CHAT_TEMPLATE as GEMMA3_TEMPLATE
from lightning_llm.datamodules import ChatSFTDataModule, PromptDataModule
from lightning_llm.lm import logprob_path, position_ids_from_mask, save_backbone, target_logprobs
from lightning_llm.modules import CausalLMModule, GRPOModule
from lightning_llm.rl import Sampling

ARCHITECTURES = ("llama", "qwen2-gqa-untied", "gemma2-softcap", "two-end-ids", "gemma3-hybrid")
SMALL = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)


def _build(arch: str, tokenizer):
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    ids = dict(
        vocab_size=-(-len(tokenizer) // 16) * 16,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    if arch in ("llama", "two-end-ids"):
        config = LlamaConfig(
            num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, **SMALL, **ids
        )
        return LlamaForCausalLM(config)
    if arch == "qwen2-gqa-untied":
        config = Qwen2Config(
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **SMALL, **ids
        )
        return Qwen2ForCausalLM(config)
    if arch == "gemma3-hybrid":
        config = Gemma3TextConfig(
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=24,
            sliding_window=6,  # shorter than the prompts: the window matters
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            **SMALL,
            **ids,
        )
        return Gemma3ForCausalLM(config)
    config = Gemma2Config(
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
        sliding_window=16,
        final_logit_softcapping=2.0,
        **SMALL,
        **ids,
    )
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)  # logits past the cap, so capping matters
    return model


def _text_length(completions, examples):
    """A reward that differs between samples, so a group's advantages (and the update) are not zero."""
    return [float(len(c)) for c in completions]


def _prompt_batch(tokenizer, n: int = 2):
    dm = PromptDataModule(task="arithmetic", task_kwargs={"digits": 1, "ops": "+"}, num_train=8, num_val=2)
    dm.use_tokenizer(tokenizer)
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


def _gemma3_tokenizer(tokenizer):
    """The tiny tokenizer with Gemma's turn tokens and its chat template (which has no system turn)."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = GEMMA3_TEMPLATE
    return tokenizer


def _stops(arch, tokenizer, saved):
    if arch == "two-end-ids":
        return [tokenizer.eos_token_id, saved["second_end"]]
    if arch == "gemma3-hybrid":
        return [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    return [tokenizer.eos_token_id]


@pytest.fixture(scope="module")
def saved(tiny_backbone, tmp_path_factory):
    """``{arch: directory}``; the two-end-ids model lists eos and the token it emits first after the prompts."""
    _, tiny_tokenizer = tiny_backbone
    root = tmp_path_factory.mktemp("contract")
    out, second_end = {}, None
    for arch in ARCHITECTURES:
        tokenizer = _gemma3_tokenizer(tiny_tokenizer) if arch == "gemma3-hybrid" else tiny_tokenizer
        model = _build(arch, tokenizer).float()
        if arch == "two-end-ids":
            batch = _prompt_batch(tokenizer)
            with torch.no_grad():
                mask = batch["attention_mask"]
                logits = model(
                    batch["input_ids"], attention_mask=mask, position_ids=position_ids_from_mask(mask)
                )
            second_end = int(logits.logits[0, -1].argmax())
            assert second_end != tokenizer.eos_token_id
            model.generation_config.eos_token_id = [tokenizer.eos_token_id, second_end]
        save_backbone(model, tokenizer, root / arch)
        out[arch] = str(root / arch)
    out["second_end"] = second_end
    return out


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_target_logprobs_are_the_models_own(arch, saved):
    model, tokenizer = load_backbone(saved[arch])
    assert logprob_path(model) == ("plain" if arch == "gemma2-softcap" else "fused")
    batch = _prompt_batch(tokenizer)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    target = mask.bool().clone()
    target[:, :2] = False
    logprobs, entropy = target_logprobs(model, ids, mask, target, chunk_size=5, temperature=0.8)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    log_p = torch.log_softmax(logits.float()[:, :-1][target[:, 1:]] / 0.8, dim=-1)
    expected = log_p.gather(1, ids[:, 1:][target[:, 1:]][:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_grpo_step_with_rollouts_ending_at_the_stop_set(arch, saved, quiet_trainer, caplog):
    L.seed_everything(0)
    with caplog.at_level(logging.INFO):
        module = GRPOModule(
            model=saved[arch], rewards=[_text_length], group_size=2, max_new_tokens=6, lr=1e-3
        )
        module.configure_model()
    noticed = "plain path" in caplog.text
    assert noticed == (arch == "gemma2-softcap")  # the one-line notice, only where the path changes
    tokenizer = module.tokenizer
    stops = _stops(arch, tokenizer, saved)
    assert module.stop_token_ids == stops
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    dm = PromptDataModule(
        task="arithmetic", task_kwargs={"digits": 1, "ops": "+"}, num_train=8, num_val=2, batch_size=2
    )
    quiet_trainer(max_steps=1).fit(module, dm)
    assert any(not torch.equal(p, before[n]) for n, p in module.model.named_parameters())

    rollout = module.make_rollout(_prompt_batch(tokenizer), group_size=1, sampling=Sampling(6, 0.0, 1.0))
    completion = rollout.input_ids[:, rollout.prompt_length :]
    trained = rollout.loss_mask[:, rollout.prompt_length :]
    is_stop = torch.isin(completion, torch.tensor(stops)) & trained
    lengths = trained.sum(1)
    for row in range(completion.shape[0]):
        hits = is_stop[row].nonzero().flatten().tolist()
        assert hits in ([], [int(lengths[row]) - 1])  # a stop id only as the last trained token
    if arch == "two-end-ids":  # the second end id is what these prompts start with: greedy stops at once
        assert lengths.tolist() == [1] * completion.shape[0]
        assert completion[:, 0].tolist() == [saved["second_end"]] * completion.shape[0]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sft_step(arch, saved, quiet_trainer):
    L.seed_everything(0)
    module = CausalLMModule(model=saved[arch], lr=1e-3)
    dm = ChatSFTDataModule(task="arithmetic", num_train=8, num_val=2, batch_size=4, max_length=48)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    quiet_trainer(max_steps=1).fit(module, dm)
    assert any(not torch.equal(p, before[n]) for n, p in module.model.named_parameters())
