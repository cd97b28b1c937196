"""Shared-prefix passes (``lightning_llm.rl.shared_prefix``) equal the whole-row passes they replace.

Training equivalence at fp32, relative 1e-5: hidden states and gradients on Llama (tiny), Qwen2 (GQA, untied
head) and Gemma 3 (sliding-window layers shorter than the prompt) decoders; GRPO's per-token log-probs,
entropy, entropy-dynamics terms, old/reference log-probs and LoRA gradients at every call of a real fit with
``ppo_epochs``/``mini_batches`` > 1, ``beta`` > 0 and the RL callbacks that read old log-probs or entropy
dynamics; and prefill-once generation gives the same tokens, greedy and sampled.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_llm.backbones import load_backbone
from lightning_llm.callbacks import (
    EntropyDiscriminatorClipping,
    EntropyDynamicsMonitor,
    LLDSRegularizer,
    Recontextualization,
)
from lightning_llm.datamodules import PromptDataModule
from lightning_llm.lm import last_hidden_states
from lightning_llm.lora import LoRAConfig
from lightning_llm.modules import GRPOModule
from lightning_llm.rl import HFEngine, Sampling
from lightning_llm.rl.shared_prefix import (
    prefill_prefixes,
    prefix_groups,
    shared_prefix_hidden,
    shared_prefix_unsupported,
)

RTOL = 1e-5
#: S_y = p_y (H + log p_y) and N = E_p[S] (the entropy-dynamics terms) are computed from the same logits as the
#: log-probs and entropy: they agree to first order as closely as those do, times the size of their derivatives
#: (|H + log p| + 1 <= a few nats here). Their absolute tolerance is that many times the largest log-prob and
#: entropy difference of the same call (which the RTOL checks bound); near-uniform tiny-model distributions
#: make both terms ~5e-5 sums of cancelling summands, where a relative bound alone is below fp32 resolution.
DYNAMICS_FACTOR = 10.0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _grouped_batch(
    pad_id: int, vocab: int, *, groups: int, group_size: int, prompt: int, completion: int, seed: int
):
    """Left-padded prompts of different lengths (each repeated ``group_size`` times) and right-padded completions."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, vocab, (groups, prompt), generator=g)
    prompt_mask = torch.ones_like(prompts)
    for k in range(groups):
        prompt_mask[k, : (3 * k) % (prompt - 1)] = 0  # 0, 3, 6, ... padding columns
    prompts[prompt_mask == 0] = pad_id
    rows = groups * group_size
    completions = torch.randint(5, vocab, (rows, completion), generator=g)
    completion_mask = torch.ones_like(completions)
    for i in range(rows):
        completion_mask[i, completion - (i % completion) :] = 0  # ragged lengths, one row with none cut
    completion_mask[:, 0] = 1
    completions[completion_mask == 0] = pad_id
    ids = torch.cat([prompts.repeat_interleave(group_size, 0), completions], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(group_size, 0), completion_mask], 1)
    return ids, mask


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=128,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=5, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    return Gemma3ForCausalLM(config)


def _tiny():
    return load_backbone("tiny")[0]


ARCHITECTURES = {"llama-tiny": _tiny, "qwen2-gqa": _qwen2, "gemma3-sliding": _gemma3}


def test_prefix_groups_finds_identical_prompt_blocks_in_order():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    mask_differs = mask.clone()
    mask_differs[3, 0] = 1  # same ids, another mask: another prompt
    groups = prefix_groups(ids, mask)
    assert groups.unique.tolist() == [0, 2]
    assert groups.inverse.tolist() == [0, 0, 1, 0, 1]
    assert prefix_groups(ids, mask_differs).unique.tolist() == [0, 2, 3]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("group_size", [2, 8])
def test_shared_prefix_hidden_states_and_gradients_equal_whole_rows(arch, group_size):
    torch.manual_seed(0)
    model = ARCHITECTURES[arch]().float()
    model.train()
    assert shared_prefix_unsupported(model) is None
    vocab = min(model.config.vocab_size, 300)
    prompt = 11  # longer than Gemma's 5-token window
    ids, mask = _grouped_batch(0, vocab, groups=3, group_size=group_size, prompt=prompt, completion=6, seed=1)
    select = mask[:, prompt:].bool()
    weights = torch.randn(
        int(select.sum()), model.config.hidden_size, generator=torch.Generator().manual_seed(2)
    )
    params = list(model.get_decoder().parameters())  # an untied head takes no part in the hidden states

    whole = last_hidden_states(model, ids, mask)[:, prompt - 1 : -1][select]
    whole_grads = torch.autograd.grad((whole * weights).sum(), params)
    shared = shared_prefix_hidden(model, ids, mask, prompt)[select]
    shared_grads = torch.autograd.grad((shared * weights).sum(), params)

    assert _rel(shared, whole) < RTOL
    for a, b in zip(shared_grads, whole_grads, strict=True):
        assert _rel(a, b) < RTOL


class _BothPaths(GRPOModule):
    """Computes every token-statistics call both ways, asserts they agree (values and gradients), and carries
    on with the shared-prefix result."""

    checked: list[str]

    def _token_stats(self, model, rollout, rows, *, dynamics=False):
        self.checked = getattr(self, "checked", [])
        self.hparams.shared_prefix = False
        whole = super()._token_stats(model, rollout, rows, dynamics=dynamics)
        self.hparams.shared_prefix = True
        shared = super()._token_stats(model, rollout, rows, dynamics=dynamics)
        assert len(shared) == len(whole)
        for a, b in zip(shared[:2], whole[:2], strict=True):  # log-probs and entropy
            assert a.shape == b.shape and _rel(a.detach(), b.detach()) < RTOL
        drift = sum(
            float((a - b).abs().max()) for a, b in zip(shared[:2], whole[:2], strict=True) if a.numel()
        )
        for a, b in zip(shared[2:], whole[2:], strict=True):  # S_y and N, see DYNAMICS_FACTOR
            torch.testing.assert_close(a, b, rtol=RTOL, atol=DYNAMICS_FACTOR * drift + 1e-9)
        if torch.is_grad_enabled():
            params = [p for p in model.parameters() if p.requires_grad]
            probe = torch.randn(shared[0].shape, generator=torch.Generator().manual_seed(len(self.checked)))

            def grads(out):
                scalar = sum(((o * probe).sum() for o in out), torch.zeros(()))
                return torch.autograd.grad(scalar, params, retain_graph=True)

            # the LoRA gradient as one vector (a single small B tensor of a 30-layer model can sit at 1.3e-5)
            flat = [torch.cat([g.reshape(-1) for g in grads(out)]) for out in (shared, whole)]
            assert _rel(*flat) < RTOL
        self.checked.append("grad" if torch.is_grad_enabled() else "no-grad")
        return shared


def _fit_both_paths(
    model_name: str, *, callbacks, group_size: int, steps: int = 2, ppo_epochs: int = 2, **module_kwargs
):
    L.seed_everything(0, verbose=False)
    module = _BothPaths(
        model_name,
        group_size=group_size,
        max_new_tokens=8,
        ppo_epochs=ppo_epochs,
        mini_batches=2,
        beta=0.04,
        lr=1e-3,
        lora=LoRAConfig(r=4, alpha=8.0),
        **module_kwargs,
    )
    data = PromptDataModule(
        task="arithmetic", task_kwargs={"digits": 1}, system_prompt="task", batch_size=3, num_train=12,
        num_val=3, seed=0,
    )  # fmt: skip
    trainer = L.Trainer(
        max_steps=steps * ppo_epochs * 2, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, data)
    return module


@pytest.mark.parametrize("group_size", [2, 8])
def test_grpo_fit_is_training_equivalent_with_rl_callbacks(tiny_backbone, group_size):
    """A real fit (LoRA, beta > 0, 2 epochs x 2 mini-batches, left-padded prompts of different lengths): every
    old-policy, reference and policy pass agrees with the whole-row pass, with Clip_B (entropy dynamics),
    the dynamics monitor, LLDS (old log-probs) and recontextualization (old log-probs under a rewritten
    prompt)."""
    callbacks = [
        EntropyDiscriminatorClipping(mode="batch", mu=1.0),
        EntropyDynamicsMonitor(),
        LLDSRegularizer(),
        Recontextualization(generation_prompt="Be brief. {prompt}", training_prompt="{prompt}"),
    ]
    module = _fit_both_paths("tiny", callbacks=callbacks, group_size=group_size)
    # per rollout: old + reference (no grad), then ppo_epochs x mini_batches policy passes
    assert module.checked.count("no-grad") >= 2 * 2
    assert module.checked.count("grad") == 2 * 4


def test_shared_prefix_flag_off_runs_the_whole_row_pass(tiny_backbone, monkeypatch):
    import lightning_llm.modules.grpo as grpo

    def fail(*args, **kwargs):
        raise AssertionError("the shared-prefix pass ran with shared_prefix=False")

    monkeypatch.setattr(grpo, "shared_prefix_hidden", fail)
    L.seed_everything(0, verbose=False)
    module = GRPOModule(group_size=2, max_new_tokens=4, shared_prefix=False)
    data = PromptDataModule(
        task="arithmetic", task_kwargs={"digits": 1}, batch_size=2, num_train=4, num_val=2
    )
    L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0).fit(module, data)  # fmt: skip
    assert module.global_step == 1


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefill_once_generation_equals_prefilling_every_row(arch, temperature):
    torch.manual_seed(0)
    model = ARCHITECTURES[arch]().float().eval()
    model.generation_config.pad_token_id = 0
    ids, mask = _grouped_batch(0, 300, groups=3, group_size=4, prompt=11, completion=1, seed=3)
    ids, mask = ids[:, :11], mask[:, :11]
    sampling = Sampling(max_new_tokens=10, temperature=temperature)
    out = {}
    for share in (False, True):
        torch.manual_seed(7)
        out[share] = HFEngine(model, share_prefix=share).generate(
            ids, mask, sampling=sampling, stop_token_ids=[1], pad_id=0
        )
    assert torch.equal(out[True], out[False])
    # the shared cache is really used: a cache of other prompts changes what is generated
    other, _ = _grouped_batch(0, 300, groups=3, group_size=4, prompt=11, completion=1, seed=4)
    wrong = prefill_prefixes(model, other[:, :11], mask)
    from lightning_llm.backbones.inspect import cache_kwarg

    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                            **{cache_kwarg(model): wrong})  # fmt: skip
    if temperature == 0.0:
        assert not torch.equal(greedy[:, 11:], out[True][:, : greedy.shape[1] - 11])


def test_prefill_prefixes_shares_nothing_when_every_prompt_differs():
    model = _tiny().eval()
    ids = torch.randint(5, 300, (4, 6), generator=torch.Generator().manual_seed(0))
    assert prefill_prefixes(model, ids, torch.ones_like(ids)) is None


@pytest.mark.pretrained
def test_smollm2_grpo_token_stats_are_training_equivalent(smollm2_dir):
    """SmolLM2-135M-Instruct with LoRA: one rollout batch (group 8, 2 mini-batches, beta > 0, Clip_B) with
    every token-statistics call checked against the whole-row pass."""
    module = _fit_both_paths(
        "smollm2-135m",
        callbacks=[EntropyDiscriminatorClipping(mode="batch", mu=1.0)],
        group_size=8,
        steps=1,
        ppo_epochs=1,
    )
    assert module.checked.count("grad") == 2 and module.checked.count("no-grad") == 2


def test_unsupported_models_are_named_with_the_reason():
    from transformers import MistralConfig, MistralForCausalLM

    mistral = MistralForCausalLM(
        MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    )  # fmt: skip
    assert "sliding window" in shared_prefix_unsupported(mistral)
    flash = _qwen2()
    flash.config._attn_implementation = "flash_attention_2"
    assert "4-D attention mask" in shared_prefix_unsupported(flash)
    assert shared_prefix_unsupported(_gemma3()) is None


def test_grpo_runs_the_whole_row_pass_with_a_notice_where_sharing_is_not_exact(
    tiny_backbone, monkeypatch, caplog
):
    import logging

    import lightning_llm.modules.grpo as grpo

    def fail(*args, **kwargs):
        raise AssertionError("the shared-prefix pass ran on a model it is not exact for")

    monkeypatch.setattr(grpo, "shared_prefix_hidden", fail)
    monkeypatch.setattr(grpo, "shared_prefix_unsupported", lambda model: "a test model")
    L.seed_everything(0, verbose=False)
    module = GRPOModule(group_size=2, max_new_tokens=4)
    data = PromptDataModule(
        task="arithmetic", task_kwargs={"digits": 1}, batch_size=2, num_train=4, num_val=2
    )
    with caplog.at_level(logging.INFO):
        L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0).fit(module, data)  # fmt: skip
    notices = [r for r in caplog.records if "shared_prefix off" in r.getMessage()]
    assert len(notices) == 1 and "a test model" in notices[0].getMessage()
