"""Group-relative policy optimisation (GRPO) for any causal LM, with the RL hook points of ``RLCallback``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_llm.backbones import load_model
from lightning_llm.envs import Environment
from lightning_llm.lm import adamw, global_mean, head_logprobs, target_logprobs
from lightning_llm.lora import LoRAConfig, fold_adapters, lora_layers
from lightning_llm.modules.base import BackboneModule
from lightning_llm.modules.causal_lm import warmup_cosine
from lightning_llm.modules.reference import ReferencePolicy
from lightning_llm.rewards import get_reward, resolve_rewards, reward_names
from lightning_llm.rl import (
    HFEngine,
    PolicyLossStep,
    RLCallback,
    Rollout,
    RolloutEngine,
    Sampling,
    run_episodes,
)
from lightning_llm.rl.advantages import group_advantages
from lightning_llm.rl.shared_prefix import shared_prefix_hidden, shared_prefix_unsupported

__all__ = ["GRPOModule", "group_advantages"]


class GRPOModule(BackboneModule):
    r"""GRPO: sample a group of completions per prompt, score them, and push up the better-than-group ones.

    For each prompt :math:`q` a group of :math:`G` completions is sampled; rewards are combined
    (:math:`r_i = \sum_j w_j R_j(o_i)`) and turned into advantages by :func:`group_advantages`. The clipped
    surrogate per trainable token is

    .. math::
        \ell_t = -\min\big(\rho_t A_t,\ \mathrm{clip}(\rho_t, 1-\epsilon, 1+\epsilon_{high}) A_t\big)
                 + \beta\, \mathbb{D}_{KL,t}, \qquad \rho_t = \frac{\pi_\theta(o_t)}{\pi_{old}(o_t)},

    with the k3 estimator :math:`\mathbb{D}_{KL,t} = e^{r_t} - r_t - 1,\ r_t = \log\pi_{ref} - \log\pi_\theta`,
    aggregated as a token mean over the (global) batch or a mean of per-sequence means. Each rollout batch is
    used for ``ppo_epochs × mini_batches`` updates with the rollout-time log-probs as :math:`\pi_{old}`.
    Every policy quantity (log-probs, ratio, entropy, KL) is computed at the sampling ``temperature``, i.e. from
    ``logits / T``, as TRL does: the ratio is then between the distributions the tokens were drawn from.

    The reference :math:`\pi_{ref}` (``beta > 0``) is the policy as it stands when RL starts, after any warm-up
    callback (:class:`~lightning_llm.callbacks.SFTWarmup`): with LoRA the policy's base with its adapters off (a
    warm-up's adapter update is first folded into the base, so the KL is exactly 0 at the first RL step) — no
    second copy —; otherwise a frozen copy. It is never a submodule: checkpoints do not carry it, except the one
    case where nothing else holds its weights (full fine-tuning after a warm-up), and a resumed run rebuilds it
    exactly (:class:`~lightning_llm.modules.reference.ReferencePolicy`).

    Warm-up callbacks run through the strategy: at the first training step the module takes their batches, its
    backward goes through ``manual_backward`` (gradient sync under DDP/FSDP) and their own AdamW is one of the
    module's optimizers (checkpointed and sharded with the others); its steps do not count towards
    ``max_steps``, which counts RL updates.

    The module knows no method: :class:`~lightning_llm.rl.RLCallback` s in ``trainer.callbacks`` swap
    prompts (``on_rollout_start``), reshape rollouts (``on_rollout_end``) and add loss terms or drop tokens
    (``on_policy_loss``). Log-probs, entropy and (when a callback asks) the entropy-dynamics terms come from one
    fused pass that never builds full logits.

    Args:
        model: ``"tiny"``, a Hugging Face id, or a local directory (e.g. an SFT run's ``save_dir``).
        rewards: reward names (``"task"``: the DataModule's verifier; ``"env"``: the environment's reward;
            others from :mod:`lightning_llm.rewards`) or callables. Default: ``["env"]`` with an environment,
            else ``["task"]``.
        reward_weights: one weight per reward (default all 1).
        group_size: completions per prompt (G).
        max_new_tokens: generation budget per completion (per turn with an environment).
        temperature: sampling temperature of rollouts (> 0); the policy's log-probs use it too.
        top_p: nucleus sampling of rollouts.
        scale_rewards: advantage normalisation, see :func:`group_advantages`.
        epsilon: lower clip range ε.
        epsilon_high: upper clip range (``None``: same as ``epsilon``; DAPO's clip-higher uses 0.28).
        beta: KL coefficient; 0 (default) uses no reference model at all.
        entropy_coef: coefficient :math:`c_H` of an entropy bonus, ``loss − c_H · mean_t H_t`` over the kept
            tokens (LARFT uses 0.01; 0, the default, adds nothing).
        loss_aggregation: ``"token-mean"`` over all trainable tokens of the global mini-batch, or
            ``"sequence-mean"`` (mean over sequences of per-sequence token means, as in the original GRPO).
        ppo_epochs: passes over each rollout batch.
        mini_batches: updates per pass (rows are split into this many mini-batches).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay (matrices only).
        warmup_ratio: linear warm-up fraction of the total updates, then cosine decay to ``min_lr_ratio``.
        min_lr_ratio: cosine floor.
        max_grad_norm: gradient clipping norm (``0`` disables clipping; the norm is logged either way).
        env: a multi-turn :class:`~lightning_llm.envs.Environment` (e.g. ``SearchEnvironment``); ``"task"``: the
            environment the DataModule's task builds (``task.make_env(**env_kwargs)``, e.g. a search over the
            ``multihop_qa`` knowledge base the questions are about); ``None`` for
            single-turn generation.
        logprob_chunk_size: tokens per chunk of the log-prob pass (fused kernel or plain path).
        eval_max_new_tokens: generation budget of greedy validation rollouts.
        dtype: parameter dtype of the loaded model.
        trust_remote_code: allow a checkpoint's own code (off by default).
        save_dir: write the final policy there with ``save_pretrained`` at the end of ``fit``, not by a
            ``fast_dev_run`` (LoRA: merged, plus ``save_dir/adapter`` in PEFT's layout while the base weights are
            untouched).
        overwrite: let the export replace a ``save_dir`` that holds files another run wrote (or files with no
            export marker); otherwise such a ``save_dir`` stops the fit at its start.
        lora: train a LoRA adapter (:class:`~lightning_llm.lora.LoRAConfig`) instead of all weights.
        shared_prefix: encode each prompt once per group in every policy, old-policy and reference pass, its
            completions side by side after it (:mod:`lightning_llm.rl.shared_prefix`; the same log-probs,
            entropy and gradients as encoding every row whole), and prefill it once per group in generation.
            On by default; a model it cannot be exact for runs the plain pass, said once in the log.
        gradient_checkpointing: recompute each decoder layer's activations in backward (HF's non-reentrant
            checkpointing): less memory for one more forward pass per update.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        rewards: Sequence[str | Callable[..., Sequence[float]]] | None = None,
        reward_weights: Sequence[float] | None = None,
        group_size: int = 8,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        scale_rewards: Literal["group", "batch", "none"] = "group",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        entropy_coef: float = 0.0,
        loss_aggregation: Literal["token-mean", "sequence-mean"] = "token-mean",
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.0,
        min_lr_ratio: float = 1.0,
        max_grad_norm: float = 1.0,
        env: Environment | Literal["task"] | None = None,
        env_kwargs: dict[str, Any] | None = None,
        logprob_chunk_size: int | None = None,
        eval_max_new_tokens: int | None = None,
        dtype: str | None = None,
        trust_remote_code: bool = False,
        save_dir: str | None = None,
        overwrite: bool = False,
        lora: LoRAConfig | None = None,
        shared_prefix: bool = True,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        rewards = list(rewards) if rewards is not None else (["env"] if env is not None else ["task"])
        if not rewards:
            raise ValueError("give at least one reward")
        if reward_weights is not None and len(reward_weights) != len(rewards):
            raise ValueError(f"{len(reward_weights)} reward_weights for {len(rewards)} rewards")
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
        if ppo_epochs < 1 or mini_batches < 1:
            raise ValueError("ppo_epochs and mini_batches must be >= 1")
        if not 0 < epsilon < 1 or (epsilon_high is not None and epsilon_high <= 0):
            raise ValueError(f"need 0 < epsilon < 1 and epsilon_high > 0, got {epsilon}, {epsilon_high}")
        if "env" in rewards and env is None:
            raise ValueError("reward 'env' needs an environment (env=...)")
        if env_kwargs and env != "task":
            raise ValueError(
                "env_kwargs only apply to env='task' (an Environment instance carries its own settings)"
            )
        if beta < 0 or lr <= 0 or max_grad_norm < 0 or entropy_coef < 0:
            raise ValueError("beta, entropy_coef and max_grad_norm must be >= 0 and lr > 0")
        if not temperature > 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature > 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        if max_new_tokens < 1 or (eval_max_new_tokens is not None and eval_max_new_tokens < 1):
            raise ValueError(
                f"max_new_tokens and eval_max_new_tokens must be >= 1, got {max_new_tokens}, {eval_max_new_tokens}"
            )
        # an unknown (or unregistered, on reload) reward name fails here, not at the first step
        for spec in rewards:
            if isinstance(spec, str) and spec not in ("task", "env"):
                get_reward(spec)
        self.save_hyperparameters(ignore=["env", "rewards", "lora"])
        if env is None or isinstance(env, str):  # an environment object is not stored: give env= on reload
            self.hparams["env"] = env
        # Names of registered rewards (strings, or callables registered with register_reward) reload with the
        # checkpoint; an unregistered callable cannot, so load_from_checkpoint must be given `rewards=` then.
        self.hparams["rewards"] = reward_names(rewards)
        self.hparams["lora"] = dataclasses.asdict(lora) if isinstance(lora, LoRAConfig) else lora
        self.automatic_optimization = False  # several updates per rollout batch
        self.reward_specs = rewards
        self.reward_weights = list(reward_weights) if reward_weights is not None else [1.0] * len(rewards)
        self.env = env
        self._init_tokenizer()
        self._engine: RolloutEngine | None = None
        self._reward_fns: list[tuple[str, Any]] | None = None
        self.reference = ReferencePolicy()
        self._pending_reference: dict[str, Any] | None = None
        self._warned: set[str] = set()

    @property
    def engine(self) -> RolloutEngine:
        """The rollout generator: ``model.generate`` (:class:`~lightning_llm.rl.HFEngine`) unless replaced."""
        if self._engine is None:
            self._engine = HFEngine(
                self.model, self.tokenizer, share_prefix=bool(self.hparams.get("shared_prefix", True))
            )
        return self._engine

    @engine.setter
    def engine(self, engine: RolloutEngine) -> None:
        self._engine = engine

    @override
    def setup(self, stage: str) -> None:
        for cb in self._rl_callbacks():
            cb.check(self.trainer, self)
        if self.env == "task":
            task = getattr(self.trainer.datamodule, "task", None)
            make_env = getattr(task, "make_env", None)
            if not callable(make_env):
                raise ValueError(
                    f"env='task' needs a DataModule whose task builds an environment (task.make_env()); "
                    f"{type(task).__name__ if task is not None else 'no synthetic task'} does not"
                )
            self.env = make_env(**(self.hparams.env_kwargs or {}))

    @override
    def on_fit_start(self) -> None:
        super().on_fit_start()
        # A fit that will run no training step (``max_steps=0``, or a resumed run already at ``max_steps``) still
        # runs the remaining warm-up steps: ``Trainer(max_steps=0, callbacks=[SFTWarmup(...)])`` is a warm-up only.
        max_steps = self.trainer.max_steps
        if 0 <= max_steps <= self.trainer.global_step and any(
            cb.remaining(self.trainer) for cb in self._warmups()
        ):
            self._run_warmups(self._all_optimizers()[1:])

    # ----------------------------------------------------------------------------------------- rewards

    def _rewards(self) -> list[tuple[str, Any]]:
        if self._reward_fns is None:
            task = getattr(self.trainer.datamodule, "task", None) if self._trainer is not None else None
            self._reward_fns = resolve_rewards(self.reward_specs, task)
        return self._reward_fns

    def _score(self, completions: list[str], examples: list[Any], states: list[Any]) -> dict[str, Tensor]:
        out = {}
        for name, fn in self._rewards():
            if fn == "env":
                values = [
                    self.env.reward(s, e, c) for s, e, c in zip(states, examples, completions, strict=True)
                ]
            else:
                values = list(fn(completions, examples))
            if len(values) != len(completions):
                raise ValueError(
                    f"reward {name!r} returned {len(values)} scores for {len(completions)} completions"
                )
            out[name] = torch.tensor([float(v) for v in values], dtype=torch.float32, device=self.device)
        return out

    # ----------------------------------------------------------------------------------------- rollouts

    def _rl_callbacks(self) -> list[RLCallback]:
        return [cb for cb in self.trainer.callbacks if isinstance(cb, RLCallback)]

    @torch.no_grad()
    def make_rollout(self, batch: dict[str, Any], *, group_size: int, sampling: Sampling) -> Rollout:
        """Sample ``group_size`` completions per prompt of a ``PromptDataModule`` batch and score them."""
        prompt_ids = batch["input_ids"].repeat_interleave(group_size, dim=0)
        prompt_mask = batch["attention_mask"].repeat_interleave(group_size, dim=0)
        examples = [ex for ex in batch["example"] for _ in range(group_size)]
        completion, completion_mask, states = run_episodes(
            self.engine,
            self.tokenizer,
            prompt_ids,
            prompt_mask,
            examples,
            sampling=sampling,
            env=self.env,
            stop_ids=self.stop_token_ids,
        )
        ids = torch.cat([prompt_ids, completion], dim=1)
        real = completion != self.tokenizer.pad_token_id
        real |= completion_mask  # a trainable token equal to pad (pad == eos models) is still real
        attention = torch.cat([prompt_mask, real.long()], dim=1)
        loss_mask = torch.cat([torch.zeros_like(prompt_mask, dtype=torch.bool), completion_mask], dim=1)
        texts = [
            self.tokenizer.decode(row[: int(m.sum())], skip_special_tokens=True)
            for row, m in zip(completion, real, strict=True)
        ]
        num_prompts = batch["input_ids"].shape[0]
        rollout = Rollout(
            input_ids=ids,
            attention_mask=attention,
            loss_mask=loss_mask,
            prompt_length=prompt_ids.shape[1],
            group_ids=torch.arange(num_prompts, device=ids.device).repeat_interleave(group_size),
            completions=texts,
            examples=examples,
            metadata={"env_states": states},
        )
        rollout.reward_components = self._score(texts, examples, states)
        total = torch.zeros(rollout.num_rows, device=ids.device)
        for (name, _), weight in zip(self._rewards(), self.reward_weights, strict=True):
            total += weight * rollout.reward_components[name]
        rollout.rewards = total
        return rollout

    def _token_stats(
        self, model: Any, rollout: Rollout, rows: Tensor, *, dynamics: bool = False
    ) -> tuple[Tensor, ...]:
        """Log-prob and entropy (and the dynamics terms) of each loss-mask token of ``rows``, flat in row-major
        order: through :func:`~lightning_llm.rl.shared_prefix.shared_prefix_hidden` when the prompt block can
        be shared (see ``shared_prefix``), else one pass over the whole rows."""
        ids, mask, targets = rollout.input_ids[rows], rollout.attention_mask[rows], rollout.loss_mask[rows]
        kwargs = {
            "chunk_size": self.hparams.logprob_chunk_size,
            "temperature": self.hparams.temperature,
            "with_dynamics": dynamics,
        }
        cut = rollout.prompt_length
        if not self._share_prefix(model) or bool(targets[:, :cut].any()) or cut >= ids.shape[1]:
            return target_logprobs(model, ids, mask, targets, **kwargs)
        hidden = shared_prefix_hidden(model, ids, mask, cut)
        select = targets[:, cut:]
        return head_logprobs(model, hidden[select], ids[:, cut:][select], **kwargs)

    def _share_prefix(self, model: Any) -> bool:
        """Whether ``shared_prefix`` is on and exact for ``model`` (the reason it is not is logged once)."""
        if not self.hparams.get("shared_prefix", True):
            return False
        reason = shared_prefix_unsupported(model)
        if reason is not None and "shared-prefix" not in self._warned:
            self._warned.add("shared-prefix")
            rank_zero_info(f"GRPOModule: shared_prefix off, each row is encoded whole: {reason}")
        return reason is None

    def _dense(self, rollout: Rollout, flat: Tensor) -> Tensor:
        out = torch.zeros(rollout.loss_mask.shape, dtype=flat.dtype, device=flat.device)
        out[rollout.loss_mask] = flat
        return out

    # ------------------------------------------------------------------------------------------ training

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        hp = self.hparams
        callbacks = self._rl_callbacks()
        optimizer, *warmup_optimizers = self._all_optimizers()
        self._run_warmups(warmup_optimizers)
        if hp.beta > 0 and not self.reference.ready:
            self._set_reference()
        for cb in callbacks:
            batch = cb.on_rollout_start(self.trainer, self, batch) or batch
        rollout = self.make_rollout(
            batch, group_size=hp.group_size, sampling=Sampling(hp.max_new_tokens, hp.temperature, hp.top_p)
        )
        self._warn_if_no_signal(rollout)
        batch_std = None
        if hp.scale_rewards == "batch" and self.trainer.world_size > 1:
            batch_std = self.all_gather(rollout.rewards).reshape(-1).std()
        advantages = group_advantages(
            rollout.rewards, rollout.group_ids, hp.scale_rewards, batch_std=batch_std
        )
        rollout.advantages = advantages[:, None] * rollout.loss_mask
        num_updates = hp.ppo_epochs * hp.mini_batches
        all_rows = torch.arange(rollout.num_rows, device=self.device)
        with torch.no_grad():
            if num_updates > 1 or any(cb.needs_old_logprobs for cb in callbacks):
                rollout.old_logprobs = self._dense(
                    rollout, self._token_stats(self.model, rollout, all_rows)[0]
                )
            if hp.beta > 0:
                with self.reference.model(self.model) as reference:
                    rollout.ref_logprobs = self._dense(
                        rollout, self._token_stats(reference, rollout, all_rows)[0]
                    )
        for cb in callbacks:
            rollout = cb.on_rollout_end(self.trainer, self, rollout) or rollout

        scheduler = self.lr_schedulers()
        order = torch.Generator().manual_seed(int(self.global_step) * 7919 + 17)  # resumable shuffling
        stats: dict[str, list[Tensor]] = {}
        update = 0
        for _epoch in range(hp.ppo_epochs):
            perm = torch.randperm(rollout.num_rows, generator=order).to(self.device)
            for rows in perm.tensor_split(hp.mini_batches):
                lr = float(optimizer.param_groups[0]["lr"])
                loss, step_stats = self.policy_loss(rollout, rows, update, callbacks, learning_rate=lr)
                optimizer.zero_grad(set_to_none=True)
                self.manual_backward(loss)
                params = [p for p in self.model.parameters() if p.requires_grad]
                max_norm = hp.max_grad_norm if hp.max_grad_norm > 0 else float("inf")
                step_stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, max_norm).detach()
                optimizer.step()
                scheduler.step()
                for k, v in step_stats.items():
                    stats.setdefault(k, []).append(v)
                update += 1
        self._log_rollout(rollout)
        for k, v in stats.items():
            self.log(f"train/{k}", torch.stack(v).float().mean(), batch_size=rollout.num_rows)
        self.log("train/lr", float(optimizer.param_groups[0]["lr"]), batch_size=rollout.num_rows)

    def _warn_if_no_signal(self, rollout: Rollout) -> None:
        """Warn once (rank zero) when every group of a rollout batch scored its completions alike: all advantages
        are 0 and the update trains nothing (``train/frac_reward_zero_std`` logs the fraction every step)."""
        grouped = rollout.rewards.view(-1, self.hparams.group_size)
        if "no-signal" in self._warned or bool((grouped.std(dim=1) >= 1e-6).any()):
            return
        self._warned.add("no-signal")
        rank_zero_warn(
            f"GRPOModule: every group of this rollout batch got identical rewards (mean {float(rollout.rewards.mean()):.3f}), "
            "so every advantage is 0 and the policy gradient is 0; if this persists, nothing trains. A pretrained "
            "model that never writes the expected answer format does this: state the format (the DataModule's "
            "system_prompt='task'), warm up first (SFTWarmup), or add a shaping reward such as 'format'."
        )

    def _all_optimizers(self) -> list[Any]:
        optimizers = self.optimizers()
        return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]

    def _warmups(self) -> list[Any]:
        """Callbacks that train the policy before RL (``SFTWarmup``), each with one optimizer of its own."""
        return [cb for cb in self._rl_callbacks() if cb.is_warmup]

    def _run_warmups(self, optimizers: Sequence[Any]) -> None:
        """Each warm-up's remaining steps: its loss through ``manual_backward``, its own AdamW (stepped directly,
        so the steps do not count towards ``max_steps``), gradients clipped at its norm."""
        for cb, optimizer in zip(self._warmups(), optimizers, strict=True):
            params = [p for p in self.model.parameters() if p.requires_grad]
            while cb.remaining(self.trainer) > 0:
                loss = cb.warmup_loss(self.trainer, self)
                optimizer.zero_grad(set_to_none=True)
                self.manual_backward(loss)
                torch.nn.utils.clip_grad_norm_(params, cb.max_grad_norm)
                optimizer.optimizer.step()
                cb.step_done(loss.detach())

    def _fresh_model(self) -> torch.nn.Module:
        """A newly loaded, unsharded copy of the backbone (on this module's device), sized to its tokenizer."""
        hp = self.hparams
        model = load_model(hp.model, dtype=hp.dtype, trust_remote_code=hp.trust_remote_code)
        if len(self.tokenizer) > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(len(self.tokenizer), mean_resizing=True)
        return model.to(self.device)

    def _set_reference(self) -> None:
        """π_ref = the policy as RL starts (see the class docstring), or as recorded in the resumed checkpoint."""
        hp = self.hparams
        if self._pending_reference is not None:
            self.reference.restore(
                self._pending_reference,
                self.model,
                dtype=hp.dtype,
                trust_remote_code=hp.trust_remote_code,
                build=self._fresh_model,
            )
            self._pending_reference = None
            return
        warmed_up = any(cb.steps_done > 0 for cb in self._warmups())
        if lora_layers(self.model):
            if warmed_up:
                fold_adapters(self.model)  # the base becomes the warmed-up policy, the adapters restart at 0
            self.reference.use_adapters_off(self.model)
        elif warmed_up:
            self.reference.snapshot(self.model, build=self._fresh_model)
        else:
            self.reference.load(hp.model, dtype=hp.dtype, trust_remote_code=hp.trust_remote_code)

    def policy_loss(
        self,
        rollout: Rollout,
        rows: Tensor,
        update: int = 0,
        callbacks: Sequence[RLCallback] = (),
        *,
        learning_rate: float = 0.0,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one update on ``rollout`` rows ``rows`` (see the class docstring), and its statistics."""
        hp = self.hparams
        dynamics = any(cb.needs_entropy_dynamics for cb in callbacks)
        out = self._token_stats(self.model, rollout, rows, dynamics=dynamics)
        logprobs, entropy = out[0], out[1]
        mask = rollout.loss_mask[rows]
        token_rows, token_positions = mask.nonzero(as_tuple=True)
        token_rows = rows[token_rows]
        old = (
            rollout.old_logprobs[token_rows, token_positions]
            if rollout.old_logprobs is not None
            else logprobs.detach()
        )
        ref = rollout.ref_logprobs[token_rows, token_positions] if rollout.ref_logprobs is not None else None
        advantages = rollout.advantages[token_rows, token_positions]
        ratio = torch.exp(logprobs - old)
        step = PolicyLossStep(
            update_index=update,
            rows=rows,
            token_rows=token_rows,
            token_positions=token_positions,
            logprobs=logprobs,
            entropy=entropy,
            old_logprobs=old,
            ref_logprobs=ref,
            ratio=ratio,
            advantages=advantages,
            loss_mask=torch.ones_like(logprobs, dtype=torch.bool),
            s_target=out[2] if dynamics else None,
            n_term=out[3] if dynamics else None,
            learning_rate=learning_rate,
        )
        extra_terms: dict[str, Tensor] = {}
        for cb in callbacks:
            term = cb.on_policy_loss(self._trainer, self, rollout, step)
            if term is not None:
                extra_terms[cb.name] = term

        high = hp.epsilon_high if hp.epsilon_high is not None else hp.epsilon
        clipped = ratio.clamp(1 - hp.epsilon, 1 + high)
        per_token = -torch.minimum(ratio * advantages, clipped * advantages)
        kl = None
        if ref is not None:
            log_ratio = ref - logprobs
            kl = torch.exp(log_ratio) - log_ratio - 1
            per_token = per_token + hp.beta * kl
        if hp.entropy_coef > 0:
            per_token = per_token - hp.entropy_coef * entropy
        keep = step.loss_mask.to(per_token.dtype)
        policy_loss = self._aggregate(per_token * keep, keep, token_rows)
        loss = policy_loss + sum(extra_terms.values(), torch.zeros((), device=self.device))

        with torch.no_grad():
            n = keep.sum().clamp(min=1)
            low_clip = ((ratio < 1 - hp.epsilon) & (advantages < 0)).float()
            high_clip = ((ratio > 1 + high) & (advantages > 0)).float()
            stats = {
                "loss/policy": policy_loss.detach(),
                "entropy": entropy.detach().mean()
                if entropy.numel()
                else torch.zeros((), device=self.device),
                "clip_ratio/low_mean": (low_clip * keep).sum() / n,
                "clip_ratio/high_mean": (high_clip * keep).sum() / n,
                "clip_ratio/region_mean": ((low_clip + high_clip) * keep).sum() / n,
                "frac_tokens_kept": keep.mean() if keep.numel() else torch.ones((), device=self.device),
            }
            if kl is not None:
                stats["kl"] = (kl * keep).sum() / n
            for name, term in extra_terms.items():
                stats[f"{name}/loss"] = term.detach()
        return loss, stats

    def _aggregate(self, losses: Tensor, keep: Tensor, token_rows: Tensor) -> Tensor:
        """Token mean over the global mini-batch, or mean of per-sequence means (DDP-exact for token-mean)."""
        if self.hparams.loss_aggregation == "sequence-mean":
            rows, inverse = token_rows.unique(return_inverse=True)
            per_row = torch.zeros(len(rows), device=losses.device).index_add(0, inverse, losses)
            count = torch.zeros(len(rows), device=losses.device).index_add(0, inverse, keep)
            return (per_row / count.clamp(min=1)).sum() / max(1, len(rows))
        return global_mean(losses.sum(), keep.sum(), self._trainer)[0]

    def _log_rollout(self, rollout: Rollout) -> None:
        n = rollout.num_rows
        grouped = rollout.rewards.view(-1, self.hparams.group_size)
        lengths = rollout.completion_lengths().float()
        stops = torch.tensor(self.stop_token_ids, dtype=torch.long, device=rollout.input_ids.device)
        completion = rollout.input_ids[:, rollout.prompt_length :]
        real = rollout.attention_mask[:, rollout.prompt_length :].bool()
        truncated = ~(torch.isin(completion, stops) & real).any(dim=1)
        metrics = {
            "reward": rollout.rewards.mean(),
            "reward_std": rollout.rewards.std() if n > 1 else torch.zeros((), device=self.device),
            "frac_reward_zero_std": (grouped.std(dim=1) < 1e-6).float().mean(),
            "completions/mean_length": lengths.mean(),
            "completions/clipped_ratio": truncated.float().mean(),
        }
        for name, values in rollout.reward_components.items():
            metrics[f"rewards/{name}/mean"] = values.mean()
        for k, v in metrics.items():
            self.log(f"train/{k}", v, prog_bar=k == "reward", batch_size=n, sync_dist=True)

    # -------------------------------------------------------------------------------------- evaluation

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Greedy rollouts (one per prompt); logs ``val/reward`` and each component.

        Validation uses the DataModule's prompts as they are (``on_rollout_start`` is a training hook): a
        callback that swaps the generation prompt changes how training data is made, not how the policy is
        measured.
        """
        budget = self.hparams.eval_max_new_tokens or self.hparams.max_new_tokens
        rollout = self.make_rollout(batch, group_size=1, sampling=Sampling(budget, 0.0, 1.0))
        n = rollout.num_rows
        self.log("val/reward", rollout.rewards.mean(), prog_bar=True, batch_size=n, sync_dist=True)
        for name, values in rollout.reward_components.items():
            self.log(f"val/rewards/{name}/mean", values.mean(), batch_size=n, sync_dist=True)

    # ------------------------------------------------------------------------------------ optimisation

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = adamw(self.model, lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.999))
        # Manual optimisation: Lightning's max_steps counts optimizer updates (ppo_epochs × mini_batches per
        # rollout batch), while estimated_stepping_batches counts batches when training is bounded by epochs.
        if self.trainer.max_steps > 0:
            total = self.trainer.max_steps
        else:
            total = int(self.trainer.estimated_stepping_batches) * hp.ppo_epochs * hp.mini_batches
        total = max(1, total)
        warmup = int(hp.warmup_ratio * total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, total, warmup, hp.min_lr_ratio)
        )
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        warmups = [torch.optim.AdamW(trainable, lr=cb.lr, weight_decay=0.0) for cb in self._warmups()]
        return [optimizer, *warmups], [scheduler]

    # --------------------------------------------------------------------------- checkpoints, artefacts

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        # Sampling draws from the global RNGs: keep them, so a resumed run samples the same rollouts.
        checkpoint["grpo_rng_state"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            checkpoint["grpo_cuda_rng_state"] = torch.cuda.get_rng_state_all()
        if self.reference.ready:
            checkpoint["grpo_reference"] = self.reference.state()  # weights only for a post-warm-up snapshot

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self._pending_rng = (checkpoint.get("grpo_rng_state"), checkpoint.get("grpo_cuda_rng_state"))
        self._pending_reference = checkpoint.get("grpo_reference")

    @override
    def on_train_start(self) -> None:
        cpu, cuda = getattr(self, "_pending_rng", None) or (None, None)
        if cpu is not None:
            torch.set_rng_state(cpu)
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
        self._pending_rng = None
