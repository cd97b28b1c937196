"""The two RL hook points every RL method plugs into, so that ``GRPOModule`` stays method-agnostic.

A method (entropy clipping, LLDS, hindsight tasks, recontextualization...) is an :class:`RLCallback`, not a
branch in the module. The module calls, for every callback in ``trainer.callbacks`` order:

- :meth:`RLCallback.on_rollout_start` once per training batch, before generation: it may return a replacement
  prompt batch (same keys as a :class:`~lightning_llm.datamodules.PromptDataModule` batch), e.g. the
  *generation* prompt :math:`x_{gen}` of recontextualization. Rollouts are generated and scored under it,
  and the old and reference log-probs and advantages are computed on it. Each callback sees the batch the
  previous one returned. Greedy validation does not call it: validation measures the policy under the
  DataModule's own prompts, the ones it will be deployed (and evaluated) with.
- :meth:`RLCallback.on_rollout_end` once per rollout batch, after rewards and advantages are computed and before
  any update: reshape rewards/advantages, rewrite the training prompt, add auxiliary samples. It edits the
  rollout in place or returns a replacement :class:`~lightning_llm.rl.Rollout` (the next callback and the
  updates then use that one). To train on another prompt with the same completion tokens (the *training*
  prompt :math:`x_{train}`), return ``rollout.with_prompt(ids, mask)``: every ``[N, T]`` tensor is re-aligned
  to the new prompt width and log-probs and advantages are kept, not recomputed.
- :meth:`RLCallback.on_policy_loss` once per optimisation step (mini-batch) with a :class:`PolicyLossStep`
  holding the per-token quantities of that step: return an extra loss term (logged under the callback's
  ``name``) and/or edit ``step.loss_mask`` in place to drop tokens from the policy-gradient loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from torch import Tensor

if TYPE_CHECKING:
    from lightning_llm.rl import Rollout

__all__ = ["PolicyLossStep", "RLCallback"]


@dataclass
class PolicyLossStep:
    """Per-token view of one optimisation step, flattened over the step's trainable tokens.

    Every tensor of length ``n`` lists the step's trainable tokens (``rollout.loss_mask`` true) in row-major
    order; ``token_rows``/``token_positions`` say where each sits in the rollout, so callbacks can group
    tokens into responses or actions (contiguous runs of trainable tokens in one row).

    Attributes:
        update_index: 0-based index of this update within the rollout batch (``epoch * mini_batches + mb``);
            0 means the policy still equals the one that generated the rollout.
        rows: rollout row indices of this mini-batch.
        token_rows: ``[n]`` rollout row of each token.
        token_positions: ``[n]`` column of each token in ``rollout.input_ids``.
        logprobs: ``[n]`` log π_θ(y_t) under the current policy (differentiable).
        entropy: ``[n]`` full-vocabulary entropy of π_θ(· | y_<t) (differentiable).
        old_logprobs: ``[n]`` log π_old(y_t), from the policy that generated the rollout.
        ref_logprobs: ``[n]`` log π_ref(y_t), or ``None`` when no reference model is used (``beta = 0``).
        ratio: ``[n]`` exp(logprobs − old_logprobs) (differentiable).
        advantages: ``[n]`` token-level advantages.
        loss_mask: ``[n]`` bool; callbacks may set entries to ``False`` to drop those tokens from the
            policy-gradient term (they stay in the denominator of nothing: the loss re-normalises).
        s_target: ``[n]`` S_k = p_k (H + log p_k) of the sampled token, or ``None`` unless some callback
            sets ``needs_entropy_dynamics``.
        n_term: ``[n]`` N = Σ_i p_i² (log p_i + H), same condition.
        learning_rate: the optimiser's current learning rate (first parameter group).
    """

    update_index: int
    rows: Tensor
    token_rows: Tensor
    token_positions: Tensor
    logprobs: Tensor
    entropy: Tensor
    old_logprobs: Tensor
    ref_logprobs: Tensor | None
    ratio: Tensor
    advantages: Tensor
    loss_mask: Tensor
    s_target: Tensor | None = None
    n_term: Tensor | None = None
    learning_rate: float = 0.0


class RLCallback(Callback):
    """Base class of RL method callbacks (see the module docstring for when each hook runs).

    Class attributes:
        is_warmup: see below.
        needs_entropy_dynamics: set to ``True`` to have ``GRPOModule`` compute ``s_target``/``n_term`` in the
            same fused pass as the log-probs.
        needs_old_logprobs: set to ``True`` if ``on_rollout_end`` needs ``rollout.old_logprobs``. With a single
            update per rollout batch the module otherwise skips that forward pass (π_old = π_θ then).
    """

    needs_entropy_dynamics: bool = False
    needs_old_logprobs: bool = False
    #: Whether this callback trains the policy before RL (``SFTWarmup``): the module then gives it an optimizer
    #: and calls its ``remaining`` / ``warmup_loss`` / ``step_done`` at the first training step.
    is_warmup: bool = False

    def check(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Called in the module's ``setup``: raise if this callback can never act with this module's settings."""

    @property
    def name(self) -> str:
        """Name under which returned loss terms and metrics are logged."""
        return type(self).__name__

    def on_rollout_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Called once per training batch, before generation; return a replacement prompt batch or ``None``."""

    def on_rollout_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, rollout: Rollout
    ) -> Rollout | None:
        """Called once per rollout batch, after rewards and advantages, before the first update.

        Edit ``rollout`` in place and return ``None``, or return a replacement rollout.
        """

    def on_policy_loss(
        self, trainer: L.Trainer, pl_module: L.LightningModule, rollout: Rollout, step: PolicyLossStep
    ) -> Tensor | None:
        """Called once per update; return an extra scalar loss term or ``None`` (may edit ``step.loss_mask``)."""
        return None
