"""Rollouts: what an RL step generates, handed from ``GRPOModule`` to the RL callbacks.

:class:`Rollout` is the contract between ``GRPOModule`` and the :class:`~lightning_llm.rl.RLCallback` s.
Token-level tensors are aligned with ``input_ids``: entry ``[i, t]`` is about token ``t`` of row ``i``
(its log-prob is ``log π(input_ids[i, t] | input_ids[i, :t])``); column 0 never carries a target.
:meth:`Rollout.with_prompt` puts the same completions behind another prompt block (recontextualization trains
under a prompt other than the one it generated from), re-aligning every such tensor.

"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_llm.types import Example

__all__ = ["Rollout"]


@dataclass
class Rollout:
    """One batch of sampled completions with everything the policy loss and the callbacks need.

    Rows are ``num_prompts × group_size``, grouped: rows ``g * G … g * G + G − 1`` share prompt ``g``.

    Attributes:
        input_ids: ``[N, T]`` left-padded prompt (``prompt_length`` columns) then the completion, right-padded.
        attention_mask: ``[N, T]``.
        loss_mask: ``[N, T]`` bool, true on trainable completion tokens: never prompt, padding or environment
            observation tokens (those are context, not actions).
        prompt_length: number of prompt columns; completions start there.
        group_ids: ``[N]`` index of each row's prompt.
        rewards: ``[N]`` total reward (weighted sum of ``reward_components``).
        reward_components: per reward function, ``[N]`` unweighted values.
        advantages: ``[N, T]`` token-level advantages (zero outside ``loss_mask``).
        old_logprobs: ``[N, T]`` log-probs under the policy that generated the rollout (zero outside the mask);
            ``None`` until the module fills them.
        ref_logprobs: ``[N, T]`` log-probs under the frozen reference, or ``None`` (``beta = 0``).
        completions: decoded completion text per row (model turns and observations, control tokens dropped).
        examples: the :class:`Example` of each row (repeated ``group_size`` times).
        metadata: free-form per-rollout data for callbacks (e.g. per-turn rewards of multi-turn episodes).
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    prompt_length: int
    group_ids: Tensor
    completions: list[str]
    examples: list[Example]
    rewards: Tensor | None = None
    reward_components: dict[str, Tensor] = field(default_factory=dict)
    advantages: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def completion_lengths(self) -> Tensor:
        """Trainable tokens per row (environment tokens excluded)."""
        return self.loss_mask.sum(dim=1)

    def with_prompt(self, prompt_ids: Tensor, prompt_mask: Tensor) -> Rollout:
        """The same completions behind another (left-padded) prompt block: ``[N, P']`` ids and attention mask.

        Every completion token keeps its value and its per-token quantities (loss mask, advantages, old and
        reference log-probs): they move from column ``prompt_length + j`` to ``P' + j``. The new prompt columns
        are context, never targets (loss mask false, advantages and log-probs zero). Rewards, texts, examples
        and metadata are shared, not copied. Log-probs are *not* recomputed: they stay what they were under the
        old prompt, which is what recontextualization wants (π_old and π_ref under the generation prompt).
        """
        if (
            prompt_ids.dim() != 2
            or prompt_ids.shape[0] != self.num_rows
            or prompt_ids.shape != prompt_mask.shape
        ):
            raise ValueError(
                f"need prompt_ids and prompt_mask of shape [{self.num_rows}, P'], got "
                f"{tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}"
            )
        if prompt_ids.shape[1] == 0:
            raise ValueError("the new prompt block is empty")
        device = self.input_ids.device
        prompt_ids = prompt_ids.to(device=device, dtype=self.input_ids.dtype)
        prompt_mask = prompt_mask.to(device=device, dtype=self.attention_mask.dtype)
        cut = self.prompt_length

        def realign(tensor: Tensor | None, prompt_block: Tensor | None = None) -> Tensor | None:
            if tensor is None:
                return None
            if prompt_block is None:
                prompt_block = tensor.new_zeros((tensor.shape[0], prompt_ids.shape[1]))
            return torch.cat([prompt_block, tensor[:, cut:]], dim=1)

        return replace(
            self,
            input_ids=realign(self.input_ids, prompt_ids),
            attention_mask=realign(self.attention_mask, prompt_mask),
            loss_mask=realign(self.loss_mask),
            prompt_length=prompt_ids.shape[1],
            advantages=realign(self.advantages),
            old_logprobs=realign(self.old_logprobs),
            ref_logprobs=realign(self.ref_logprobs),
        )
