"""KV-cache eviction at equal budgets: ``lightning_llm.eviction`` policies vs NVIDIA kvpress's presses.

One process, one model object, one set of prompts, one evaluation loop; only the cache logic differs:

* **model**, per training seed (``--seeds``, >= 3 so accuracies have a spread): the embedded tiny backbone taught
  single-needle retrieval by ``evaluation.retrieval_backbone.train_retrieval_backbone`` (40 haystack words,
  1-digit values, steps of 32 at lr 3e-3 until 98% full-cache accuracy), then frozen, and an ``IndexMemModule``
  (``budget_ratio=[0.1, 0.25, 0.5]``, 2 sinks, window 2, lr 3e-3) trained on it for ``--indexmem-steps`` steps
  (``--cache DIR`` keeps both per seed). Every generation of both sides runs through ``IndexMemModule.model``.
* **data**: ``--examples`` needle prompts (``--eval-seed``), chat-templated (73-88 tokens, ending with the
  assistant header); greedy decoding of at most ``--max-new-tokens``, stop at eos, scored by ``task.score``.
* **budget**: per prompt of ``L`` tokens, ``max(4, ceil(ratio * L))`` KV entries per layer; kvpress's
  ``compression_ratio`` is ``1 - (budget + 0.5) / L`` so it keeps exactly ``budget`` tokens too (it floors;
  checked for every generation). The whole prompt is the compressed context on both sides: kvpress's press
  wraps one prefill forward (``with press(model): model(prompt, past_key_values=DynamicCache())``), then the same
  greedy loop as ``generate_with_budget`` outside the press; ours is ``generate_with_budget``.
* **settings**: full cache on both sides (must give identical completions); per ratio kvpress
  ``StreamingLLMPress(n_sink=2)``, ``SnapKVPress(window_size=8, kernel_size=1)``, ``ExpectedAttentionPress()``
  vs ours ``StreamingLLM(2, 2)``, ``H2O(2, 2)``, ``SnapKV(2, 2, observation_window=8, kernel_size=1)``, the
  trained ``IndexerPolicy`` and indexer + ``LatentMemory``; and indexer + memory at EQUAL cache bytes: the
  largest per-prompt budget (at least its 2 sinks + 2 recent) whose KV + indexer keys + memory state fit in the
  KV bytes the best press at the first ratio keeps after prefill (the bytes row shows the measured peaks).

Differences by design: kvpress compresses once at prefill and keeps every generated token, ours re-evicts every
step (the answer digit sees the same number of prompt entries on both sides; peak bytes differ by the generated
entries). kvpress SnapKV always keeps its 8-token observation window; at 10% (8-9 slots) that window IS the
whole budget, so no choice is left: that comparison is a configuration artefact and is not in the summary
(the numbers stay in the details). ExpectedAttention keeps 4 sinks and no recency window. The indexer keys and
the memory state are state kvpress does not have: counted in the bytes rows. Time: process CPU time per example
of one pass (single thread, tiny model: per-forward Python overhead dominates); passes alternate setting order.

**SmolLM2 mode** (``--model smollm2-135m``, results ``kv_vs_kvpress_smollm2.json``): nothing is trained. Per
seed (a different draw of prompts, >= 3 seeds) ``--examples`` prose needle prompts of ``datamodules.needle``
(``NeedleTask(filler="prose")``, ``--words 380``: ~474 tokens with the chat template and its system prompt, needles
at depths 0.1/0.3/0.5/0.7/0.9, the same number at each), one prompt at a time (no padding), greedy, at most
``--max-new-tokens`` 11, scored by ``first_number_score`` (the first number of the answer is the value).
Settings: the full cache on both sides (must give identical completions); per ratio (50/25/10%) ours
``StreamingLLM()``, ``H2O()``, ``SnapKV()`` (their defaults: 4 sinks, 16 recent, SnapKV's 32-query window and
kernel 5) vs kvpress ``StreamingLLMPress(n_sink=4)``, ``SnapKVPress(window_size=32, kernel_size=5)``,
``KnormPress()``, ``ExpectedAttentionPress(n_sink=4)``. Equal cache bytes: both sides keep exactly
``budget = max(20, ceil(ratio * L))`` K and V entries per layer for a prompt of ``L`` tokens (fp32, all layers and
KV heads, so ``budget x 2 x 30 x 3 x 64 x 4`` bytes; checked for every generation); ours re-evicts at every step
and stays at ``budget``, kvpress compresses the prefill and then appends the <= 10 generated tokens. Each prompt's
forward runs once per side: ours through ``record_prefill`` (compressed under every policy, as in the study);
kvpress's through a plain forward whose attention-layer hook inputs are recorded, then every press's own
``forward_hook`` compresses a copy of that cache layer by layer, which is what ``with press(model)`` does during the
prefill (the prefill's activations do not depend on the compressed caches); for the first prompt every press at
every ratio is also run as a real pressed prefill and its cache must be identical (check
``press_replay_equals_pressed_prefill``). Rows: per-draw accuracies (median, range over draws); the details hold
the pooled accuracy with its Wilson 95% interval, per depth, and the CPU seconds per prompt of each setting.
``--cache DIR`` keeps the per-prompt outcomes so that the summary can be rebuilt without re-running.

kvpress 0.5.5 needs transformers < 5.3: run this benchmark in the ``kvpress`` environment (benchmarks/README.md).

    python benchmarks/kv_vs_kvpress.py --cache /tmp/kv_models          # 3 seeds, ~20 min on 2 cores
    python benchmarks/kv_vs_kvpress.py --model smollm2-135m            # 3 draws x 15 prompts, ~10 CPU-min
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _harness import digest, finish, parser, result, row, set_threads

NAME = "kv_vs_kvpress"
TASK = {"haystack_words": 40, "value_digits": 1}
SINKS, WINDOW = 2, 2
SNAP_OBSERVATION, SNAP_KERNEL = 8, 1
INDEXMEM_RATIOS = [0.1, 0.25, 0.5]
PRESSES = ("StreamingLLM", "SnapKV", "ExpectedAttention")
EQUAL_BYTES = "equal-bytes"


def _models(args: argparse.Namespace, seed: int, root: Path) -> Any:
    """The IndexMemModule of ``seed`` (its ``.model`` is the retrieval backbone), trained or reused from ``root``."""
    import lightning as L

    from lightning_llm.datamodules.needle import NeedleDataModule
    from lightning_llm.evaluation.retrieval_backbone import train_retrieval_backbone
    from lightning_llm.modules import IndexMemModule
    from lightning_llm.trainer import quiet_trainer

    backbone, saved = root / f"seed{seed}" / "needle_tiny", root / f"seed{seed}" / "indexmem"
    if not (backbone / "config.json").is_file():
        print(f"seed {seed}: training the retrieval backbone ...", file=sys.stderr, flush=True)
        train_retrieval_backbone(backbone, task_kwargs=TASK, seed=seed, max_steps=args.backbone_max_steps)
    if (saved / "indexmem_config.json").is_file():
        return IndexMemModule.from_pretrained(saved, model=str(backbone)).eval()
    print(
        f"seed {seed}: training IndexMemModule ({args.indexmem_steps} steps) ...", file=sys.stderr, flush=True
    )
    L.seed_everything(seed, verbose=False)
    data = NeedleDataModule(
        task="needle", task_kwargs=TASK, num_train=4000, num_val=1, batch_size=16, max_length=512, seed=100
    )
    module = IndexMemModule(str(backbone), budget_ratio=INDEXMEM_RATIOS, sinks=SINKS, window=WINDOW, lr=3e-3)
    quiet_trainer(args.indexmem_steps, default_root_dir=str(root / "trainer")).fit(module, data)
    module.save_pretrained(saved)
    return module.eval()


@dataclass
class Generation:
    sequences: torch.Tensor
    peak_kv_bytes: int
    kept_after_prefill: int | None = None
    aux_bytes: dict[str, int] = field(default_factory=dict)


def _cache_bytes(cache: Any) -> int:
    return sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
        if getattr(layer, "keys", None) is not None
    )


@torch.no_grad()
def _kvpress_generate(model: Any, input_ids: torch.Tensor, press: Any, max_new: int, eos: int) -> Generation:
    """Prefill the whole prompt inside ``with press(model):``, then greedy-decode with the compressed cache,
    mirroring ``generate_with_budget``'s loop (explicit positions of the uncompressed sequence, eos handling)."""
    from transformers import DynamicCache

    bsz = input_ids.shape[0]
    cache, finished = DynamicCache(), torch.zeros(bsz, dtype=torch.bool)
    sequences, next_input, seen, peak, kept = input_ids, input_ids, 0, 0, None
    for step in range(max_new):
        positions = torch.arange(seen, seen + next_input.shape[1]).expand(bsz, -1)
        with press(model) if (press is not None and step == 0) else contextlib.nullcontext():
            out = model(
                input_ids=next_input,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        seen += next_input.shape[1]
        peak = max(peak, _cache_bytes(cache))
        if step == 0:
            kept = int(cache.layers[0].keys.shape[-2])
            if any(int(layer.keys.shape[-2]) != kept for layer in cache.layers):
                raise RuntimeError("kvpress kept different numbers of tokens per layer")
        token = out.logits[:, -1].float().argmax(dim=-1)
        token = torch.where(finished, torch.full_like(token, eos), token)
        sequences = torch.cat([sequences, token[:, None]], dim=-1)
        finished |= token == eos
        if bool(finished.all()):
            break
        next_input = token[:, None]
    return Generation(sequences, peak, kept)


def _ours_generate(
    model: Any, ids: torch.Tensor, policy: Any, budget: int | None, memory: Any, max_new: int, eos: int
) -> Generation:
    from lightning_llm.eviction import generate_with_budget

    out = generate_with_budget(
        model,
        ids,
        policy=policy,
        budget=budget,
        max_new_tokens=max_new,
        memory=memory,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    aux: dict[str, int] = {}
    if hasattr(policy, "key_cache_bytes"):
        aux["indexer_key_bytes"] = int(policy.key_cache_bytes)
    if memory is not None:
        states = [memory.state(i) for i in range(len(memory.gates))]
        aux["memory_state_bytes"] = sum(
            s.numel() * s.element_size() + z.numel() * z.element_size() for s, z in filter(None, states)
        )
    return Generation(
        out.sequences, out.peak_cache_bytes, out.cache_stats[0].kept if policy.evicts else None, aux
    )


@dataclass
class Setting:
    name: str
    side: str  # "ours" | "kvpress"
    method: str
    ratio: float | None
    budget: Callable[[int], int | None]  # prompt length -> KV entries per layer (None: full cache)
    generate: Callable[[torch.Tensor, int | None], Generation]


def _budget(ratio: float | None) -> Callable[[int], int | None]:
    return lambda length: None if ratio is None else max(SINKS + WINDOW, math.ceil(ratio * length))


def _settings(module: Any, args: argparse.Namespace, eos: int, entry_bytes: int) -> list[Setting]:
    from kvpress import ExpectedAttentionPress, SnapKVPress, StreamingLLMPress
    from kvpress.utils import compute_n_kept

    from lightning_llm.eviction import H2O, FullCache, SnapKV, StreamingLLM

    model, max_new = module.model, args.max_new_tokens
    presses = {
        "StreamingLLM": lambda cr: StreamingLLMPress(compression_ratio=cr, n_sink=SINKS),
        "SnapKV": lambda cr: SnapKVPress(
            compression_ratio=cr, window_size=SNAP_OBSERVATION, kernel_size=SNAP_KERNEL
        ),
        "ExpectedAttention": lambda cr: ExpectedAttentionPress(compression_ratio=cr),
    }
    ours = {
        "StreamingLLM": lambda: (StreamingLLM(sinks=SINKS, window=WINDOW), None),
        "H2O": lambda: (H2O(sinks=SINKS, window=WINDOW), None),
        "SnapKV": lambda: (
            SnapKV(sinks=SINKS, window=WINDOW, observation_window=SNAP_OBSERVATION, kernel_size=SNAP_KERNEL),
            None,
        ),
        "indexer": lambda: (module.policy(), None),
        "indexer+memory": lambda: (module.policy(), module.memory),
    }

    def kv(make: Any) -> Callable[[torch.Tensor, int | None], Generation]:
        def run(ids: torch.Tensor, budget: int | None) -> Generation:
            length, press = ids.shape[1], None
            if make is not None:
                cr = 1.0 - (budget + 0.5) / length  # kvpress keeps int(L * (1 - cr)): exactly budget
                if compute_n_kept(length, cr) != budget:
                    raise RuntimeError(f"no kvpress compression_ratio keeps {budget} of {length}")
                press = make(cr)
            return _kvpress_generate(model, ids, press, max_new, eos)

        return run

    def our(make: Any) -> Callable[[torch.Tensor, int | None], Generation]:
        policy, memory = make()
        return lambda ids, budget: _ours_generate(model, ids, policy, budget, memory, max_new, eos)

    settings = [
        Setting("kvpress full cache", "kvpress", "full", None, _budget(None), kv(None)),
        Setting("ours full cache", "ours", "full", None, _budget(None), our(lambda: (FullCache(), None))),
    ]
    for ratio in args.ratios:
        pct = f"{ratio:.0%}"
        for method, make in presses.items():
            settings.append(
                Setting(f"kvpress {method} @{pct}", "kvpress", method, ratio, _budget(ratio), kv(make))
            )
        for method, make in ours.items():
            settings.append(
                Setting(f"ours {method} @{pct}", "ours", method, ratio, _budget(ratio), our(make))
            )
    # indexer + memory whose KV + indexer keys + memory state fit in the press's KV bytes after prefill
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    memory_bytes = layers * kv_heads * (head_dim * head_dim + head_dim) * 4
    per_entry = entry_bytes + layers * module.hparams.indexer_dim * 4
    press_budget = _budget(args.ratios[0])

    def equal(length: int) -> int:
        return max(SINKS + WINDOW, (press_budget(length) * entry_bytes - memory_bytes) // per_entry)

    settings.append(
        Setting(
            f"ours indexer+memory @{EQUAL_BYTES}",
            "ours",
            "indexer+memory",
            args.ratios[0],
            equal,
            our(ours["indexer+memory"]),
        )
    )
    return settings


def _groups(encoded: list[list[int]], batch_size: int) -> list[list[int]]:
    """Example indices in batches of equal prompt length (no padding, so batching changes no completion)."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_length[len(ids)].append(i)
    return [
        idx[s : s + batch_size]
        for _, idx in sorted(by_length.items())
        for s in range(0, len(idx), batch_size)
    ]


def _evaluate(
    s: Setting,
    encoded: list[list[int]],
    batches: list[list[int]],
    examples: list[Any],
    task: Any,
    tokenizer: Any,
    entry_bytes: int,
) -> dict[str, Any]:
    """One pass of a setting over every example; ``own_peaks`` = the KV bytes each example needs on its own
    (entries kept after prefill + its decoding steps up to its eos, capped at the budget for ours)."""
    n = len(examples)
    completions, correct, own_peaks, budgets, kept = [""] * n, [0.0] * n, [0] * n, [0] * n, [0] * n
    aux: dict[str, list[int]] = defaultdict(lambda: [0] * n)
    cpu = time.process_time()
    for batch in batches:
        length = len(encoded[batch[0]])
        budget = s.budget(length)
        gen = s.generate(torch.tensor([encoded[i] for i in batch]), budget)
        texts = tokenizer.batch_decode(gen.sequences[:, length:], skip_special_tokens=False)
        for r, i in enumerate(batch):
            completions[i] = texts[r].split(tokenizer.eos_token)[0]
            correct[i] = float(task.score(completions[i], examples[i]))
            budgets[i] = length if budget is None else budget
            kept[i] = length if gen.kept_after_prefill is None else gen.kept_after_prefill
            new = gen.sequences[r, length:].tolist()
            entries = kept[i] + (
                new.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in new else len(new) - 1
            )
            own_peaks[i] = (min(entries, budget) if s.side == "ours" and budget else entries) * entry_bytes
            for key, value in gen.aux_bytes.items():
                aux[key][i] = value // len(batch)
    return {
        "cpu_s": (time.process_time() - cpu) / n,
        "completions": completions,
        "accuracy": sum(correct) / n,
        "peak_kv_bytes": statistics.fmean(own_peaks),
        "budget_mean": statistics.fmean(budgets),
        "kept_equals_budget": kept == budgets,
        "aux": {k: statistics.fmean(v) for k, v in aux.items()},
    }


def _run_seed(args: argparse.Namespace, seed: int, root: Path) -> dict[str, Any]:
    from lightning_llm.datamodules.sources import render_prompt
    from lightning_llm.datamodules.tasks import get_task
    from lightning_llm.eviction import accuracy_under_budget

    module = _models(args, seed, root)
    model, tokenizer = module.model, module.tokenizer
    task = get_task("needle", **TASK)
    examples = task.generate(args.examples, args.eval_seed)
    encoded = [
        tokenizer(render_prompt(tokenizer, ex.prompt), add_special_tokens=False)["input_ids"]
        for ex in examples
    ]
    batches = _groups(encoded, args.batch_size)
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    entry_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # K + V, fp32
    settings = _settings(module, args, tokenizer.eos_token_id, entry_bytes)
    passes: dict[str, list[dict[str, Any]]] = {s.name: [] for s in settings}
    with torch.no_grad():
        for s in settings:  # one untimed warm-up generation per setting
            s.generate(torch.tensor([encoded[0]]), s.budget(len(encoded[0])))
        for rep in range(args.reps):
            for s in settings if rep % 2 == 0 else settings[::-1]:
                passes[s.name].append(_evaluate(s, encoded, batches, examples, task, tokenizer, entry_bytes))
        print(
            f"seed {seed}: " + ", ".join(f"{k} {v[0]['accuracy']:.3f}" for k, v in passes.items()),
            file=sys.stderr,
        )
        study = True
        if seed == args.seeds[0]:  # our side of the shared loop against the library's own study function
            for s in settings:
                if (
                    s.side == "ours"
                    and s.method in ("indexer", "indexer+memory")
                    and EQUAL_BYTES not in s.name
                ):
                    policy, memory = module.policy(), module.memory if s.method == "indexer+memory" else None
                    r = accuracy_under_budget(
                        model,
                        tokenizer,
                        task,
                        examples,
                        policy,
                        budget_ratio=s.ratio,
                        memory=memory,
                        max_new_tokens=args.max_new_tokens,
                    )
                    study &= r.completions == passes[s.name][0]["completions"]
    first = {name: p[0] for name, p in passes.items()}
    return {
        "settings": {
            name: {
                "accuracy": f["accuracy"],
                "peak_kv_bytes": f["peak_kv_bytes"],
                "budget_mean": f["budget_mean"],
                "aux_bytes": f["aux"],
                "cpu_s": [p["cpu_s"] for p in passes[name]],
            }
            for name, f in first.items()
        },
        "checks": {
            "full_cache_completions_identical": first["kvpress full cache"]["completions"]
            == first["ours full cache"]["completions"],
            "kept_equals_budget": all(f["kept_equals_budget"] for n, f in first.items() if "@" in n),
            "deterministic": all(
                p["completions"] == passes[n][0]["completions"] for n in passes for p in passes[n]
            ),
            "ours_loop_matches_accuracy_under_budget": study,
        },
        "inputs": digest(encoded),
        "prompt_tokens": [min(map(len, encoded)), max(map(len, encoded))],
    }


# ------------------------------------------------------------------------------------ SmolLM2 (--model)

SMOL_PRESSES = ("StreamingLLM", "SnapKV", "Knorm", "ExpectedAttention")
SMOL_OURS = ("StreamingLLM", "H2O", "SnapKV")
SMOL_SINKS, SMOL_WINDOW, SMOL_OBSERVATION, SMOL_KERNEL = 4, 16, 32, 5  # our policies' defaults (the study's)


def _record_press_prefill(model: Any, ids: torch.Tensor) -> tuple[Any, torch.Tensor, list[tuple]]:
    """One uncompressed prefill into a ``DynamicCache``; per attention layer, the ``(module, kwargs, output)`` a
    kvpress forward hook would receive, so that every press can compress this same prefill
    (:func:`_replay_press`) instead of re-running it."""
    from transformers import DynamicCache

    calls: list[tuple] = []

    def hook(module: Any, args: Any, kwargs: dict, output: Any) -> None:
        calls.append((module, {k: v for k, v in kwargs.items() if k != "past_key_values"}, output))

    layers = model.model.layers
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    cache = DynamicCache()
    try:
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return cache, out.logits[:, -1].float(), calls


def _replay_press(model: Any, full: Any, calls: list[tuple], press: Any) -> Any:
    """A copy of the full prefill cache compressed by ``press.forward_hook`` layer by layer, exactly as
    ``with press(model)`` does after each attention layer of the prefill (the prefill's hidden states do not
    depend on the compression of earlier layers' caches; checked against a real pressed prefill)."""
    import copy

    cache = copy.deepcopy(full)
    press.post_init_from_model(model)
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = model.model.rotary_emb  # what ``press(model)`` sets
    for module, kwargs, output in calls:
        press.forward_hook(module, [], {**kwargs, "past_key_values": cache}, output)
    return cache


@torch.no_grad()
def _decode(model: Any, cache: Any, logits: torch.Tensor, length: int, max_new: int, eos: int) -> list[int]:
    """Greedy decoding from a (compressed) prefill cache and the prefill's last logits, batch 1, positions of
    the uncompressed sequence, stop at eos (``_kvpress_generate``'s loop after its prefill)."""
    tokens = [int(logits[0].argmax())]
    for step in range(1, max_new):
        if tokens[-1] == eos:
            break
        out = model(
            input_ids=torch.tensor([[tokens[-1]]]),
            position_ids=torch.tensor([[length + step - 1]]),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        tokens.append(int(out.logits[0, -1].float().argmax()))
    return tokens


def _smol_settings(ratios: list[float]) -> list[tuple[str, str, str, float | None]]:
    """(name, side, method, ratio) of every setting."""
    out = [("kvpress full cache", "kvpress", "full", None), ("ours full cache", "ours", "full", None)]
    for ratio in ratios:
        out += [(f"kvpress {m}Press @{ratio:.0%}", "kvpress", m, ratio) for m in SMOL_PRESSES]
        out += [(f"ours {m} @{ratio:.0%}", "ours", m, ratio) for m in SMOL_OURS]
    return out


def _smol_seed(args: argparse.Namespace, model: Any, tokenizer: Any, seed: int) -> dict[str, Any]:
    """Every setting on the ``args.examples`` prose needle prompts drawn with ``seed`` (one prompt at a time)."""
    from kvpress import ExpectedAttentionPress, KnormPress, SnapKVPress, StreamingLLMPress
    from kvpress.utils import compute_n_kept

    from lightning_llm.datamodules.needle import (
        encode_chat_prompts,
        first_number_score,
        nearest_depth,
        needle_examples,
    )
    from lightning_llm.eviction import (
        H2O,
        FullCache,
        SnapKV,
        StreamingLLM,
        generate_with_budget,
        record_prefill,
    )

    presses = {
        "StreamingLLM": lambda cr: StreamingLLMPress(compression_ratio=cr, n_sink=SMOL_SINKS),
        "SnapKV": lambda cr: SnapKVPress(
            compression_ratio=cr, window_size=SMOL_OBSERVATION, kernel_size=SMOL_KERNEL
        ),
        "Knorm": lambda cr: KnormPress(compression_ratio=cr),
        "ExpectedAttention": lambda cr: ExpectedAttentionPress(compression_ratio=cr, n_sink=SMOL_SINKS),
    }
    ours = {"StreamingLLM": StreamingLLM, "H2O": H2O, "SnapKV": SnapKV, "full": FullCache}
    examples = needle_examples("needle", args.examples, args.words, seed)
    encoded = encode_chat_prompts(tokenizer, examples)
    eos = tokenizer.eos_token_id
    settings = _smol_settings(args.ratios)
    correct = {name: [0] * len(examples) for name, *_ in settings}
    kept_ok = {name: True for name, *_ in settings}
    cpu = dict.fromkeys(["ours prefill", "kvpress prefill", *correct], 0.0)
    replay_ok, full_ok = True, True
    for i, (ex, ids_list) in enumerate(zip(examples, encoded, strict=True)):
        ids, length = torch.tensor([ids_list]), len(ids_list)
        t0 = time.process_time()
        full, logits, calls = _record_press_prefill(model, ids)
        t1 = time.process_time()
        prefill = record_prefill(model, ids)
        cpu["kvpress prefill"] += t1 - t0
        cpu["ours prefill"] += time.process_time() - t1
        for name, side, method, ratio in settings:
            t0 = time.process_time()
            if side == "ours":
                policy = ours[method]()
                budget = (
                    None if ratio is None else max(policy.sinks + policy.window, math.ceil(ratio * length))
                )
                out = generate_with_budget(
                    model,
                    ids,
                    policy=policy,
                    budget=budget,
                    max_new_tokens=args.max_new_tokens,
                    prefill=prefill,
                    eos_token_id=eos,
                    pad_token_id=eos,
                )
                new = out.sequences[0, length:].tolist()
                if budget is not None:
                    kept_ok[name] &= out.cache_stats[0].kept == budget
            else:
                cache = full
                if ratio is not None:
                    budget = max(SMOL_SINKS + SMOL_WINDOW, math.ceil(ratio * length))  # ours' budget
                    cr = 1.0 - (budget + 0.5) / length  # kvpress keeps int(L * (1 - cr)): exactly budget
                    if compute_n_kept(length, cr) != budget:
                        raise RuntimeError(f"no kvpress compression_ratio keeps {budget} of {length}")
                    press = presses[method](cr)
                    cache = _replay_press(model, full, calls, press)
                    kept_ok[name] &= all(int(layer.keys.shape[-2]) == budget for layer in cache.layers)
                    if i == 0 and seed == args.seeds[0]:  # the replay equals a real pressed prefill
                        from transformers import DynamicCache

                        real = DynamicCache()
                        with press(model):
                            model(input_ids=ids, past_key_values=real, use_cache=True, logits_to_keep=1)
                        replay_ok &= all(
                            torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                            for a, b in zip(real.layers, cache.layers, strict=True)
                        )
                else:
                    import copy

                    cache = copy.deepcopy(full)
                new = _decode(model, cache, logits, length, args.max_new_tokens, eos)
            cpu[name] += time.process_time() - t0
            text = tokenizer.decode(new, skip_special_tokens=True)
            correct[name][i] = int(first_number_score(text, ex))
            if name == "kvpress full cache":
                full_text = text
            elif name == "ours full cache":
                full_ok &= text == full_text
        print(
            f"seed {seed} prompt {i + 1}/{len(examples)} ({length} tokens): "
            + " ".join(
                f"{n.split(' @')[0].split()[-1]}@{r or 1:g}={correct[n][i]}" for n, _, _, r in settings
            ),
            file=sys.stderr,
            flush=True,
        )
    return {
        "correct": correct,
        "depths": [nearest_depth(ex) for ex in examples],
        "kept_equals_budget": kept_ok,
        "press_replay_equals_pressed_prefill": replay_ok,
        "full_cache_completions_identical": full_ok,
        "cpu_s": cpu,
        "inputs": digest(encoded),
        "prompt_tokens": [min(map(len, encoded)), max(map(len, encoded))],
    }


def _smol_key(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("model", "seeds", "examples", "ratios", "words", "max_new_tokens")
    return {k: getattr(args, k) for k in keys}


def _smol_main(args: argparse.Namespace) -> int:
    """The SmolLM2 mode: no training; per seed a fresh draw of prose needle prompts; rows per ratio."""
    from lightning_llm.backbones import load_backbone
    from lightning_llm.datamodules.needle import DEPTHS
    from lightning_llm.metrics.intervals import wilson_interval

    name = f"{NAME}_smollm2"
    start = time.process_time()
    model, tokenizer = load_backbone(args.model)
    model.eval()
    raw = args.cache / f"{name}_raw.json" if args.cache else None
    if raw is not None and raw.is_file():  # the per-prompt results of an earlier run with these settings
        saved = json.loads(raw.read_text())
        if saved["args"] != _smol_key(args):
            raise SystemExit(f"{raw} holds another configuration: {saved['args']}")
        seeds = {int(k): v for k, v in saved["seeds"].items()}
    else:
        with torch.no_grad():
            seeds = {seed: _smol_seed(args, model, tokenizer, seed) for seed in args.seeds}
        if raw is not None:
            raw.parent.mkdir(parents=True, exist_ok=True)
            raw.write_text(json.dumps({"args": _smol_key(args), "seeds": seeds}))
    settings = _smol_settings(args.ratios)
    lo = min(s["prompt_tokens"][0] for s in seeds.values())
    hi = max(s["prompt_tokens"][1] for s in seeds.values())
    n = args.examples * len(seeds)
    unit = (
        f"{args.model}, {len(seeds)} draws x {args.examples} prose needle prompts of {lo}-{hi} tokens, "
        "fp32, cpu; values per draw"
    )

    def acc(setting: str) -> list[float]:
        return [statistics.fmean(s["correct"][setting]) for s in seeds.values()]

    def pooled(setting: str) -> dict[str, Any]:
        flat = [c for s in seeds.values() for c in s["correct"][setting]]
        depths = [d for s in seeds.values() for d in s["depths"]]
        by_depth = {}
        for d in DEPTHS:
            at = [c for c, e in zip(flat, depths, strict=True) if e == d]
            by_depth[f"{d:g}"] = statistics.fmean(at) if at else None
        return {
            "accuracy": sum(flat) / len(flat),
            "n": len(flat),
            "wilson95": list(wilson_interval(sum(flat), len(flat))),
            "per_draw": acc(setting),
            "by_depth": by_depth,
            "correct": " ".join("".join(map(str, s["correct"][setting])) for s in seeds.values()),
            "cpu_s_per_prompt": sum(s["cpu_s"][setting] for s in seeds.values()) / n,
        }

    summary = [
        row(
            name,
            f"greedy needle accuracy, full cache ({unit})",
            "ours full cache (generate_with_budget)",
            "kvpress loop, full cache",
            acc("ours full cache"),
            acc("kvpress full cache"),
            "higher",
        )
    ]
    for ratio in args.ratios:
        pct = f"{ratio:.0%}"
        metric = f"greedy needle accuracy at {pct} of the KV (equal cache bytes) ({unit})"
        for method in ("StreamingLLM", "SnapKV"):
            summary.append(
                row(
                    name,
                    metric,
                    f"{method} (eviction, re-evicts each step)",
                    f"kvpress {method}Press (prefill only)",
                    acc(f"ours {method} @{pct}"),
                    acc(f"kvpress {method}Press @{pct}"),
                    "higher",
                )
            )
        best_ours = max(SMOL_OURS, key=lambda m, pct=pct: statistics.fmean(acc(f"ours {m} @{pct}")))
        best_press = max(
            SMOL_PRESSES, key=lambda m, pct=pct: statistics.fmean(acc(f"kvpress {m}Press @{pct}"))
        )
        summary.append(
            row(
                name,
                metric,
                f"best of ours: {best_ours}",
                f"best press: kvpress {best_press}Press",
                acc(f"ours {best_ours} @{pct}"),
                acc(f"kvpress {best_press}Press @{pct}"),
                "higher",
            )
        )
    checks = {
        f"seed{seed}": {
            k: s[k]
            for k in (
                "kept_equals_budget",
                "press_replay_equals_pressed_prefill",
                "full_cache_completions_identical",
            )
        }
        for seed, s in seeds.items()
    }
    passed = all(
        all(c["kept_equals_budget"].values())
        and c["press_replay_equals_pressed_prefill"]
        and c["full_cache_completions_identical"]
        for c in checks.values()
    )
    details = {
        "pooled": {s[0]: pooled(s[0]) for s in settings},
        "prefill_cpu_s_per_prompt": {
            k: sum(s["cpu_s"][k] for s in seeds.values()) / n for k in ("ours prefill", "kvpress prefill")
        },
        "prompt_tokens": [lo, hi],
        "inputs": {f"seed{seed}": s["inputs"] for seed, s in seeds.items()},
        "total_cpu_s": time.process_time() - start,
    }
    for setting, d in details["pooled"].items():
        print(
            f"{setting:34s} {d['accuracy']:.3f} {[round(x, 3) for x in d['wilson95']]} per draw {d['per_draw']}"
        )
    config = {
        **vars(args),
        "no_write": None,
        "cache": str(args.cache),
        "sinks": SMOL_SINKS,
        "window": SMOL_WINDOW,
        "snap_observation": SMOL_OBSERVATION,
        "snap_kernel": SMOL_KERNEL,
    }
    payload = result(
        name,
        __doc__,
        summary,
        config=config,
        checks=checks,
        passed=passed,
        details=details,
        packages=("torch", "transformers", "kvpress", "lightning-llm"),
    )
    return finish(payload, args)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, reps=3)
    p.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="backbone + IndexMem training seeds"
    )
    p.add_argument(
        "--model", default="tiny", help="tiny (trained here) or a pretrained backbone, e.g. smollm2-135m"
    )
    p.add_argument(
        "--examples", type=int, default=None, help="needle prompts (per seed for a pretrained model)"
    )
    p.add_argument("--ratios", type=float, nargs="+", default=None, help="KV budgets (fractions of prompts)")
    p.add_argument("--words", type=int, default=380, help="prose filler words (pretrained model)")
    p.add_argument("--cache", type=Path, default=None, help="keep/reuse the trained models here (per seed)")
    p.add_argument("--backbone-max-steps", type=int, default=1500, help="retrieval fine-tuning steps at most")
    p.add_argument("--indexmem-steps", type=int, default=120, help="IndexMemModule steps (batch 16)")
    p.add_argument("--batch-size", type=int, default=32, help="equal-length prompts per generation")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--eval-seed", type=int, default=12345, help="seed of the held-out examples")
    args = p.parse_args(argv)
    tiny = args.model == "tiny"
    defaults = {"examples": (200, 15), "ratios": ([0.25, 0.1], [0.5, 0.25, 0.1]), "max_new_tokens": (6, 11)}
    for key, (tiny_value, pretrained_value) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny_value if tiny else pretrained_value)
    set_threads(args.threads)
    import transformers

    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 3):
        raise SystemExit(
            f"transformers {transformers.__version__}: kvpress 0.5.5 needs < 5.3 (benchmarks/README.md)"
        )
    warnings.filterwarnings(
        "ignore", message=".*(does not have many workers|set_vital|LeafSpec|in eval mode).*"
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not tiny:
        return _smol_main(args)
    with tempfile.TemporaryDirectory(prefix="kv_vs_kvpress_") as scratch:
        root = args.cache or Path(scratch)
        seeds = {seed: _run_seed(args, seed, root) for seed in args.seeds}
    if len({s["inputs"] for s in seeds.values()}) != 1:
        raise RuntimeError("the seeds evaluated different prompts")

    def acc(name: str) -> list[float]:
        return [s["settings"][name]["accuracy"] for s in seeds.values()]

    # fmt: off
    lo, hi = next(iter(seeds.values()))["prompt_tokens"]
    unit = f"{args.examples} needle prompts of {lo}-{hi} tokens, tiny, fp32, cpu, {len(seeds)} training seeds"

    def get(name: str, key: str) -> list[float]:  # one value per seed (cpu_s: one per pass and seed)
        values = [s["settings"][name][key] for s in seeds.values()]
        return [v for vs in values for v in vs] if key == "cpu_s" else values

    def total_bytes(name: str) -> list[float]:  # KV + indexer keys + memory state
        return [s["settings"][name]["peak_kv_bytes"] + sum(s["settings"][name]["aux_bytes"].values())
                for s in seeds.values()]

    summary, best = [], {}
    im, im_label = "ours indexer+memory", "IndexerPolicy + LatentMemory (IndexMemModule)"
    for ratio in args.ratios:
        pct, metric = f"{ratio:.0%}", f"greedy accuracy at a {ratio:.0%} KV budget ({unit})"
        for method in ("StreamingLLM", "SnapKV"):
            if method == "SnapKV" and SNAP_OBSERVATION >= max(SINKS + WINDOW, math.ceil(ratio * lo)):
                continue  # kvpress's observation window fills the whole budget: no choice left (docstring)
            summary.append(row(NAME, metric, f"{method} (eviction, re-evicts each step)",
                               f"kvpress {method}Press (prefill only)", get(f"ours {method} @{pct}", "accuracy"),
                               get(f"kvpress {method} @{pct}", "accuracy"), "higher"))
        best[ratio] = max(PRESSES, key=lambda m, pct=pct: statistics.fmean(get(f"kvpress {m} @{pct}", "accuracy")))
        summary.append(row(NAME, metric, im_label, f"kvpress {best[ratio]}Press (best press)",
                           get(f"{im} @{pct}", "accuracy"), get(f"kvpress {best[ratio]} @{pct}", "accuracy"), "higher"))
    pct0 = f"{args.ratios[0]:.0%}"
    press0, total_label = f"kvpress {best[args.ratios[0]]} @{pct0}", f"{im_label}: KV + indexer keys + memory state"
    press_label = f"kvpress {best[args.ratios[0]]}Press (best press at {pct0}): KV"
    entries = statistics.fmean(get(f"{im} @{EQUAL_BYTES}", "budget_mean"))
    summary += [
        row(NAME, f"peak KV-cache bytes per generation, mean, {pct0} budget ({unit})",
            "SnapKV (eviction, re-evicts each step)", "kvpress SnapKVPress (prefill only)",
            get(f"ours SnapKV @{pct0}", "peak_kv_bytes"), get(f"kvpress SnapKV @{pct0}", "peak_kv_bytes"), "lower"),
        row(NAME, f"peak cache bytes per generation, mean, {pct0} budget ({unit})", total_label, press_label,
            total_bytes(f"{im} @{pct0}"), get(press0, "peak_kv_bytes"), "lower"),
        row(NAME, f"greedy accuracy at equal cache bytes: ours' KV + indexer keys + memory within the KV the "
            f"best {pct0} press keeps (ours {entries:.1f} entries) ({unit})", im_label, press_label[:-4],
            get(f"{im} @{EQUAL_BYTES}", "accuracy"), get(press0, "accuracy"), "higher"),
        row(NAME, f"peak cache bytes per generation at that equal-bytes budget, mean ({unit})", total_label,
            press_label, total_bytes(f"{im} @{EQUAL_BYTES}"), get(press0, "peak_kv_bytes"), "lower"),
        row(NAME, f"process CPU time per example, s, {pct0} budget, batch {args.batch_size}, {args.reps} "
            f"passes x {len(seeds)} seeds ({unit})", "SnapKV via generate_with_budget",
            "kvpress SnapKVPress (prefill) + greedy loop", get(f"ours SnapKV @{pct0}", "cpu_s"),
            get(f"kvpress SnapKV @{pct0}", "cpu_s"), "lower"),
    ]
    checks = {f"seed{seed}": s["checks"] for seed, s in seeds.items()}
    details = {
        f"seed{seed}": {
            n: {k: v[k] for k in ("accuracy", "peak_kv_bytes", "budget_mean", "aux_bytes")}
            for n, v in s["settings"].items()
        }
        for seed, s in seeds.items()
    }
    passed = all(c["full_cache_completions_identical"] and c["kept_equals_budget"] for c in checks.values())
    config = {
        **vars(args),
        "no_write": None,
        "cache": str(args.cache),
        "prompts": next(iter(seeds.values()))["inputs"],
    }
    checks["best_press"] = {f"{r:.0%}": m for r, m in best.items()}
    payload = result(
        NAME,
        __doc__,
        summary,
        config=config,
        checks=checks,
        passed=passed,
        details=details,
        packages=("torch", "transformers", "kvpress", "lightning", "lightning-llm"),
    )
    # fmt: on
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
