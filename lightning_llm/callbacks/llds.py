r"""LLDS: likelihood-preserving regularizer for tool-integrated GRPO (arXiv 2512.04220).

GRPO on multi-turn, tool-using rollouts suffers *lazy likelihood displacement*: the likelihood of even the
correct responses drifts down, low-confidence responses give large gradients, and training spirals into
collapse. LLDS penalises a likelihood drop, but only where it happened: on non-negative-advantage responses,
and within them only on the actions (model turns) whose likelihood fell. With
:math:`\Delta_t = \log\pi_{old}(y_t) - \log\pi_\theta(y_t)`,

.. math::
    \mathcal{L}_{LLDS} = \lambda \cdot \frac{1}{n} \sum_t g_t \max(0, \Delta_t), \qquad
    g_t = \mathbb{1}[A_t \ge 0]\ \mathbb{1}\Big[\sum_{u \in a(t)} \Delta_u > 0\Big],

where :math:`a(t)` is the action containing token :math:`t` (``gate="action"``) or its whole response
(``gate="response"``), and :math:`\lambda = 0.2`. An action is a contiguous run of trainable tokens in one
row: tool/observation tokens are never trainable, so they separate the model's turns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import lightning as L
import torch
from torch import Tensor
from typing_extensions import override

from lightning_llm.lm import global_mean
from lightning_llm.rl import PolicyLossStep, RLCallback

if TYPE_CHECKING:
    from lightning_llm.rl import Rollout

__all__ = ["LLDSRegularizer", "llds_gate", "llds_loss", "segment_index"]


def segment_index(token_rows: Tensor, token_positions: Tensor | None = None) -> Tensor:
    """``[n]`` 0-based index of each token's run in a row-major flat token list.

    A new run starts where the row changes; with ``token_positions``, also where the position is not the
    previous one + 1 (a masked tool/observation span lies between). Runs are then the *actions*; without
    positions they are the *responses*.
    """
    start = torch.ones_like(token_rows, dtype=torch.bool)
    start[1:] = token_rows[1:] != token_rows[:-1]
    if token_positions is not None:
        start[1:] |= token_positions[1:] != token_positions[:-1] + 1
    return start.long().cumsum(0) - 1


def llds_gate(
    delta: Tensor,
    advantages: Tensor,
    token_rows: Tensor,
    token_positions: Tensor,
    gate: Literal["action", "response"] = "action",
) -> Tensor:
    r"""``[n]`` bool :math:`g_t`: the token's advantage is :math:`\ge 0` and its action's (or response's) summed Δ > 0.

    The advantage condition is per token; GRPO's advantages are constant over a response, so it is the paper's
    per-response condition.
    """
    segments = segment_index(token_rows, token_positions if gate == "action" else None)
    sums = torch.zeros(delta.numel(), dtype=delta.dtype, device=delta.device)
    sums = sums.index_add(0, segments, delta.detach())
    return (advantages >= 0) & (sums[segments] > 0)


def llds_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    token_rows: Tensor,
    token_positions: Tensor,
    *,
    coef: float = 0.2,
    gate: Literal["action", "response"] = "action",
    trainer: Any | None = None,
) -> tuple[Tensor, Tensor]:
    r""":math:`\lambda \cdot \mathrm{mean}_t[g_t \max(0, \Delta_t)]` and the gate :math:`g_t`.

    The mean is over *all* the given tokens (gated in or not, any advantage): the simplest reading of the
    paper's token mean, and one that keeps the term's scale independent of how often it fires. With
    ``trainer`` under DDP it is the mean over all processes' tokens (the term is scaled so that DDP's gradient
    averaging yields exactly that). The gate is computed without gradient; the gradient reaches only the
    log-probs of gated tokens whose own likelihood fell (:math:`\Delta_t > 0`). Where
    ``logprobs == old_logprobs`` every Δ is 0 and so is the loss, exactly.

    Returns:
        ``(loss, gate)``: the scalar term to add to the loss, and the ``[n]`` bool gate.
    """
    delta = old_logprobs.detach() - logprobs
    gated = llds_gate(delta, advantages, token_rows, token_positions, gate)
    total = (delta.clamp(min=0) * gated).sum()
    count = torch.tensor(float(delta.numel()), device=delta.device)
    return coef * global_mean(total, count, trainer)[0], gated


class LLDSRegularizer(RLCallback):
    r"""Likelihood-preserving regularizer against lazy likelihood displacement (arXiv 2512.04220).

    Adds :math:`\mathcal{L}_{LLDS}` (module docstring, :func:`llds_loss`) to every update's loss; the module
    logs it as ``train/LLDS/loss``. :math:`\pi_{old}` is the rollout policy, so the term is exactly zero at
    the first update of each rollout batch and only acts from the second on: use several mini-batches or PPO
    epochs (with a single update GRPO does not even compute :math:`\pi_{old}` separately and Δ ≡ 0). It looks
    at all the step's tokens, whether or not an earlier callback dropped them from the policy-gradient loss.

    Also logs, as means over all the rollout batch's updates so far (Lightning keeps the last value of a step):
    ``train/LLDS/fire_rate``, the fraction of tokens gated in, and ``train/LLDS/loglik_pos``, the token-mean
    :math:`\log\pi_\theta(y_t)` over responses with :math:`A > 0` (the "correct responses" whose likelihood
    LLD erodes; per token so that it is comparable as response lengths change).

    Args:
        coef: :math:`\lambda` (0.2 in the paper).
        gate: ``"action"`` (the paper's method: regularise the actions whose likelihood fell) or ``"response"``
            (the variant gating whole responses).
    """

    def __init__(self, coef: float = 0.2, gate: Literal["action", "response"] = "action") -> None:
        if coef < 0:
            raise ValueError(f"coef must be >= 0, got {coef}")
        if gate not in ("action", "response"):
            raise ValueError(f"gate must be 'action' or 'response', got {gate!r}")
        self.coef = coef
        self.gate = gate
        self._sums: Tensor | None = (
            None  # (fired, tokens, loglik of A>0 tokens, A>0 tokens) this rollout batch
        )

    @property
    @override
    def name(self) -> str:
        return "LLDS"

    @override
    def check(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        hp = pl_module.hparams
        if self.coef > 0 and hp.get("ppo_epochs", 1) * hp.get("mini_batches", 1) == 1:
            raise ValueError(
                "LLDSRegularizer compares the policy with the rollout policy, which are equal at the first update "
                "of every rollout batch: with ppo_epochs=1 and mini_batches=1 it adds exactly 0. Use several "
                "updates per batch (e.g. mini_batches=4 or ppo_epochs=2)."
            )

    @override
    def on_policy_loss(
        self, trainer: L.Trainer, pl_module: L.LightningModule, rollout: Rollout, step: PolicyLossStep
    ) -> Tensor | None:
        loss, gated = llds_loss(
            step.logprobs,
            step.old_logprobs,
            step.advantages,
            step.token_rows,
            step.token_positions,
            coef=self.coef,
            gate=self.gate,
            trainer=trainer,
        )
        positive = step.advantages > 0
        sums = torch.stack(
            [
                gated.sum().float(),
                torch.tensor(float(gated.numel()), device=gated.device),
                step.logprobs.detach().float()[positive].sum(),
                positive.sum().float(),
            ]
        )
        self._sums = sums if step.update_index == 0 or self._sums is None else self._sums + sums
        pl_module.log(
            f"train/{self.name}/fire_rate",
            self._sums[0] / self._sums[1].clamp(min=1),
            batch_size=rollout.num_rows,
        )
        if self._sums[3] > 0:  # no positive-advantage token yet: nothing to report (0 would read as p = 1)
            pl_module.log(
                f"train/{self.name}/loglik_pos", self._sums[2] / self._sums[3], batch_size=rollout.num_rows
            )
        return loss
