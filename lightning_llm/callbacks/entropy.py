r"""Entropy dynamics of RL fine-tuning and entropy-discriminator clipping (arXiv 2602.03392, Trinity-RFT).

With :math:`p = \mathrm{softmax}(z)` and :math:`H = -\sum_i p_i \log p_i`, raising logit :math:`k` by
:math:`\varepsilon` changes :math:`H` by :math:`-\varepsilon S_k`, and a policy-gradient step on the sampled
token :math:`k` with advantage :math:`A` and step size :math:`\eta` changes it, to first order, by

.. math::
    \Delta H \approx -\eta A\,(S_k - N), \qquad S_k = p_k (H + \log p_k), \qquad
    N = \sum_i p_i^2 (\log p_i + H) = \mathbb{E}_{i \sim p}[S_i].

So a token whose :math:`S_k` is far below the rest, trained with :math:`A < 0`, is one whose update collapses
entropy. The paper's two *entropy-discriminator* clippings drop exactly those tokens from the policy-gradient
loss (:func:`clip_batch_mask`, :func:`clip_vocab_mask`, both wrapped by :class:`EntropyDiscriminatorClipping`);
:class:`EntropyDynamicsMonitor` logs the predicted change against the measured one. ``S_k`` and ``N`` come from
the fused log-prob pass (``PolicyLossStep.s_target``/``n_term``; spec:
:func:`~lightning_llm.kernels.fused_linear_logprobs.entropy_dynamics_reference`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_llm.lm import global_mean
from lightning_llm.rl import PolicyLossStep, RLCallback

if TYPE_CHECKING:
    from lightning_llm.rl import Rollout

__all__ = [
    "EntropyDiscriminatorClipping",
    "EntropyDynamicsMonitor",
    "clip_batch_mask",
    "clip_vocab_mask",
]

_MIN_STD = 1e-12  # below this the statistic carries no signal: clip nothing (as Trinity-RFT's Clip_B does)


def _mean_std(values: Tensor, trainer: Any | None) -> tuple[Tensor, Tensor]:
    """Mean and population std (denominator n, as Trinity-RFT) of ``values``, over all processes with ``trainer``."""
    v = values.detach().float()
    count = torch.tensor(float(v.numel()), device=v.device)
    mean = global_mean(v.sum(), count, trainer)[1]
    return mean, global_mean(((v - mean) ** 2).sum(), count, trainer)[1].sqrt()


def clip_batch_mask(s: Tensor, advantages: Tensor, mu: float = 2.5, *, trainer: Any | None = None) -> Tensor:
    r"""Clip_B: the tokens to drop, ``A < 0`` and :math:`S - \mathbb{E}[S] < -\mu\,\sigma_S`.

    :math:`\mathbb{E}[S]` and :math:`\sigma_S` (population std) are taken over all the given response tokens
    (whatever their advantage), over every process when ``trainer`` runs DDP. When :math:`\sigma_S` is ~0
    nothing is dropped. Positive- and zero-advantage tokens are always kept: the clipping is one-sided.

    Args:
        s: ``[n]`` :math:`S_k` of each sampled token.
        advantages: ``[n]`` token advantages.
        mu: threshold in standard deviations (2.5 in the paper).
        trainer: a Trainer, for statistics over all processes under DDP.

    Returns:
        ``[n]`` bool, true for the tokens to drop.
    """
    if s.numel() == 0:
        return torch.zeros_like(s, dtype=torch.bool)
    mean, std = _mean_std(s, trainer)
    low = (s.detach().float() - mean) < -mu * std
    return (advantages < 0) & low & (std > _MIN_STD)


def clip_vocab_mask(
    s: Tensor,
    n: Tensor,
    advantages: Tensor,
    mu: float = 8.5,
    max_fraction: float = 1e-4,
    *,
    trainer: Any | None = None,
) -> Tensor:
    r"""Clip_V: the tokens to drop, ``A < 0`` and :math:`x = N - S > \mu\,\mathrm{std}(x)`, capped.

    :math:`x` is the predicted entropy drop per unit :math:`-\eta A` and has zero mean under sampling
    (:math:`\mathbb{E}_{k\sim p}[S_k] = N`), which is why the threshold is on :math:`x` itself, not on
    :math:`x - \bar x`; :math:`\mathrm{std}(x)` is the population std over all given tokens (all processes
    with ``trainer``). At most :math:`k = \lfloor \text{max\_fraction} \cdot n \rfloor` tokens are dropped, the
    ``k`` candidates with the largest :math:`x`. When ``k = 0`` (fewer than ``1 / max_fraction`` tokens:
    10 000 at the paper's 1e-4) **nothing is dropped** — "at most a fraction" read literally, so Clip_V is a
    no-op on small batches. Under DDP the cap applies to each process's own tokens (so the global fraction
    stays within ``max_fraction``), not as one global top-k.

    Args:
        s: ``[n]`` :math:`S_k` of each sampled token.
        n: ``[n]`` :math:`N` at each position.
        advantages: ``[n]`` token advantages.
        mu: threshold in standard deviations of ``x`` (8.5 in the paper).
        max_fraction: cap on the fraction of tokens dropped (1e-4 in the paper).
        trainer: a Trainer, for the std over all processes under DDP.

    Returns:
        ``[n]`` bool, true for the tokens to drop.
    """
    drop = torch.zeros_like(s, dtype=torch.bool)
    k = math.floor(max_fraction * s.numel())
    if k == 0:
        return drop
    x = (n.detach() - s.detach()).float()
    _, std = _mean_std(x, trainer)
    candidates = (advantages < 0) & (x > mu * std) & (std > _MIN_STD)
    top = torch.where(candidates, x, -math.inf).topk(k).indices
    drop[top] = candidates[top]
    return drop


class EntropyDiscriminatorClipping(RLCallback):
    r"""Drop entropy-collapsing negative-advantage tokens from the policy-gradient loss (arXiv 2602.03392).

    From the first-order change :math:`\Delta H \approx -\eta A (S_k - N)` (module docstring), a token with
    :math:`A < 0` lowers entropy when :math:`S_k < N`, and the more so the smaller :math:`S_k`. Two detectors:

    - ``"batch"`` (Clip_B, :func:`clip_batch_mask`): drop :math:`A < 0` tokens with
      :math:`S - \mathbb{E}_B[S] < -\mu\,\sigma_B(S)`, :math:`\mu = 2.5`.
    - ``"vocab"`` (Clip_V, :func:`clip_vocab_mask`): drop :math:`A < 0` tokens with
      :math:`N - S > \mu\,\mathrm{std}(N - S)`, :math:`\mu = 8.5`, at most a fraction 1e-4 of the tokens.

    The statistics are over the tokens of each update (a mini-batch; the whole rollout batch when
    ``mini_batches = 1``) under the current policy, so a token's fate may change between the updates of one
    rollout batch. (Trinity-RFT computes Clip_B once per rollout batch from the rollout-time log-probs; the two
    coincide for a single update.) Dropped tokens are removed from ``step.loss_mask``; the module re-normalises
    the loss over the kept ones. Logs ``train/Clip_B/clipped_frac`` (or ``Clip_V``): the fraction of the rollout
    batch's tokens dropped so far, over all its updates (Lightning keeps the last value logged in a step).

    Args:
        mode: ``"batch"`` (Clip_B) or ``"vocab"`` (Clip_V).
        mu: threshold in standard deviations; ``None`` for the paper's (2.5 batch, 8.5 vocab).
        max_fraction: Clip_V's cap on the fraction of tokens dropped (ignored by Clip_B).
    """

    needs_entropy_dynamics = True

    def __init__(
        self, mode: Literal["batch", "vocab"] = "batch", mu: float | None = None, max_fraction: float = 1e-4
    ) -> None:
        if mode not in ("batch", "vocab"):
            raise ValueError(f"mode must be 'batch' or 'vocab', got {mode!r}")
        mu = (2.5 if mode == "batch" else 8.5) if mu is None else mu
        if mu <= 0:
            raise ValueError(f"mu must be > 0, got {mu}")
        if not 0 <= max_fraction <= 1:
            raise ValueError(f"max_fraction must be in [0, 1], got {max_fraction}")
        self.mode = mode
        self.mu = mu
        self.max_fraction = max_fraction
        self._warned = False
        self._counts: Tensor | None = None  # (dropped, seen) over the current rollout batch's updates

    @property
    @override
    def name(self) -> str:
        return "Clip_B" if self.mode == "batch" else "Clip_V"

    @override
    def on_policy_loss(
        self, trainer: L.Trainer, pl_module: L.LightningModule, rollout: Rollout, step: PolicyLossStep
    ) -> Tensor | None:
        if step.s_target is None or step.n_term is None:
            raise RuntimeError(
                f"{self.name} needs step.s_target and step.n_term: the module must compute them when a "
                "callback sets needs_entropy_dynamics"
            )
        if self.mode == "batch":
            drop = clip_batch_mask(step.s_target, step.advantages, self.mu, trainer=trainer)
        else:
            drop = clip_vocab_mask(
                step.s_target, step.n_term, step.advantages, self.mu, self.max_fraction, trainer=trainer
            )
            tokens = step.s_target.numel() * (trainer.world_size if trainer is not None else 1)
            if self.max_fraction > 0 and tokens < 1 / self.max_fraction and not self._warned:
                self._warned = True
                rank_zero_warn(
                    f"Clip_V drops at most max_fraction={self.max_fraction:g} of the tokens of an update; this update "
                    f"has {tokens}, fewer than 1 / max_fraction = {1 / self.max_fraction:.0f}, so it drops nothing. "
                    "Clip_V acts from that many tokens per update on (the paper's batches); use Clip_B "
                    "(mode='batch') for small batches, or raise max_fraction."
                )
        step.loss_mask[drop] = False
        counts = torch.stack([drop.sum(), torch.tensor(drop.numel(), device=drop.device)]).float()
        self._counts = counts if step.update_index == 0 or self._counts is None else self._counts + counts
        pl_module.log(
            f"train/{self.name}/clipped_frac",
            self._counts[0] / self._counts[1].clamp(min=1),
            batch_size=rollout.num_rows,
        )
        return None


class EntropyDynamicsMonitor(RLCallback):
    r"""Log the first-order predicted entropy change of each token's update against the measured one.

    **Prediction.** The paper's analysis treats each token's logits as moved by its own policy-gradient step,
    :math:`\Delta z_t = \eta A_t \nabla_z \log p_{y_t}`, giving :math:`\Delta H_t \approx -\eta A_t (S_t - N_t)`
    with :math:`\eta` = ``step.learning_rate``. Tokens already dropped from ``step.loss_mask`` (by callbacks
    *before* this one: put it last) get no step, so their prediction is 0. The logged number is the mean over
    tokens of this per-token prediction, i.e. the predicted change of the tokens' *mean* entropy. The per-token
    step is :math:`\eta A_t`, not :math:`\eta A_t / n` as the token-mean loss's raw gradient would give: under
    Adam the update size is set by :math:`\eta`, not by the loss scale. This is the paper's analysis, SGD on
    free logits; Adam's per-parameter preconditioning and the coupling of tokens through shared weights are
    outside it, so read the number as a proxy for the direction and relative size of the change (across
    steps, or with vs without clipping), not as a forecast of its magnitude. The ratio weighting and PPO
    clipping of later updates are ignored (both exact at the first update, where the ratio is 1).

    **Measurement.** Entropy is only observed in a forward pass, so a token's change is measured when the same
    token (row, position) is seen again in a later update of the same rollout batch: measured
    :math:`H_t^{now} - H_t^{prev}`, predicted the value stored at its previous visit. With ``mini_batches = 1``
    the two visits bracket exactly that one update; with several mini-batches the measured change also
    contains the other mini-batches' updates (cross-token interference the prediction leaves out).
    Tokens are revisited only from the second PPO epoch on, so this needs ``ppo_epochs >= 2`` (checked at
    setup when the module has that hyper-parameter); each rollout batch starts afresh at update 0.

    Logs ``train/entropy_delta_predicted`` and ``train/entropy_delta_measured``: means over all the tokens
    re-measured so far in the rollout batch (Lightning keeps the last value logged in a step), so the pair
    always covers the same tokens. ``state_dict`` holds the current rollout batch's per-token records; GRPO
    checkpoints fall between rollout batches, so it matters only to a loop that checkpoints mid-batch.
    """

    needs_entropy_dynamics = True

    def __init__(self) -> None:
        self._entropy: Tensor | None = None  # [N, T] entropy at the token's last visit (NaN: not seen yet)
        self._predicted: Tensor | None = None  # [N, T] predicted change from that visit's update
        self._sums: Tensor | None = None  # (predicted, measured, tokens) over the rollout batch so far

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        epochs = getattr(getattr(pl_module, "hparams", None), "ppo_epochs", None)
        if stage == "fit" and epochs is not None and epochs < 2:
            raise ValueError(
                f"EntropyDynamicsMonitor measures a token's entropy when it is seen again in the next PPO "
                f"epoch, so it needs ppo_epochs >= 2 (got {epochs})"
            )

    @override
    def on_policy_loss(
        self, trainer: L.Trainer, pl_module: L.LightningModule, rollout: Rollout, step: PolicyLossStep
    ) -> Tensor | None:
        if step.s_target is None or step.n_term is None:
            raise RuntimeError(
                "EntropyDynamicsMonitor needs step.s_target and step.n_term: the module must compute them "
                "when a callback sets needs_entropy_dynamics"
            )
        where = (step.token_rows, step.token_positions)
        entropy = step.entropy.detach().float()
        if step.update_index == 0 or self._entropy is None:
            self._entropy = torch.full(rollout.loss_mask.shape, math.nan, device=entropy.device)
            self._predicted = torch.zeros(rollout.loss_mask.shape, device=entropy.device)
            self._sums = torch.zeros(3, device=entropy.device)
        previous = self._entropy[where]
        seen = ~previous.isnan()
        self._sums = self._sums + torch.stack(
            [
                self._predicted[where][seen].sum(),
                (entropy - previous)[seen].sum(),
                seen.sum().float(),
            ]
        )
        keep = step.loss_mask.float()
        advantages = step.advantages.detach().float()
        gap = (step.s_target - step.n_term).detach().float()
        self._entropy[where] = entropy
        self._predicted[where] = -step.learning_rate * keep * advantages * gap
        if self._sums[2] > 0:
            count = self._sums[2]
            pl_module.log("train/entropy_delta_predicted", self._sums[0] / count, batch_size=rollout.num_rows)
            pl_module.log("train/entropy_delta_measured", self._sums[1] / count, batch_size=rollout.num_rows)
        return None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"entropy": self._entropy, "predicted": self._predicted, "sums": self._sums}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._entropy = state_dict["entropy"]
        self._predicted = state_dict["predicted"]
        self._sums = state_dict["sums"]
