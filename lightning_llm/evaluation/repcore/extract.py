"""What a source model says about each benchmark item: its hidden states (:func:`extract_hidden_states`) and
whether it answers a multiple-choice item correctly (:func:`score_multiple_choice`), both cached under
``lightning_llm_home()/repcore_cache``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from lightning_llm.backbones import eval_mode, lightning_llm_home

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

__all__ = ["Pooling", "extract_hidden_states", "score_multiple_choice"]

Pooling = Literal["last", "mean"]


def _model_fingerprint(model: nn.Module) -> str:
    """Config plus a strided sample of every parameter: changes when the weights do, cheap for large models."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    h.update((config.to_json_string() if config is not None else type(model).__name__).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            sample = flat[:: max(flat.numel() // 4096, 1)].float().cpu().contiguous()
            h.update(name.encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def _cache_path(kind: str, model: nn.Module, model_id: str | None, payload: object) -> Path:
    model_key = hashlib.sha256((model_id or _model_fingerprint(model)).encode()).hexdigest()[:16]
    items_key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    return lightning_llm_home() / "repcore_cache" / f"{kind}-{model_key}-{items_key}.safetensors"


def _load_or_compute(path: Path | None, compute) -> Tensor:
    from safetensors.torch import load_file, save_file

    if path is not None and path.is_file():
        return load_file(str(path))["value"]
    value = compute()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{id(value)}")
        save_file({"value": value.contiguous()}, str(tmp))
        tmp.replace(path)  # atomic: a concurrent reader sees the old state or the whole file
    return value


def _batches(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], batch_size: int):
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(list(texts[start : start + batch_size]), return_tensors="pt", padding=True)
        yield start, enc


@torch.no_grad()
def extract_hidden_states(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    pooling: Pooling = "mean",
    layer: int = -1,
    batch_size: int = 32,
    model_id: str | None = None,
    cache: bool = True,
) -> Tensor:
    """Per-item hidden states ``[N, D]`` (float32, CPU) of a causal LM.

    Args:
        pooling: ``"mean"`` over the prompt's tokens (default), or ``"last"``, the state at the last prompt
            token. The last-token state of a trained model is dominated by its *answer* (items cluster by
            predicted digit, not by what they test); mean pooling keeps the item's content, and gave clearly
            better coresets on :mod:`~lightning_llm.evaluation.skills_benchmark` (MAE 0.085 vs 0.107 at 10
            anchors, 10 source models), so it is the default.
        layer: index into ``output_hidden_states`` (0 = embeddings, -1 = last layer, after the final norm in
            Llama/Qwen implementations).
        model_id: identity of the model in the cache key; defaults to a fingerprint of its config and weights.
        cache: read/write ``lightning_llm_home()/repcore_cache/hidden-<model>-<items>.safetensors`` (keyed by
            the model, the prompts, pooling and layer), so re-runs are free.

    Works with left or right padding (the position of the last real token is read from the attention mask).
    """
    if pooling not in ("last", "mean"):
        raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
    if not prompts:
        raise ValueError("no prompts given")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    payload = {"prompts": list(prompts), "pooling": pooling, "layer": layer}
    path = _cache_path("hidden", model, model_id, payload) if cache else None

    def compute() -> Tensor:
        device = next(model.parameters()).device
        rows = []
        with eval_mode(model):
            for _, enc in _batches(tokenizer, prompts, batch_size):
                enc = enc.to(device)
                out = model(**enc, output_hidden_states=True, use_cache=False)
                h = out.hidden_states[layer].float()
                mask = enc["attention_mask"]
                if pooling == "last":
                    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # last position whose mask is 1
                    rows.append(h[torch.arange(h.shape[0], device=device), last].cpu())
                else:
                    m = mask.unsqueeze(-1).to(h.dtype)
                    rows.append(((h * m).sum(1) / m.sum(1).clamp_min(1)).cpu())
        return torch.cat(rows)

    return _load_or_compute(path, compute)


@torch.no_grad()
def score_multiple_choice(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    choices: Sequence[Sequence[str]],
    answers: Sequence[int],
    *,
    batch_size: int = 32,
    model_id: str | None = None,
    cache: bool = True,
) -> Tensor:
    r"""Correctness ``[N]`` (bool) of a causal LM on multiple-choice items, by comparing choice log-probabilities.

    Item :math:`i` is correct iff :math:`\log p(\text{choices}_i[\text{answers}_i] \mid \text{prompt}_i)` (the
    sum over the choice's tokens of ``prompt + choice``) is strictly the largest. When every choice adds one
    token to its prompt's tokenisation (digits, letters) this takes one forward per item; otherwise one per
    (item, choice). Cached like :func:`extract_hidden_states`.
    """
    if not (len(prompts) == len(choices) == len(answers)) or not prompts:
        raise ValueError(
            f"need equally many (>0) prompts, choices and answers, got {len(prompts)}, {len(choices)}, "
            f"{len(answers)}"
        )
    for i, (options, answer) in enumerate(zip(choices, answers, strict=True)):
        if len(options) < 2 or not 0 <= answer < len(options):
            raise ValueError(f"item {i}: need >= 2 choices and 0 <= answer < {len(options)}, got {answer}")
    payload = {"prompts": list(prompts), "choices": [list(c) for c in choices], "answers": list(answers)}
    path = _cache_path("mc", model, model_id, payload) if cache else None

    def compute() -> Tensor:
        device = next(model.parameters()).device
        prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        flat = [p + c for p, options in zip(prompts, choices, strict=True) for c in options]
        full_ids = tokenizer(flat, add_special_tokens=False)["input_ids"]
        # Per (item, choice): the continuation tokens, valid only if the prompt's tokens are a prefix.
        conts, k = [], 0
        for ids, options in zip(prompt_ids, choices, strict=True):
            row = []
            for _ in options:
                full = full_ids[k]
                k += 1
                row.append(full[len(ids) :] if full[: len(ids)] == ids and len(full) > len(ids) else None)
            conts.append(row)
        single = all(c is not None and len(c) == 1 for row in conts for c in row)
        scores: list[Tensor] = []
        with eval_mode(model):
            if single:
                for start in range(0, len(prompts), batch_size):
                    logp = _last_logprobs(model, tokenizer, prompt_ids[start : start + batch_size], device)
                    for j, row in enumerate(conts[start : start + batch_size]):
                        scores.append(logp[j, [c[0] for c in row]])
            else:
                pair_scores = _sequence_logprobs(model, tokenizer, prompt_ids, choices, full_ids, batch_size)
                k = 0
                for options in choices:
                    scores.append(pair_scores[k : k + len(options)])
                    k += len(options)
        correct = []
        for s, answer in zip(scores, answers, strict=True):
            others = torch.cat([s[:answer], s[answer + 1 :]])
            correct.append(bool(s[answer] > others.max()))
        return torch.tensor(correct)

    return _load_or_compute(path, compute)


def _pad(tokenizer: PreTrainedTokenizerBase, rows: list[list[int]], device) -> tuple[Tensor, Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):  # right padding: position i of a row never attends to padding
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids.to(device), mask.to(device)


def _last_logprobs(model, tokenizer, rows: list[list[int]], device) -> Tensor:
    ids, mask = _pad(tokenizer, rows, device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    last = mask.sum(1) - 1
    return logits[torch.arange(len(rows), device=device), last].log_softmax(-1).cpu()


def _sequence_logprobs(model, tokenizer, prompt_ids, choices, full_ids, batch_size) -> Tensor:
    """Sum of log p(choice tokens | prompt) per (item, choice), with the choice's tokens taken from the full
    tokenisation after the longest common prefix with the prompt's (robust to merges at the boundary)."""
    device = next(model.parameters()).device
    starts = []
    k = 0
    for ids, options in zip(prompt_ids, choices, strict=True):
        for _ in options:
            full = full_ids[k]
            common = 0
            while common < min(len(ids), len(full) - 1) and full[common] == ids[common]:
                common += 1
            starts.append(max(common, 1))
            k += 1
    out = []
    for b in range(0, len(full_ids), batch_size):
        rows = full_ids[b : b + batch_size]
        ids, mask = _pad(tokenizer, rows, device)
        logp = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().log_softmax(-1)
        token_logp = logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).cpu()
        for j, row in enumerate(rows):
            out.append(token_logp[j, starts[b + j] - 1 : len(row) - 1].sum())
    return torch.stack(out)
