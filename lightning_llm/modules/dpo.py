r"""Direct Preference Optimization (Rafailov et al., 2023) on preference pairs of any causal LM."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from lightning_llm.lm import global_mean, labels_to_mask, target_logprobs
from lightning_llm.lora import LoRAConfig, lora_layers
from lightning_llm.modules.causal_lm import CausalLMModule
from lightning_llm.modules.reference import ReferencePolicy

__all__ = ["DPOModule", "dpo_loss", "sequence_logprobs"]

_PAIR_KEYS = tuple(
    f"{side}_{key}" for side in ("chosen", "rejected") for key in ("input_ids", "attention_mask", "labels")
)


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Per-pair DPO loss and implicit rewards from sequence log-probs (all ``[B]``).

    .. math::

        z = \beta\Big[\big(\log\pi_\theta(y_w|x) - \log\pi_{ref}(y_w|x)\big)
                    - \big(\log\pi_\theta(y_l|x) - \log\pi_{ref}(y_l|x)\big)\Big],\qquad
        \mathcal{L} = -(1-\varepsilon)\log\sigma(z) - \varepsilon\log\sigma(-z),

    :math:`\varepsilon` = ``label_smoothing`` (0: the standard loss; > 0: conservative DPO, preferences flipped
    with probability :math:`\varepsilon`). Returns ``(loss [B], chosen_reward [B], rejected_reward [B])`` with
    the implicit rewards :math:`\beta(\log\pi_\theta - \log\pi_{ref})`, detached.
    """
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    z = chosen_reward - rejected_reward
    loss = -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return loss, chosen_reward.detach(), rejected_reward.detach()


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    labels: Tensor,
    *,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    r"""``(log π(y|x), |y|)`` per row ``[B]``: :math:`\sum_{t \in y}\log\pi(y_t|y_{<t}, x)` over labelled tokens,
    and their count.

    Token log-probs come from the fused kernel (no ``[tokens × vocab]`` logits).
    """
    mask = labels_to_mask(input_ids, labels)
    logprobs, _ = target_logprobs(model, input_ids, attention_mask, mask, chunk_size=chunk_size)
    rows = mask[:, 1:].nonzero(as_tuple=True)[0]
    total = torch.zeros(input_ids.shape[0], dtype=logprobs.dtype, device=logprobs.device)
    return total.index_add(0, rows, logprobs), mask[:, 1:].sum(dim=1).to(logprobs.dtype)


class DPOModule(CausalLMModule):
    r"""DPO: fit a policy to preferences :math:`y_w \succ y_l` without a reward model.

    The loss is :func:`dpo_loss`, averaged over every pair of the global batch (all-reduced under DDP). The
    reference :math:`\pi_{ref}` is the initial policy — with LoRA the policy's base with its adapters switched off
    (no second copy, as PEFT and TRL do), otherwise a frozen copy loaded from ``model`` — or the backbone
    ``reference_model`` names. It is never written into checkpoints (see
    :class:`~lightning_llm.modules.reference.ReferencePolicy`). Both sides of a pair go through one forward
    (stacked), the reference's through one more under ``no_grad``; sequence log-probs use the fused log-prob
    kernel, so no logits tensor is built.

    With ``sft_weight`` :math:`\alpha > 0` the loss adds :math:`\alpha` times the NLL of the chosen responses,
    averaged over all chosen tokens of the global batch (Pang et al. 2024's RPO term, with TRL's normalisation:
    ``DPOTrainer(loss_type=["sigmoid", "sft"], loss_weights=[1, alpha])``): small models trained by DPO alone tend
    to lower the likelihood of *both* responses until their text degrades, and the NLL term anchors the chosen
    one.

    Logs ``{stage}/loss``, ``{stage}/dpo_loss``, ``{stage}/sft_loss``, ``{stage}/reward_chosen``, ``{stage}/reward_rejected``, ``{stage}/margin`` (their
    difference) and ``{stage}/pair_accuracy`` (share of pairs with margin > 0). Batches come from
    :class:`~lightning_llm.datamodules.PreferenceDataModule` (``chosen_*`` / ``rejected_*`` keys);
    ``predict`` is :class:`CausalLMModule`'s (greedy completions of a ``PromptDataModule``).

    Args:
        model: Policy backbone (``"tiny"``, a Hugging Face id or a local directory, e.g. an SFT run's
            ``save_dir``).
        beta: :math:`\beta`, the strength of the implicit KL constraint to the reference (paper: 0.1–0.5).
        label_smoothing: :math:`\varepsilon` of conservative DPO; 0 is the standard loss.
        sft_weight: :math:`\alpha`, weight of the chosen responses' per-token NLL; 0 is plain DPO.
        reference_model: Backbone of :math:`\pi_{ref}`; ``None``: the initial policy.
        lr: Peak AdamW learning rate (DPO uses small ones: 5e-7–5e-6 for billion-parameter models).
        lora: Train a LoRA adapter; the reference is then the base with adapters off (unless ``reference_model``).
        **kwargs: The other arguments of :class:`~lightning_llm.modules.CausalLMModule` (schedule, dtype,
            ``save_dir``...).
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        sft_weight: float = 0.0,
        reference_model: str | None = None,
        lr: float = 1e-4,
        lora: LoRAConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if beta <= 0:
            raise ValueError(f"beta must be positive, got {beta}")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
        if sft_weight < 0:
            raise ValueError(f"sft_weight must be >= 0, got {sft_weight}")
        super().__init__(model, lr=lr, lora=lora, **kwargs)
        self.reference = ReferencePolicy()

    def _reference(self) -> ReferencePolicy:
        """The reference, set up on first use (after the policy is built, on its device)."""
        if not self.reference.ready:
            hp = self.hparams
            if hp.reference_model is None and lora_layers(self.model) and not _base_modified(self.model):
                self.reference.use_adapters_off(self.model)
            else:
                self.reference.load(
                    hp.reference_model or hp.model, dtype=hp.dtype, trust_remote_code=hp.trust_remote_code
                )
        return self.reference

    def pair_logprobs(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_lengths)``, each ``[B]``."""
        missing = [k for k in _PAIR_KEYS if k not in batch]
        if missing:
            raise ValueError(
                f"DPOModule needs preference batches (a PreferenceDataModule); the batch lacks {missing} "
                f"(its keys: {sorted(batch)})"
            )
        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        attention = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
        labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
        chunk = self.hparams.logprob_chunk_size
        policy, lengths = sequence_logprobs(self.model, ids, attention, labels, chunk_size=chunk)
        with torch.no_grad(), self._reference().model(self.model) as reference:
            ref, _ = sequence_logprobs(reference, ids, attention, labels, chunk_size=chunk)
        n = batch["chosen_input_ids"].shape[0]
        return policy[:n], policy[n:], ref[:n], ref[n:], lengths[:n]

    def pair_losses(self, batch: dict[str, Any]) -> dict[str, Tensor]:
        """Per-pair ``dpo_loss`` (with grad), ``reward_chosen`` and ``reward_rejected`` (detached), each ``[B]``; the
        chosen responses' summed NLL ``sft_nll`` (with grad) and token count ``sft_tokens``, scalars."""
        hp = self.hparams
        *logprobs, lengths = self.pair_logprobs(batch)
        pair_loss, chosen, rejected = dpo_loss(*logprobs, beta=hp.beta, label_smoothing=hp.label_smoothing)
        return {
            "dpo_loss": pair_loss,
            "reward_chosen": chosen,
            "reward_rejected": rejected,
            "sft_nll": -logprobs[0].sum(),
            "sft_tokens": lengths.sum(),
        }

    def objective(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss to backpropagate, logged values): the pair-mean DPO loss plus ``sft_weight`` times the chosen
        tokens' mean NLL, both over the global batch."""
        out = self.pair_losses(batch)
        n = out["dpo_loss"].shape[0]
        dpo, dpo_logged = global_mean(
            out["dpo_loss"].sum(), torch.tensor(float(n), device=self.device), self._trainer
        )
        sft, sft_logged = global_mean(out["sft_nll"], out["sft_tokens"], self._trainer)
        margin = out["reward_chosen"] - out["reward_rejected"]
        logged = {
            "loss": dpo_logged + self.hparams.sft_weight * sft_logged,
            "dpo_loss": dpo_logged,
            "sft_loss": sft_logged,
            "reward_chosen": out["reward_chosen"].mean(),
            "reward_rejected": out["reward_rejected"].mean(),
            "margin": margin.mean(),
            "pair_accuracy": (margin > 0).float().mean(),
        }
        return dpo + self.hparams.sft_weight * sft, logged

    def _step(self, batch: dict[str, Any], stage: str) -> Tensor:
        total, logged = self.objective(batch)
        n = batch["chosen_input_ids"].shape[0]
        for name, value in logged.items():
            # loss, dpo_loss and sft_loss are global means already (all-reduced inside global_mean)
            sync = name not in ("loss", "dpo_loss", "sft_loss") and self.trainer.world_size > 1
            self.log(f"{stage}/{name}", value, prog_bar=name == "loss", batch_size=n, sync_dist=sync)
        return total

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._step(batch, "val")

    @override
    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._step(batch, "test")


def _base_modified(model: torch.nn.Module) -> bool:
    return any(bool(layer.base_modified) for layer in lora_layers(model).values())
