r"""Recontextualization (arXiv 2512.19027): generate under a prompt that discourages misbehaviour, train under one
that permits it.

A misspecified reward (one a shortcut can game) reinforces the shortcut whenever the policy samples it. The
paper's remedy changes the *contexts*, not the reward: completions are sampled under a generation prompt
:math:`x_{gen} = f_{gen}(x)` that discourages the misbehaviour (so fewer hacks are sampled and reinforced) and
the policy is then trained to produce those same completions under a training prompt
:math:`x_{train} = f_{train}(x)` that is neutral or even permissive, so the model learns to behave well *even
where it is told it may not*:

.. math::
    y \sim \pi_{old}(\cdot \mid x_{gen}), \qquad r = R(x, y), \qquad
    \ell_t = -\min\big(\rho_t A_t,\ \mathrm{clip}(\rho_t, 1-\epsilon, 1+\epsilon_{high}) A_t\big)
             + \beta\, \mathbb{D}_{KL,t}, \qquad
    \rho_t = \frac{\pi_\theta(y_t \mid x_{train}, y_{<t})}{\pi_{old}(y_t \mid x_{gen}, y_{<t})},

with the advantages :math:`A` from the group of completions of :math:`x_{gen}` and the KL's reference
log-probs :math:`\log\pi_{ref}(y_t \mid x_{gen}, y_{<t})`. There is *no importance correction across
contexts*: the mismatch :math:`\pi_{old}(y \mid x_{train}) / \pi_{old}(y \mid x_{gen})` is deliberately left
out of :math:`\rho` (our reading of docs/methods.md §8 and the paper's description of its GRPO variant — old
log-probs, KL and advantages under :math:`x_{gen}`, loss under :math:`x_{train}`; the paper does not spell
the ratio out, so this is (unverified) in that one detail). At the first update the ratio is therefore not 1
but the policy's own preference between the two contexts, and clipping applies to it.

Expert iteration (the paper's other setting): :func:`best_of_n` samples ``n`` completions per prompt under
:math:`x_{gen}`, keeps the best by the (misspecified) reward and pairs it with :math:`x_{train}`;
:func:`write_sft_jsonl` writes the pairs for ``ChatSFTDataModule(task=None, source=path)`` and
``CausalLMModule`` does the supervised step.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import Tensor
from typing_extensions import override

from lightning_llm.backbones import stop_token_ids
from lightning_llm.datamodules.sources import render_prompt
from lightning_llm.rewards import RewardFn, get_reward
from lightning_llm.rl import HFEngine, RLCallback, Rollout, RolloutEngine, Sampling, left_pad, run_episodes

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from lightning_llm.text import PromptPrefix
    from lightning_llm.types import Example

__all__ = [
    "PromptSpec",
    "Recontextualization",
    "best_of_n",
    "contextualize",
    "prompt_block",
    "sample_completions",
    "write_sft_jsonl",
]

#: A prompt modification: a template formatted with ``prompt`` (the example's user prompt) and the example's
#: metadata fields (e.g. ``"Never answer pass. {instruction}"``), a callable ``(Example) -> str``, or ``None``
#: for the example's own prompt.
PromptSpec = str | Callable[["Example"], str] | None


def _check_spec(spec: PromptSpec, what: str) -> None:
    if spec is None or callable(spec):
        return
    if not isinstance(spec, str):
        raise TypeError(
            f"{what} must be a template string, a callable (Example) -> str or None, got {spec!r}"
        )
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(spec) if name is not None]
    except ValueError as error:
        raise ValueError(f"{what} {spec!r} is not a valid format template: {error}") from None
    if not any(fields):
        raise ValueError(
            f"{what} {spec!r} has no field: it would replace every prompt by the same text; use {{prompt}} (the "
            "example's user prompt) or a metadata field such as {instruction}"
        )


def contextualize(spec: PromptSpec, example: Example) -> str:
    """The user prompt ``spec`` makes of ``example`` (see :data:`PromptSpec`)."""
    if spec is None:
        return example.prompt
    if callable(spec):
        text = spec(example)
        if not isinstance(text, str):
            raise TypeError(f"prompt callable {spec!r} returned {type(text).__name__}, not str")
        return text
    fields = {**example.metadata, "prompt": example.prompt}
    try:
        return spec.format_map(fields)
    except (KeyError, IndexError) as error:
        raise ValueError(
            f"prompt template {spec!r} needs field {error}, but the example has only {sorted(fields)}"
        ) from None


def prompt_block(
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    spec: PromptSpec,
    *,
    system_prompt: PromptPrefix = None,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor, list[str]]:
    """Left-padded ``(input_ids, attention_mask, texts)`` of ``spec``'s prompts for ``examples``.

    Rendered by the tokenizer's chat template exactly as ``PromptDataModule`` renders its prompts
    (:func:`~lightning_llm.datamodules.sources.render_prompt`, generation header included).
    """
    texts = [render_prompt(tokenizer, contextualize(spec, ex), system_prompt) for ex in examples]
    rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids, mask = left_pad(rows, tokenizer.pad_token_id, torch.device(device))
    return ids, mask, texts


class Recontextualization(RLCallback):
    r"""Generate and score rollouts under ``generation_prompt``, train on them under ``training_prompt``.

    In :meth:`on_rollout_start` the batch's prompts are replaced by :math:`x_{gen}`: ``GRPOModule`` samples,
    scores, computes group advantages and (``needs_old_logprobs``) the old and reference log-probs on that
    rollout. In :meth:`on_rollout_end` the rollout is re-prompted with :math:`x_{train}`
    (:meth:`~lightning_llm.rl.Rollout.with_prompt`: same completion tokens, log-probs and advantages kept),
    so every update's forward pass sees :math:`x_{train}` while :math:`\pi_{old}` and :math:`\pi_{ref}` stay
    those of :math:`x_{gen}` (see the module docstring for the loss and the "no importance correction" reading).
    Validation is untouched: it measures the policy under the DataModule's own prompts.

    Both prompts are a :data:`PromptSpec`: a template with ``{prompt}`` and/or metadata fields, a callable
    ``(Example) -> str``, or ``None`` (the example's own prompt). The DataModule's ``system_prompt`` is kept.
    Stateless, so nothing to resume.

    Args:
        generation_prompt: :math:`f_{gen}`, the context completions are sampled (and scored) in; the paper
            discourages the misbehaviour here.
        training_prompt: :math:`f_{train}`, the context the policy is trained in; neutral or permissive.
    """

    needs_old_logprobs = True

    def __init__(self, generation_prompt: PromptSpec = None, training_prompt: PromptSpec = None) -> None:
        if generation_prompt is None and training_prompt is None:
            raise ValueError(
                "Recontextualization needs a generation_prompt or a training_prompt (both None changes nothing)"
            )
        _check_spec(generation_prompt, "generation_prompt")
        _check_spec(training_prompt, "training_prompt")
        self.generation_prompt = generation_prompt
        self.training_prompt = training_prompt

    @staticmethod
    def _system_prompt(trainer: L.Trainer) -> str | None:
        return getattr(getattr(trainer, "datamodule", None), "system_prompt", None)

    @override
    def on_rollout_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict[str, Any]
    ) -> dict[str, Any] | None:
        if self.generation_prompt is None:
            return None
        ids, mask, texts = prompt_block(
            pl_module.tokenizer,
            batch["example"],
            self.generation_prompt,
            system_prompt=self._system_prompt(trainer),
            device=batch["input_ids"].device,
        )
        return {**batch, "input_ids": ids, "attention_mask": mask, "prompt": texts}

    @override
    def on_rollout_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, rollout: Rollout
    ) -> Rollout | None:
        ids, mask, _ = prompt_block(
            pl_module.tokenizer,
            rollout.examples,
            self.training_prompt,
            system_prompt=self._system_prompt(trainer),
            device=rollout.input_ids.device,
        )
        return rollout.with_prompt(ids, mask)


# ------------------------------------------------------------------------------------ expert iteration


def sample_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    spec: PromptSpec = None,
    *,
    num_samples: int = 1,
    sampling: Sampling | None = None,
    system_prompt: PromptPrefix = None,
    batch_size: int = 64,
    engine: RolloutEngine | None = None,
) -> list[list[str]]:
    """``num_samples`` decoded completions per example, generated under ``spec``'s prompt.

    Decoded as ``GRPOModule`` decodes rollouts (control tokens dropped, tags kept), so rewards see the same
    text. ``sampling.temperature <= 0`` is greedy. Evaluation helper too: the hack rate of a policy under a
    prompt style is ``mean(hack_reward(...))`` over these.
    """
    if num_samples < 1 or batch_size < 1:
        raise ValueError(f"need num_samples >= 1 and batch_size >= 1, got {num_samples} and {batch_size}")
    sampling = sampling or Sampling()
    engine = engine or HFEngine(model)
    device = next(model.parameters()).device
    stops = stop_token_ids(tokenizer, model)
    repeated = [ex for ex in examples for _ in range(num_samples)]
    texts: list[str] = []
    for start in range(0, len(repeated), batch_size):
        chunk = repeated[start : start + batch_size]
        ids, mask, _ = prompt_block(tokenizer, chunk, spec, system_prompt=system_prompt, device=device)
        completion, completion_mask, _ = run_episodes(
            engine, tokenizer, ids, mask, chunk, sampling=sampling, stop_ids=stops
        )
        texts += [
            tokenizer.decode(row[: int(m.sum())], skip_special_tokens=True)
            for row, m in zip(completion, completion_mask, strict=True)
        ]
    return [texts[i : i + num_samples] for i in range(0, len(texts), num_samples)]


def best_of_n(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    reward: str | RewardFn,
    *,
    n: int = 8,
    generation_prompt: PromptSpec = None,
    training_prompt: PromptSpec = None,
    sampling: Sampling | None = None,
    min_reward: float | None = None,
    system_prompt: PromptPrefix = None,
    batch_size: int = 64,
) -> list[Example]:
    r"""One round of recontextualized expert iteration's data: best of ``n`` under :math:`x_{gen}`, for :math:`x_{train}`.

    For each example, ``n`` completions :math:`y_1..y_n \sim \pi(\cdot \mid x_{gen})` are scored by ``reward``
    (a registered name or a :data:`~lightning_llm.rewards.RewardFn`; the misspecified one, as in the paper) and
    :math:`y^* = \arg\max_j R(y_j)` (the first on ties) becomes the SFT target of the *training* prompt:
    ``Example(prompt=x_train, completion=y*)``, its metadata extended with ``best_of_n_reward``. Examples whose
    best reward is below ``min_reward`` are dropped (``None`` keeps all). With both prompts ``None`` this is
    plain best-of-N expert iteration, the baseline.
    """
    if n < 1:
        raise ValueError(f"best_of_n needs n >= 1, got {n}")
    _check_spec(generation_prompt, "generation_prompt")
    _check_spec(training_prompt, "training_prompt")
    reward_fn = get_reward(reward) if isinstance(reward, str) else reward
    samples = sample_completions(
        model,
        tokenizer,
        examples,
        generation_prompt,
        num_samples=n,
        sampling=sampling,
        system_prompt=system_prompt,
        batch_size=batch_size,
    )
    out = []
    for example, completions in zip(examples, samples, strict=True):
        scores = [float(s) for s in reward_fn(completions, [example] * n)]
        best = max(range(n), key=lambda j: (scores[j], -j))
        if min_reward is not None and scores[best] < min_reward:
            continue
        out.append(
            replace(
                example,
                prompt=contextualize(training_prompt, example),
                completion=completions[best],
                metadata={**example.metadata, "best_of_n_reward": scores[best]},
            )
        )
    return out


def write_sft_jsonl(examples: Sequence[Example], path: str | Path) -> Path:
    """Write ``prompt``/``completion``/``answer`` JSON lines that ``ChatSFTDataModule(source=path)`` reads.

    JSON-serialisable metadata values go along as extra columns (they come back as metadata).
    """
    if not examples:
        raise ValueError("no examples to write (did min_reward drop them all?)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for example in examples:
            extra = {}
            for key, value in example.metadata.items():
                try:
                    json.dumps(value)
                except TypeError:
                    continue
                extra[key] = value
            record = {
                **extra,
                "prompt": example.prompt,
                "completion": example.completion,
                "answer": example.answer,
            }
            out.write(json.dumps(record) + "\n")
    return path
