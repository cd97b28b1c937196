"""Held-out English text for a quantised model, and its perplexity and KL to the fp32 model there.

:data:`PASSAGES` (``lightning_llm/assets/quant_passages.txt``) holds original English prose passages (see the
file's header), separated by lines holding ``===``; :func:`held_out_windows` tokenises passages one by one (no
special tokens), joins them with the tokenizer's EOS and cuts them into windows. :func:`score` scores every
window's tokens after the first: perplexity ``exp(mean NLL)`` and, given the fp32 model's log-probabilities,
the KL ``Σ_v p_fp32 (log p_fp32 − log p_q)`` per scored position (nats).

:func:`densify` swaps each ``TrellisLinear`` for a dense ``nn.Linear`` holding the dequantised weights ``Ŵ``
(:func:`~lightning_llm.quantization.dequantize`): the same weights as ``TrellisLinear``'s decode-then-matmul
reference, without decoding them again on every forward (that op rotates the activations instead of the
weight, which differs only by float rounding). :func:`encode_model` quantises a copy and times the encoding.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from importlib import resources

import numpy as np
import torch
from torch import Tensor, nn

from .baselines import quantize_model_nf4
from .linear import TrellisLinear, _set_module
from .model import quantize_model
from .quantize import dequantize

__all__ = ["PASSAGES", "densify", "encode_model", "held_out_windows", "load_passages", "score"]

PASSAGES = "assets/quant_passages.txt"


def load_passages() -> list[str]:
    """The shipped passages (header lines starting with ``#`` dropped), in file order."""
    text = resources.files("lightning_llm").joinpath(PASSAGES).read_text(encoding="utf-8")
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    passages = [" ".join(p.split()) for p in body.split("\n===\n")]
    return [p for p in passages if p]


def held_out_windows(tokenizer, passages: Sequence[str], seq_len: int) -> Tensor:
    """Passages tokenised one by one, joined with EOS, cut into ``[windows, seq_len]`` (the tail is dropped)."""
    ids: list[int] = []
    for p in passages:
        ids.extend(tokenizer(p, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"{len(ids)} tokens make no window of {seq_len}")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def densify(model: nn.Module) -> nn.Module:
    """Replace every :class:`TrellisLinear` (in place) by an ``nn.Linear`` holding its dequantised weight."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, TrellisLinear):
            lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            with torch.no_grad():
                lin.weight.copy_(dequantize(mod.quantized_matrix()))
                if mod.bias is not None:
                    lin.bias.copy_(mod.bias)
            _set_module(model, name, lin.requires_grad_(False))
    return model


def encode_model(model: nn.Module, method: str, L: int, seed: int) -> tuple[nn.Module, dict[str, float]]:
    """A quantised copy of ``model`` and its encode ``{"cpu_s", "wall_s"}``."""
    q = copy.deepcopy(model)
    c0, w0 = time.process_time(), time.perf_counter()
    if method == "nf4":
        quantize_model_nf4(q)
    elif method == "rtn":
        quantize_model(q, "rtn", incoherence=False, seed=seed)
    else:
        quantize_model(q, method, L=L, seed=seed)
    return q, {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0}


@torch.no_grad()
def score(model: nn.Module, windows: Tensor, teacher_lp: np.memmap | None, batch: int) -> dict[str, float]:
    """Held-out NLL / perplexity of ``model`` on ``windows`` and, with ``teacher_lp``, the KL from it."""
    model.eval()
    nll, kl, count = 0.0, 0.0, 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i : i + batch]
        lp = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1)
        nll -= float(lp.gather(-1, ids[:, 1:].unsqueeze(-1)).sum())
        if teacher_lp is not None:
            t = torch.from_numpy(np.asarray(teacher_lp[i : i + ids.shape[0]]))
            kl += float((t.exp() * (t - lp)).sum())
        count += ids.shape[0] * (ids.shape[1] - 1)
    out = {"nll": nll / count, "perplexity": math.exp(nll / count), "scored_tokens": count}
    if teacher_lp is not None:
        out["kl_to_fp32"] = kl / count
    return out
