r"""LARFT: length-aware reinforcement fine-tuning with a hindsight self-counting task (arXiv 2603.19255).

Models are bad at writing exactly ``c`` words partly because they cannot count their own words. LARFT trains
length following with the length reward :math:`R = \max(0, 1 - |L - c| / c)`
(:func:`lightning_llm.rewards.length_reward`) and, from every rollout, builds a *hindsight* supervised task: for
each sampled response :math:`y`, the prompt :math:`x_h(y)` asks for the number of words of :math:`y` and the
label is :math:`z(y) =` ``<word_count>N</word_count>`` with :math:`N = L(y)` the word count outside
``<think>…</think>`` (:func:`lightning_llm.rewards.word_count`). The loss is

.. math::
    \mathcal{L} = \mathcal{L}_{GRPO} - 0.01\,\bar H + 0.001\,\mathbb{D}_{KL}
        + \lambda(t)\,\mathrm{CE}, \qquad
    \mathrm{CE} = -\frac{1}{|Z|} \sum_{(y, k) \in Z} \log \pi_\theta\big(z_k(y) \mid x_h(y), z_{<k}(y)\big),

with :math:`Z` the label tokens (and the end-of-turn token) of the hindsight samples — the prompt is masked —
and :math:`\lambda(t)` warming up linearly from 0 to :math:`\lambda_{max} = 0.01` over the first 10 % of the
updates, then decaying to 0 on a cosine (:func:`hindsight_lambda`). The first three terms are
``GRPOModule(entropy_coef=0.01, beta=0.001)``; :class:`HindsightLengthAwareness` adds the last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import Tensor
from typing_extensions import override

from lightning_llm.backbones import stop_token_ids, turn_end_token_id
from lightning_llm.datamodules.sources import render_prompt
from lightning_llm.datamodules.tasks.length import COUNT_PROMPT, count_answer, parse_word_count
from lightning_llm.lm import global_mean, target_logprobs
from lightning_llm.rewards import word_count
from lightning_llm.rl import HFEngine, PolicyLossStep, RLCallback, Sampling, left_pad

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from lightning_llm.rl import Rollout

__all__ = [
    "DEFAULT_COUNT_PROMPT",
    "HindsightBatch",
    "HindsightLengthAwareness",
    "build_hindsight_batch",
    "count_label",
    "greedy_completions",
    "hindsight_lambda",
    "hindsight_loss",
    "parse_word_count",
    "self_count_accuracy",
    "self_count_predictions",
    "self_count_ranked_accuracy",
]

#: User message of the hindsight task (the ``word_count`` task's); ``{response}`` is replaced by the response.
DEFAULT_COUNT_PROMPT = COUNT_PROMPT
_METADATA_KEY = "larft_hindsight"


def hindsight_lambda(step: int, total: int, lambda_max: float = 0.01, warmup: float = 0.1) -> float:
    r""":math:`\lambda(t)`: linear from 0 to ``lambda_max`` over the first ``warmup`` fraction of ``total``, then cosine to 0.

    With :math:`w = \mathrm{warmup} \cdot T`,

    .. math::
        \lambda(t) = \lambda_{max} \frac{t}{w}\ (t < w), \qquad
        \lambda(t) = \frac{\lambda_{max}}{2}\Big(1 + \cos\big(\pi \min(1, \tfrac{t - w}{T - w})\big)\Big)\ (t \ge w).

    So :math:`\lambda(0) = 0`, :math:`\lambda(w) = \lambda_{max}` and :math:`\lambda(T) = 0`. (Not
    :func:`~lightning_llm.modules.causal_lm.warmup_cosine`: a learning rate must not be 0 at the first step, so
    its warm-up starts at :math:`1/w`; the paper's weight starts at 0.)
    """
    if total < 1 or step < 0:
        raise ValueError(f"need total >= 1 and step >= 0, got step={step}, total={total}")
    if not 0.0 <= warmup <= 1.0 or lambda_max < 0:
        raise ValueError(f"need 0 <= warmup <= 1 and lambda_max >= 0, got {warmup}, {lambda_max}")
    w = warmup * total
    if step < w:
        return lambda_max * step / w
    if w >= total:
        return lambda_max
    progress = min(1.0, (step - w) / (total - w))
    return lambda_max * 0.5 * (1.0 + math.cos(math.pi * progress))


def count_label(text: str) -> str:
    """The hindsight label of a response: ``<word_count>N</word_count>`` with ``N = word_count(text)``."""
    return count_answer(word_count(text))


@dataclass(frozen=True)
class HindsightBatch:
    """The hindsight samples of one rollout batch, one row per response.

    Attributes:
        input_ids: ``[N, T]`` the count prompt left-padded to a common width, then the label right-padded.
        attention_mask: ``[N, T]``.
        label_mask: ``[N, T]`` bool, true on the label tokens and the end-of-turn token only.
        counts: ``[N]`` the count each label states (by default the true word count of the response).
    """

    input_ids: Tensor
    attention_mask: Tensor
    label_mask: Tensor
    counts: Tensor


def build_hindsight_batch(
    tokenizer: PreTrainedTokenizerBase,
    responses: Sequence[str],
    *,
    prompt: str = DEFAULT_COUNT_PROMPT,
    system_prompt: str | None = None,
    device: torch.device | str = "cpu",
    counts: Sequence[int] | None = None,
) -> HindsightBatch:
    """One hindsight sample per response: chat-rendered count prompt (masked) + label + eos (trained).

    The prompt is rendered with :func:`~lightning_llm.datamodules.sources.render_prompt`, as every
    DataModule renders its prompts, and tokenized on its own, as at generation time; the label is tokenized on
    its own and followed by the token that ends an assistant turn
    (:func:`~lightning_llm.backbones.turn_end_token_id`: the chat template's, else eos), trained like
    :class:`~lightning_llm.datamodules.ChatSFTDataModule` trains a response. Rows are the prompt left-padded
    to a common prompt width, then the label right-padded, so every label starts in the same column. The
    label states ``word_count(response)``, or ``counts[i]`` when given (to score candidate answers, as
    :func:`self_count_ranked_accuracy` does).
    """
    if "{response}" not in prompt:
        raise ValueError(f"the hindsight prompt must contain '{{response}}', got {prompt!r}")
    if not responses:
        raise ValueError("no responses to build hindsight samples from")
    eos = turn_end_token_id(tokenizer)
    if eos is None:
        raise ValueError("the tokenizer has no end-of-turn or eos token to end the hindsight label with")
    device = torch.device(device)
    rendered = [render_prompt(tokenizer, prompt.replace("{response}", r), system_prompt) for r in responses]
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    if counts is None:
        counts = [word_count(r) for r in responses]
    elif len(counts) != len(responses):
        raise ValueError(f"{len(counts)} counts for {len(responses)} responses")
    texts = [count_answer(n) for n in counts]
    labels = tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids, attention = left_pad(prompt_ids, tokenizer.pad_token_id, device)
    width = max(len(label) for label in labels) + 1
    label_ids = torch.full((len(responses), width), tokenizer.pad_token_id, dtype=torch.long, device=device)
    label_mask = torch.zeros((len(responses), width), dtype=torch.bool, device=device)
    for i, label in enumerate(labels):
        label_ids[i, : len(label) + 1] = torch.tensor([*label, eos], device=device)
        label_mask[i, : len(label) + 1] = True
    return HindsightBatch(
        input_ids=torch.cat([ids, label_ids], dim=1),
        attention_mask=torch.cat([attention, label_mask.long()], dim=1),
        label_mask=torch.cat([torch.zeros_like(ids, dtype=torch.bool), label_mask], dim=1),
        counts=torch.tensor(list(counts), dtype=torch.long, device=device),
    )


def hindsight_loss(
    model: PreTrainedModel,
    batch: HindsightBatch,
    rows: Tensor | None = None,
    *,
    chunk_size: int | None = None,
    trainer: Any | None = None,
) -> tuple[Tensor, Tensor]:
    """CE: token-mean negative log-likelihood of the label tokens of ``batch`` (its rows ``rows``, or all).

    With ``trainer`` under DDP the mean is over all processes' label tokens (exact, see
    :func:`~lightning_llm.lm.global_mean`). Returns ``(term to backpropagate, value to log)``.
    """
    ids, attention, mask = batch.input_ids, batch.attention_mask, batch.label_mask
    if rows is not None:
        ids, attention, mask = ids[rows], attention[rows], mask[rows]
    logprobs = target_logprobs(model, ids, attention, mask, chunk_size=chunk_size)[0]
    count = torch.tensor(float(logprobs.numel()), device=logprobs.device)
    return global_mean(-logprobs.sum(), count, trainer)


@torch.no_grad()
def greedy_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    system_prompt: str | None = None,
    max_new_tokens: int = 32,
    batch_size: int = 64,
) -> list[str]:
    """Greedy answers to user messages, chat-rendered as the DataModules render prompts (control tokens dropped)."""
    device = next(model.parameters()).device
    engine = HFEngine(model)
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        rendered = [render_prompt(tokenizer, p, system_prompt) for p in prompts[start : start + batch_size]]
        prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        ids, attention = left_pad(prompt_ids, tokenizer.pad_token_id, device)
        new = engine.generate(
            ids,
            attention,
            sampling=Sampling(max_new_tokens, 0.0, 1.0),
            stop_token_ids=stop_token_ids(tokenizer, model),
            pad_id=tokenizer.pad_token_id,
        )
        out.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return out


def self_count_predictions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    prompt: str = DEFAULT_COUNT_PROMPT,
    system_prompt: str | None = None,
    max_new_tokens: int = 32,
    batch_size: int = 64,
) -> list[int | None]:
    """The model's greedy answer to the hindsight prompt for each text: the parsed ``N``, or ``None`` if none."""
    answers = greedy_completions(
        model,
        tokenizer,
        [prompt.replace("{response}", t) for t in texts],
        system_prompt=system_prompt,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
    )
    return [parse_word_count(a) for a in answers]


def self_count_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], **kwargs: Any
) -> float:
    """Fraction of ``texts`` whose word count the model states exactly (greedy; unparsable answers are wrong).

    ``kwargs`` go to :func:`self_count_predictions`.
    """
    if not texts:
        raise ValueError("no texts to count")
    predictions = self_count_predictions(model, tokenizer, texts, **kwargs)
    return sum(p == word_count(t) for p, t in zip(predictions, texts, strict=True)) / len(texts)


@torch.no_grad()
def self_count_ranked_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    max_count: int,
    prompt: str = DEFAULT_COUNT_PROMPT,
    system_prompt: str | None = None,
    batch_size: int = 256,
) -> float:
    r"""Fraction of ``texts`` whose word count is the model's likeliest answer among ``0 … max_count``.

    For each text the candidates :math:`n` are ranked by :math:`\log \pi_\theta(`
    ``<word_count>n</word_count>`` + eos :math:`\mid x_h)`. Unlike :func:`self_count_accuracy` this does not
    need the model to produce the answer format on its own, so it measures what a small model knows about
    the count even while its greedy answer is still malformed (its own metric, not the paper's).
    """
    if not texts or max_count < 0:
        raise ValueError("need texts and max_count >= 0")
    device = next(model.parameters()).device
    candidates = max_count + 1
    pairs = [(t, n) for t in texts for n in range(candidates)]
    scores = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        batch = build_hindsight_batch(
            tokenizer,
            [t for t, _ in chunk],
            prompt=prompt,
            system_prompt=system_prompt,
            device=device,
            counts=[n for _, n in chunk],
        )
        logprobs = target_logprobs(model, batch.input_ids, batch.attention_mask, batch.label_mask)[0]
        rows = batch.label_mask[:, 1:].nonzero()[:, 0]
        scores.append(torch.zeros(len(chunk), device=device).index_add(0, rows, logprobs.float()))
    best = torch.cat(scores).view(len(texts), candidates).argmax(dim=1)
    truth = torch.tensor([word_count(t) for t in texts], device=device)
    return float((best == truth).float().mean())


class HindsightLengthAwareness(RLCallback):
    r"""LARFT's hindsight length-awareness task (module docstring): adds :math:`\lambda(t)\,\mathrm{CE}`.

    ``on_rollout_end`` builds one hindsight sample per rollout row from its decoded completion (stored in
    ``rollout.metadata["larft_hindsight"]``; the count prompt is rendered without the DataModule's system
    prompt, which belongs to the length task). The response is shown whole, ``<think>`` block included; the
    label counts only the words outside it, as the reward does. ``on_policy_loss`` returns :math:`\lambda(t)\,\mathrm{CE}` over
    the hindsight samples *of the update's own rows* (``step.rows``): over one PPO epoch every sample is
    trained once, like its response, and the cost of an update stays proportional to its mini-batch. ``t`` is
    ``trainer.global_step`` (optimizer updates so far) and ``T`` the run's total updates: ``total_steps``, or
    ``trainer.max_steps``, or the estimated batches × ``ppo_epochs`` × ``mini_batches`` of the module (the
    count ``GRPOModule``'s LR schedule uses). Logs ``train/LARFT/lambda`` and ``train/LARFT/ce``; the module
    logs the returned term as ``train/LARFT/loss``. Nothing is stateful beyond ``trainer.global_step``, which
    Lightning restores, so a resumed run continues the schedule exactly.

    Args:
        lambda_max: peak weight :math:`\lambda_{max}` (0.01 in the paper).
        warmup: fraction of the updates over which :math:`\lambda` warms up linearly (0.1 in the paper).
        prompt: user message of the hindsight task, with a ``{response}`` placeholder (the paper's wording is
            not published: unverified).
        total_steps: total updates ``T`` of the schedule (default: derived from the trainer, see above).
        rows: ``"update"`` (default) trains the hindsight samples of the update's own rows (``step.rows``);
            ``"all"`` trains every hindsight sample of the rollout batch at every update (``ppo_epochs`` x
            ``mini_batches`` times per batch; the paper does not say which, unverified).
    """

    def __init__(
        self,
        lambda_max: float = 0.01,
        warmup: float = 0.1,
        prompt: str = DEFAULT_COUNT_PROMPT,
        total_steps: int | None = None,
        rows: str = "update",
    ) -> None:
        if lambda_max < 0:
            raise ValueError(f"lambda_max must be >= 0, got {lambda_max}")
        if not 0.0 <= warmup <= 1.0:
            raise ValueError(f"warmup must be a fraction in [0, 1], got {warmup}")
        if "{response}" not in prompt:
            raise ValueError(f"prompt must contain the placeholder '{{response}}', got {prompt!r}")
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if rows not in ("update", "all"):
            raise ValueError(f"rows must be 'update' or 'all', got {rows!r}")
        self.rows = rows
        self.lambda_max = lambda_max
        self.warmup = warmup
        self.prompt = prompt
        self.total_steps = total_steps

    @property
    @override
    def name(self) -> str:
        return "LARFT"

    def total_updates(self, trainer: L.Trainer, pl_module: L.LightningModule) -> int:
        """``T`` of :func:`hindsight_lambda` for this run (see the class docstring)."""
        if self.total_steps is not None:
            return self.total_steps
        if trainer.max_steps > 0:
            return trainer.max_steps
        hp = pl_module.hparams
        per_batch = int(getattr(hp, "ppo_epochs", 1)) * int(getattr(hp, "mini_batches", 1))
        return max(1, int(trainer.estimated_stepping_batches) * per_batch)

    @override
    def on_rollout_end(self, trainer: L.Trainer, pl_module: L.LightningModule, rollout: Rollout) -> None:
        rollout.metadata[_METADATA_KEY] = build_hindsight_batch(
            pl_module.tokenizer, rollout.completions, prompt=self.prompt, device=rollout.input_ids.device
        )

    @override
    def on_policy_loss(
        self, trainer: L.Trainer, pl_module: L.LightningModule, rollout: Rollout, step: PolicyLossStep
    ) -> Tensor | None:
        batch = rollout.metadata.get(_METADATA_KEY)
        if batch is None:
            raise RuntimeError("HindsightLengthAwareness: no hindsight batch; on_rollout_end did not run")
        lam = hindsight_lambda(
            trainer.global_step, self.total_updates(trainer, pl_module), self.lambda_max, self.warmup
        )
        loss, ce = hindsight_loss(
            pl_module.model,
            batch,
            step.rows if self.rows == "update" else None,
            chunk_size=getattr(pl_module.hparams, "logprob_chunk_size", None),
            trainer=trainer,
        )
        pl_module.log(f"train/{self.name}/lambda", lam, batch_size=rollout.num_rows)
        pl_module.log(f"train/{self.name}/ce", ce, batch_size=rollout.num_rows)
        return lam * loss
