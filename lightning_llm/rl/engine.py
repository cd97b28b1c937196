"""Generation behind one small interface: :class:`RolloutEngine` (``model.generate`` by default) and the
multi-turn loop :func:`run_episodes` that drives any engine through an :class:`~lightning_llm.envs.Environment`,
masking the environment's tokens from the loss. A serving engine (vLLM, SGLang) replaces :class:`HFEngine`
without touching the training code."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from lightning_llm.backbones import eval_mode, stop_token_ids
from lightning_llm.backbones.inspect import cache_kwarg
from lightning_llm.rl.shared_prefix import prefill_prefixes, shared_prefix_unsupported

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from lightning_llm.envs import Environment
    from lightning_llm.types import Example

__all__ = ["HFEngine", "RolloutEngine", "Sampling", "left_pad", "run_episodes"]


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one generation call."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0


class RolloutEngine(Protocol):
    """Anything that completes left-padded prompts. Return new tokens only, right-padded with ``pad_id``.

    ``stop_token_ids`` end a sequence like EOS does (the stop token is kept in the output). When an
    environment's stop string spans several tokens, :func:`run_episodes` also passes it as ``stop_strings=``
    to an engine whose ``generate`` takes that keyword, so it may stop the row once its new text contains
    one; that only saves generation: :func:`run_episodes` cuts every turn right after its first stop string
    itself, so an engine without the keyword works unchanged.
    """

    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        *,
        sampling: Sampling,
        stop_token_ids: list[int],
        pad_id: int,
    ) -> Tensor: ...


class HFEngine:
    """:class:`RolloutEngine` over a Hugging Face model's ``generate`` (the default).

    Given the ``tokenizer``, multi-token ``stop_strings`` stop a row early (``generate(stop_strings=...)``);
    without it they are left to :func:`run_episodes`' cut, after generating up to ``max_new_tokens``.

    With ``share_prefix`` (the default) rows with identical prompts (a GRPO group) are prefilled once and the
    cache is expanded over them before sampling (:func:`~lightning_llm.rl.shared_prefix.prefill_prefixes`): the
    same logits at every step as prefilling each row, at the cost of one prompt per group.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        share_prefix: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.share_prefix = share_prefix

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        *,
        sampling: Sampling,
        stop_token_ids: list[int],
        pad_id: int,
        stop_strings: tuple[str, ...] = (),
    ) -> Tensor:
        extra: dict[str, Any] = {}
        if stop_strings and self.tokenizer is not None:
            extra = {"stop_strings": list(stop_strings), "tokenizer": self.tokenizer}
        with eval_mode(self.model):
            if self.share_prefix and shared_prefix_unsupported(self.model) is None:
                cache = prefill_prefixes(self.model, input_ids, attention_mask)
                if cache is not None:
                    extra[cache_kwarg(self.model)] = cache
            greedy = sampling.temperature <= 0
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=sampling.max_new_tokens,
                do_sample=not greedy,
                temperature=None if greedy else sampling.temperature,
                top_p=None if greedy else sampling.top_p,
                top_k=None,
                eos_token_id=stop_token_ids,
                pad_token_id=pad_id,
                **extra,
            )
        new = out[:, input_ids.shape[1] :]
        # HF pads finished rows with pad_id already; make sure nothing follows a stop token.
        return _pad_after_stop(new, stop_token_ids, pad_id)


def _pad_after_stop(tokens: Tensor, stop_token_ids: list[int], pad_id: int) -> Tensor:
    is_stop = torch.isin(tokens, torch.tensor(stop_token_ids, dtype=torch.long, device=tokens.device))
    after = (is_stop.long().cumsum(dim=1) - is_stop.long()) > 0  # strictly after the first stop
    return tokens.masked_fill(after, pad_id)


def _split_stop_strings(
    tokenizer: PreTrainedTokenizerBase, strings: tuple[str, ...]
) -> tuple[list[int], tuple[str, ...]]:
    """``(ids, texts)``: the stop strings that are one token for ``tokenizer`` as token ids (the fast path: the
    engine stops on them like EOS), and the others as text (a turn ends once its decoded text contains one)."""
    ids, texts = [], []
    for s in strings:
        if not s:
            continue
        encoded = tokenizer(s, add_special_tokens=False)["input_ids"]
        if len(encoded) == 1:
            ids.append(encoded[0])
        else:
            texts.append(s)
    return ids, tuple(texts)


def _takes_stop_strings(engine: RolloutEngine) -> bool:
    """Whether ``engine.generate`` accepts the ``stop_strings`` keyword (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(engine.generate).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "stop_strings" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _stop_string_end(
    tokenizer: PreTrainedTokenizerBase, turn: list[int], stop_strings: tuple[str, ...]
) -> int:
    """Number of tokens of ``turn`` up to and including the token that completes its first stop string (all
    of them if none occurs). A token that runs past the stop string's end is kept whole: the turn stays the
    tokens that were sampled."""
    if not any(s in tokenizer.decode(turn, skip_special_tokens=False) for s in stop_strings):
        return len(turn)
    for end in range(1, len(turn) + 1):
        text = tokenizer.decode(turn[:end], skip_special_tokens=False)
        if any(s in text for s in stop_strings):
            return end
    return len(turn)  # pragma: no cover - the whole turn contains one, so some prefix does


def left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Token-id lists as a left-padded ``[len(rows), max_len]`` block and its attention mask (long)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r, device=device)
            mask[i, width - len(r) :] = 1
    return ids, mask


def run_episodes(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    examples: list[Example],
    *,
    sampling: Sampling,
    env: Environment | None = None,
    max_total_tokens: int | None = None,
    stop_ids: list[int] | None = None,
) -> tuple[Tensor, Tensor, list[Any]]:
    """Complete every (already repeated) prompt; returns ``(completion_ids, completion_loss_mask, states)``.

    ``stop_ids`` is the model's stop set (:func:`~lightning_llm.backbones.stop_token_ids` of the tokenizer and
    the model: its eos, every id of its generation config's ``eos_token_id``, its chat template's end of turn);
    without it, the set the tokenizer alone gives. A completion ends at the first of them.

    Without an environment this is one generation call. With one, each row alternates model turns (ending at
    a stop id, which also ends the episode, or at one of ``env.stop_strings``) and environment observations, up to ``env.max_turns`` turns or
    ``max_total_tokens`` completion tokens (default: ``max_turns × sampling.max_new_tokens``). Observation
    tokens are in ``completion_ids`` with loss-mask 0. Completions are right-padded with the pad token.

    A stop string that is one token for ``tokenizer`` is passed to the engine as a stop token id; one that
    spans several tokens (``"</search>"`` for most pretrained tokenizers) is passed as ``stop_strings=`` and
    the turn is cut after the token whose decoded text completes it, whatever the engine generated after it.
    """
    pad_id = tokenizer.pad_token_id
    model_stops = list(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer)
    device = prompt_ids.device
    if env is None:
        new = engine.generate(
            prompt_ids, prompt_mask, sampling=sampling, stop_token_ids=model_stops, pad_id=pad_id
        )
        mask = _completion_mask(new, model_stops)
        return new, mask, [None] * len(examples)

    single_ids, stop_texts = _split_stop_strings(tokenizer, tuple(env.stop_strings))
    turn_stops = list(dict.fromkeys([*model_stops, *single_ids]))
    by_text: dict[str, Any] = (
        {"stop_strings": stop_texts} if stop_texts and _takes_stop_strings(engine) else {}
    )
    budget = max_total_tokens or env.max_turns * sampling.max_new_tokens
    prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask, strict=True)]
    tokens: list[list[int]] = [[] for _ in examples]
    trainable: list[list[int]] = [[] for _ in examples]
    states = [env.reset(ex) for ex in examples]
    active = list(range(len(examples)))
    for _turn in range(env.max_turns):
        if not active:
            break
        ids, mask = left_pad([prompts[i] + tokens[i] for i in active], pad_id, device)
        room = min(sampling.max_new_tokens, max(1, budget - min(len(tokens[i]) for i in active)))
        turn_sampling = Sampling(room, sampling.temperature, sampling.top_p)
        new = engine.generate(
            ids, mask, sampling=turn_sampling, stop_token_ids=turn_stops, pad_id=pad_id, **by_text
        )
        still = []
        for row, i in enumerate(active):
            turn = new[row]
            turn = turn[: int(_completion_mask(turn[None], turn_stops)[0].sum())].tolist()
            if stop_texts:  # before the stop-id check: engines pad after a stop string, pad may stop
                turn = turn[: _stop_string_end(tokenizer, turn, stop_texts)]
            turn = turn[: max(0, budget - len(tokens[i]))]
            tokens[i] += turn
            trainable[i] += [1] * len(turn)
            ended_by_model = bool(turn) and turn[-1] in model_stops
            if ended_by_model or len(tokens[i]) >= budget or not turn:
                continue
            reply = env.step(states[i], tokenizer.decode(turn, skip_special_tokens=False))
            if reply.observation:
                obs = tokenizer(reply.observation, add_special_tokens=False)["input_ids"]
                obs = obs[: max(0, budget - len(tokens[i]))]
                tokens[i] += obs
                trainable[i] += [0] * len(obs)
            if not reply.done and len(tokens[i]) < budget:
                still.append(i)
        active = still
    width = max(1, max(len(t) for t in tokens))
    out = torch.full((len(tokens), width), pad_id, dtype=torch.long, device=device)
    out_mask = torch.zeros((len(tokens), width), dtype=torch.bool, device=device)
    for i, (t, m) in enumerate(zip(tokens, trainable, strict=True)):
        if t:
            out[i, : len(t)] = torch.tensor(t, device=device)
            out_mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool, device=device)
    return out, out_mask, states


def _completion_mask(tokens: Tensor, stop_ids: list[int]) -> Tensor:
    """True up to and including the first stop token (everything, if none); false on what follows.

    Engines pad only after a row's stop token, so this is also the non-padding mask.
    """
    is_stop = torch.isin(tokens, torch.tensor(stop_ids, dtype=torch.long, device=tokens.device)).long()
    return (is_stop.cumsum(dim=1) - is_stop) == 0
