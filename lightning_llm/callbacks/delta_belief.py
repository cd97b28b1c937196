r"""ΔBelief-RL: intrinsic per-turn credit from the policy's own belief in the answer (bethgelab/delta-belief-rl).

Outcome-only RL on long interactions gives every turn the same credit. ΔBelief-RL rewards each turn by how much
it raised the agent's own belief in the target. After the prompt and after every turn's observation, the
policy is probed with its own guess of the target and scores it:

.. math::
    \log b_t = \log \pi_\theta(\text{target} \mid x,\ a_1 o_1 \dots a_t o_t,\ \text{probe prefix}),
    \qquad \Delta B_t = \log b_t - \log b_{t-1}

(:math:`b_0` after the prompt alone; in the 0-based notation of the code, turn :math:`t` has
:math:`\Delta B_t = \log b_{t+1} - \log b_t`). The per-turn reward is

.. math::
    r_t = \text{penalty}_t + \mathbb{1}[t = T]\, r_{end} + \lambda \max(\Delta B_t, 0), \qquad \lambda = 0.1,

with the environment's penalties (invalid −5, repeated −1) and :math:`r_{end} = 2\cdot\text{win} - 0.05\cdot T`
(:class:`~lightning_llm.envs.TwentyQuestionsEnvironment`). Advantages are turn-wise GRPO: for every turn index
:math:`t`, :math:`A_{i,t} = (r_{i,t} - \text{mean}_g r_{\cdot,t}) / \text{std}_g r_{\cdot,t}` over the rows of the
group that have a turn :math:`t`, and every token of turn :math:`t` gets :math:`A_{i,t}`.

Checked against the authors' code (read, not copied): the elicitation is appended as the agent's own next
message; :math:`b_0` is taken after the prompt; the ``grpo_turn`` estimator normalises each turn index across
the group with no discounting and no sum over future turns, and the end-of-game reward sits on the last turn.
Not verified, hence parameters: how rows with fewer turns enter a turn's statistics (``missing_turns``), and
whether the target's log-prob is summed or averaged over its tokens (``reduction``). The authors' code also has
a multi-turn REINFORCE estimator with discounted returns; ``gamma`` gives that variant's returns (off by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning as L
import torch
from torch import Tensor
from typing_extensions import override

from lightning_llm.callbacks.llds import segment_index
from lightning_llm.lm import target_logprobs
from lightning_llm.rl import RLCallback, left_pad

if TYPE_CHECKING:
    from lightning_llm.rl import Rollout

__all__ = ["DeltaBeliefReward", "belief_logprobs", "turn_rewards", "turn_spans", "turnwise_advantages"]


def turn_rewards(
    delta_belief: Tensor,
    penalties: Tensor,
    end_reward: Tensor,
    num_turns: Tensor,
    *,
    coef: float = 0.1,
) -> Tensor:
    r"""``[N, T]`` per-turn rewards :math:`r_t = \text{penalty}_t + \mathbb{1}[t = T_i - 1] r_{end,i} + \lambda \max(\Delta B_t, 0)`.

    Args:
        delta_belief: ``[N, T]`` :math:`\Delta B_t` of each row's turns (anything past ``num_turns``).
        penalties: ``[N, T]`` per-turn penalties.
        end_reward: ``[N]`` :math:`r_{end}` of each row, credited to its last turn.
        num_turns: ``[N]`` turns of each row; entries at ``t >= num_turns[i]`` are zero in the result.
        coef: :math:`\lambda`.
    """
    steps = torch.arange(delta_belief.shape[1], device=delta_belief.device)
    valid = steps[None, :] < num_turns[:, None]
    last = steps[None, :] == (num_turns[:, None] - 1)
    rewards = penalties + last * end_reward[:, None] + coef * delta_belief.clamp(min=0)
    return torch.where(valid, rewards, torch.zeros_like(rewards))


def turnwise_advantages(
    rewards: Tensor,
    num_turns: Tensor,
    group_ids: Tensor,
    *,
    scale: Literal["group", "none"] = "group",
    missing_turns: Literal["exclude", "zero"] = "exclude",
    gamma: float | None = None,
    eps: float = 1e-4,
) -> Tensor:
    r"""``[N, T]`` turn-wise GRPO advantages :math:`(r_{i,t} - \bar r_{g,t}) / s_{g,t}`, zero past a row's turns.

    Statistics are per (group, turn index). With ``missing_turns="exclude"`` (default) a row that has no turn
    ``t`` does not enter turn ``t``'s mean and std; with ``"zero"`` it counts as reward 0 there (the reading of
    a padded ``[N, T]`` reward tensor). A turn index only one row of a group reaches gets advantage 0 (nothing
    to compare it with). ``scale="group"`` divides by the unbiased std (+ ``eps``), as GRPO; ``"none"`` only
    centres (Dr. GRPO). With ``gamma`` the rewards are first turned into discounted returns
    :math:`R_t = r_t + \gamma R_{t+1}` within each row.
    """
    n, t_max = rewards.shape
    steps = torch.arange(t_max, device=rewards.device)
    valid = steps[None, :] < num_turns[:, None]
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    if gamma is not None:
        returns = torch.zeros_like(rewards)
        running = torch.zeros(n, dtype=rewards.dtype, device=rewards.device)
        for t in reversed(range(t_max)):
            running = rewards[:, t] + gamma * running
            returns[:, t] = running
        rewards = torch.where(valid, returns, torch.zeros_like(returns))
    num_groups = int(group_ids.max()) + 1 if n else 0
    member = torch.ones_like(valid) if missing_turns == "zero" else valid
    weight = member.to(rewards.dtype)
    counts = torch.zeros(num_groups, t_max, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, group_ids, weight
    )
    sums = torch.zeros_like(counts).index_add_(0, group_ids, rewards * weight)
    means = sums / counts.clamp(min=1)
    centred = (rewards - means[group_ids]) * weight
    out = centred
    if scale == "group":
        sq = torch.zeros_like(counts).index_add_(0, group_ids, centred**2)
        std = (sq / (counts - 1).clamp(min=1)).sqrt()
        out = centred / (std[group_ids] + eps)
    return torch.where(valid, out, torch.zeros_like(out))


def turn_spans(loss_mask: Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the ``(start, end)`` columns (end exclusive) of each turn: contiguous runs of trainable tokens."""
    token_rows, token_positions = loss_mask.nonzero(as_tuple=True)
    spans: list[list[tuple[int, int]]] = [[] for _ in range(loss_mask.shape[0])]
    if token_rows.numel() == 0:
        return spans
    segments = segment_index(token_rows, token_positions)
    first = torch.ones_like(segments, dtype=torch.bool)
    first[1:] = segments[1:] != segments[:-1]
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    for row, start, end in zip(
        token_rows[first].tolist(),
        token_positions[first].tolist(),
        (token_positions[last] + 1).tolist(),
        strict=True,
    ):
        spans[row].append((start, end))
    return spans


@torch.no_grad()
def belief_logprobs(
    model: Any,
    contexts: Sequence[Sequence[int]],
    prefix_ids: Sequence[int],
    target_ids: Sequence[Sequence[int]],
    *,
    pad_id: int,
    reduction: Literal["sum", "mean"] = "sum",
    batch_size: int = 64,
    chunk_size: int | None = None,
) -> Tensor:
    r"""``[M]`` :math:`\log b`: log-prob of ``target_ids[m]`` after ``contexts[m] + prefix_ids``, in batches.

    Each probe is left-padded (positions follow the attention mask, so padding does not shift them) and scored
    with :func:`~lightning_llm.lm.target_logprobs` on the target's tokens only; ``reduction`` sums them
    (the log-probability of the whole target) or averages them (per token).
    """
    if len(contexts) != len(target_ids):
        raise ValueError(f"{len(contexts)} contexts for {len(target_ids)} targets")
    device = next(model.parameters()).device
    out = []
    for lo in range(0, len(contexts), batch_size):
        rows = [
            list(c) + list(prefix_ids) + list(t)
            for c, t in zip(contexts[lo : lo + batch_size], target_ids[lo : lo + batch_size], strict=True)
        ]
        ids, mask = left_pad(rows, pad_id, device)
        target = torch.zeros_like(mask, dtype=torch.bool)
        lengths = [len(t) for t in target_ids[lo : lo + batch_size]]
        for i, length in enumerate(lengths):
            target[i, ids.shape[1] - length :] = True
        logprobs = target_logprobs(model, ids, mask, target, chunk_size=chunk_size)[0]
        owner = torch.repeat_interleave(
            torch.arange(len(rows), device=device), torch.tensor(lengths, device=device)
        )
        sums = torch.zeros(len(rows), device=device, dtype=logprobs.dtype).index_add_(0, owner, logprobs)
        if reduction == "mean":
            sums = sums / torch.tensor(lengths, device=device, dtype=sums.dtype).clamp(min=1)
        out.append(sums)
    return torch.cat(out) if out else torch.zeros(0)


class DeltaBeliefReward(RLCallback):
    r"""Replace GRPO's sequence advantages with turn-wise advantages of ΔBelief-shaped per-turn rewards.

    In ``on_rollout_end``: splits every row into turns (contiguous runs of trainable tokens: the environment's
    observations are never trainable and separate them), scores :math:`\log b_t` of the row's target
    (``example.answer``) after the prompt and after each turn's observation with the policy itself (one batched
    no-grad pass), builds :func:`turn_rewards` and writes :func:`turnwise_advantages` into
    ``rollout.advantages`` (every token of turn :math:`t` gets :math:`A_{i,t}`). ``rollout.rewards`` is left as
    the outcome reward (so ``train/reward`` stays comparable with the baseline); the per-turn rewards, beliefs
    and ΔB are stored in ``rollout.metadata["delta_belief"]``.

    Penalties come from the environment when it has ``turn_penalties(state)``
    (:class:`~lightning_llm.envs.TwentyQuestionsEnvironment`); a turn the environment never
    answered (one that ended at EOS or at the token budget) has penalty 0. :math:`r_{end}` is then
    ``rollout.rewards − Σ_t penalty_t``, so that with ``coef=0`` the per-turn rewards sum to the rollout's reward
    whatever rewards are configured (with ``rewards=["env"]`` it is exactly the environment's :math:`r_{end}`).
    Without such an environment, penalties are 0 and :math:`r_{end}` is the whole reward.

    The callback keeps no state between rollout batches (nothing to checkpoint) and runs no collective: under
    DDP each process scores its own rows, and groups never span processes.

    Logs ``train/DeltaBelief/{delta_belief, log_belief_first, log_belief_last, positive_fraction, turns}``:
    mean ΔB over all turns, mean :math:`\log b_0` and final :math:`\log b_T`, the fraction of turns with
    ΔB > 0, and mean turns per episode.

    Args:
        coef: :math:`\lambda` (0.1, the paper's value).
        probe: The probe, a template with one ``{target}``: the text before it is appended to the context and
            the target's tokens are scored (what follows ``{target}`` is not). The authors append the agent's
            own guess of the target as its next message (docs/methods.md §18: "Is it '{target}'?"; their exact
            elicitation text unverified); the default is the guess action of
            :class:`~lightning_llm.envs.TwentyQuestionsEnvironment`, the same thing in this library's protocol
            (and the only context in which a model trained from scratch ever names an item). Prefix and target
            are tokenized separately.
        reduction: ``"sum"`` (log-probability of the target) or ``"mean"`` (per target token) (unverified).
        scale: ``"group"`` (divide by the per-turn group std) or ``"none"``.
        missing_turns: how rows with fewer turns enter a turn's statistics, see :func:`turnwise_advantages`.
        gamma: discount of returns over future turns, ``None`` (default, the paper's ``grpo_turn``): none.
        probe_batch_size: probes per forward pass.
    """

    def __init__(
        self,
        coef: float = 0.1,
        *,
        probe: str = "<answer>{target}</answer>",
        reduction: Literal["sum", "mean"] = "sum",
        scale: Literal["group", "none"] = "group",
        missing_turns: Literal["exclude", "zero"] = "exclude",
        gamma: float | None = None,
        probe_batch_size: int = 64,
    ) -> None:
        if coef < 0:
            raise ValueError(f"coef must be >= 0, got {coef}")
        if probe.count("{target}") != 1:
            raise ValueError(f"probe must contain '{{target}}' exactly once, got {probe!r}")
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        if scale not in ("group", "none"):
            raise ValueError(f"scale must be 'group' or 'none', got {scale!r}")
        if missing_turns not in ("exclude", "zero"):
            raise ValueError(f"missing_turns must be 'exclude' or 'zero', got {missing_turns!r}")
        if gamma is not None and not 0 <= gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1] or None, got {gamma}")
        if probe_batch_size < 1:
            raise ValueError(f"probe_batch_size must be >= 1, got {probe_batch_size}")
        self.coef = coef
        self.probe = probe
        self.reduction = reduction
        self.scale = scale
        self.missing_turns = missing_turns
        self.gamma = gamma
        self.probe_batch_size = probe_batch_size

    @property
    @override
    def name(self) -> str:
        return "DeltaBelief"

    @override
    def on_rollout_end(self, trainer: L.Trainer, pl_module: L.LightningModule, rollout: Rollout) -> None:
        tokenizer = pl_module.tokenizer
        prefix_text = self.probe.split("{target}")[0]
        prefix = tokenizer(prefix_text, add_special_tokens=False)["input_ids"] if prefix_text else []
        spans = turn_spans(rollout.loss_mask)
        n = rollout.num_rows
        num_turns = torch.tensor([len(s) for s in spans], dtype=torch.long)
        t_max = max(1, int(num_turns.max()) if n else 1)
        real = rollout.attention_mask.bool()
        contexts, targets, owners = [], [], []
        cache: dict[str, list[int]] = {}
        for i, row_spans in enumerate(spans):
            target = str(rollout.examples[i].answer)
            if target not in cache:
                cache[target] = tokenizer(target, add_special_tokens=False)["input_ids"]
            if not row_spans or not cache[target]:
                continue
            ids = rollout.input_ids[i]
            # b_0 after the prompt; b_{k+1} after turn k and its observation (up to the next turn's start).
            cuts = (
                [rollout.prompt_length] + [s for s, _ in row_spans[1:]] + [int(real[i].nonzero().max()) + 1]
            )
            for cut in cuts:
                contexts.append(ids[:cut][real[i, :cut]].tolist())
                targets.append(cache[target])
                owners.append(i)
        log_b = torch.zeros(n, t_max + 1)
        if contexts:
            values = (
                belief_logprobs(
                    pl_module.model,
                    contexts,
                    prefix,
                    targets,
                    pad_id=tokenizer.pad_token_id,
                    reduction=self.reduction,
                    batch_size=self.probe_batch_size,
                )
                .float()
                .cpu()
            )
            position: dict[int, int] = {}
            for value, i in zip(values.tolist(), owners, strict=True):
                k = position.get(i, 0)
                log_b[i, k] = value
                position[i] = k + 1
        steps = torch.arange(t_max)
        valid = steps[None, :] < num_turns[:, None]
        delta = torch.where(valid, log_b[:, 1:] - log_b[:, :-1], torch.zeros(n, t_max))

        penalties = torch.zeros(n, t_max)
        env = getattr(pl_module, "env", None)
        states = rollout.metadata.get("env_states") or [None] * n
        if env is not None and hasattr(env, "turn_penalties"):
            for i, state in enumerate(states):
                if state is None:
                    continue
                row = list(env.turn_penalties(state))[: int(num_turns[i])]
                if row:
                    penalties[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        total = rollout.rewards.detach().float().cpu() if rollout.rewards is not None else torch.zeros(n)
        end = total - (penalties * valid).sum(dim=1)
        rewards = turn_rewards(delta, penalties, end, num_turns, coef=self.coef)
        advantages = turnwise_advantages(
            rewards,
            num_turns,
            rollout.group_ids.cpu(),
            scale=self.scale,
            missing_turns=self.missing_turns,
            gamma=self.gamma,
        )
        dense = torch.zeros(rollout.loss_mask.shape, dtype=torch.float32)
        for i, row_spans in enumerate(spans):
            for k, (start, stop) in enumerate(row_spans):
                dense[i, start:stop] = advantages[i, k]
        device = rollout.loss_mask.device
        rollout.advantages = dense.to(device) * rollout.loss_mask
        rollout.metadata["delta_belief"] = {
            "log_belief": log_b,
            "delta_belief": delta,
            "turn_rewards": rewards,
            "turn_advantages": advantages,
            "num_turns": num_turns,
        }
        played = num_turns > 0
        if played.any():
            rows = played.nonzero().squeeze(1)
            turns = valid[rows]
            metrics = {
                "delta_belief": delta[rows][turns].mean(),
                "positive_fraction": (delta[rows][turns] > 0).float().mean(),
                "log_belief_first": log_b[rows, 0].mean(),
                "log_belief_last": log_b[rows, num_turns[rows]].mean(),
                "turns": num_turns[rows].float().mean(),
            }
            for key, value in metrics.items():
                pl_module.log(f"train/{self.name}/{key}", value.to(device), batch_size=n)
