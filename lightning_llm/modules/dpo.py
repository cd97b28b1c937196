r"""Direct Preference Optimization (Rafailov et al., 2023) on preference pairs of any causal LM."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from lightning_llm.backbones import load_backbone
from lightning_llm.lm import apply_lora_config, global_mean, labels_to_mask, target_logprobs
from lightning_llm.lora import LoRAConfig
from lightning_llm.modules.causal_lm import CausalLMModule

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
    reference :math:`\pi_{ref}` is a frozen copy of the initial policy (the usual SFT model), or the backbone
    ``reference_model`` names. Both sides of a pair go through one forward (stacked), the reference's through
    one more under ``no_grad``; sequence log-probs use the fused log-prob kernel, so no logits tensor is built.

    With ``sft_weight`` :math:`\alpha > 0` the loss adds :math:`\alpha` times the per-token NLL of the chosen
    response (RPO, Pang et al. 2024; TRL's ``rpo_alpha``): small models trained by DPO alone tend to lower the
    likelihood of *both* responses until their text degrades, and the NLL term anchors the chosen one.

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
        reference_model: Backbone of :math:`\pi_{ref}`; ``None`` copies the initial policy.
        lr: Peak AdamW learning rate (DPO uses small ones: 5e-7–5e-6 for billion-parameter models).
        lora: Train a LoRA adapter; the reference stays the un-adapted model.
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
        super().__init__(model, lr=lr, lora=None, **kwargs)
        hp = self.hparams
        if reference_model is None:
            reference = copy.deepcopy(self.model)
        else:
            reference, _ = load_backbone(
                reference_model, dtype=hp.dtype, trust_remote_code=hp.trust_remote_code
            )
        self.ref_model = reference.eval().requires_grad_(False)
        # After the reference copy, so the reference stays the un-adapted model.
        self.hparams["lora"] = apply_lora_config(self.model, lora)

    @override
    def train(self, mode: bool = True) -> DPOModule:
        super().train(mode)
        self.ref_model.eval()  # never dropout in the reference, whatever Lightning toggles
        return self

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
        with torch.no_grad():
            ref, _ = sequence_logprobs(self.ref_model, ids, attention, labels, chunk_size=chunk)
        n = batch["chosen_input_ids"].shape[0]
        return policy[:n], policy[n:], ref[:n], ref[n:], lengths[:n]

    def pair_losses(self, batch: dict[str, Any]) -> dict[str, Tensor]:
        """Per-pair ``loss`` (DPO + ``sft_weight`` × chosen NLL, with grad), ``dpo_loss``, ``sft_loss``,
        ``reward_chosen`` and ``reward_rejected`` (detached), each ``[B]``."""
        hp = self.hparams
        *logprobs, lengths = self.pair_logprobs(batch)
        pair_loss, chosen, rejected = dpo_loss(*logprobs, beta=hp.beta, label_smoothing=hp.label_smoothing)
        sft = -logprobs[0] / lengths.clamp(min=1)
        return {
            "loss": pair_loss + hp.sft_weight * sft,
            "dpo_loss": pair_loss.detach(),
            "sft_loss": sft.detach(),
            "reward_chosen": chosen,
            "reward_rejected": rejected,
        }

    def _step(self, batch: dict[str, Any], stage: str) -> Tensor:
        out = self.pair_losses(batch)
        loss = out["loss"]
        n = loss.shape[0]
        total, logged = global_mean(loss.sum(), torch.tensor(float(n), device=loss.device), self._trainer)
        margin = out["reward_chosen"] - out["reward_rejected"]
        kwargs = {"batch_size": n, "sync_dist": self.trainer.world_size > 1}
        self.log(f"{stage}/loss", logged, prog_bar=True, batch_size=n)
        for name in ("dpo_loss", "sft_loss", "reward_chosen", "reward_rejected"):
            self.log(f"{stage}/{name}", out[name].mean(), **kwargs)
        self.log(f"{stage}/margin", margin.mean(), **kwargs)
        self.log(f"{stage}/pair_accuracy", (margin > 0).float().mean(), **kwargs)
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
