"""KV eviction on natural text with SmolLM2 (docs/methods.md §11): needle accuracy and decode time under a budget.

Two measurements on a pretrained chat model (``smollm2-135m`` by default), greedy, one CPU thread:

* **Accuracy.** Needle-in-a-haystack prompts in natural English (``NeedleTask(filler="prose")``, the shipped
  prose corpus; needles at depths 0.1/0.3/0.5/0.7/0.9 of the context, the same number at each) and the multi-key
  variant (``MultiKeyNeedleTask(filler="prose")``: four "The code for X is NNNN." facts, one asked), about 512
  tokens each with the chat template. The full cache against StreamingLLM, H2O and SnapKV (their defaults: 4
  sinks, a 16-token recent window; SnapKV's 32-query observation window, max-pool kernel 5) keeping 10/25/50% of
  the longest prompt of each batch per layer, i.e. the same cache bytes for every policy. Each batch's prompt
  forward runs once (:func:`~lightning_llm.eviction.record_prefill`) and is compressed under every
  policy and budget; this equals running each separately (tested). A system prompt asks for the number;
  SmolLM2 answers "The code for X is 1234", so the score is whether the *first number* of the completion is the
  value (:func:`~lightning_llm.datamodules.needle.first_number_score`). Accuracy with a Wilson 95% interval, overall and per depth.
* **Decode time.** One prompt each of about 512/1024/2048 tokens; for the full cache and each policy at 25%,
  40 greedy decode steps after the prefill, timed per forward (process CPU time, one thread, so it does not
  count waiting for a shared core; wall time also recorded); 5 repetitions = 5 blocks of 8 consecutive steps.

``python experiments/kv_smollm2.py --out benchmarks/results/kv_smollm2.json``; ``--parts accuracy`` or
``--parts timing`` runs one part, and ``--merge A.json B.json`` combines part files into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from _results import host, read_parts, refuse_existing, write_results

from lightning_llm.backbones import load_backbone
from lightning_llm.datamodules.needle import (
    DEPTHS,
    NEEDLE_SYSTEM_PROMPT,
    encode_chat_prompts,
    first_number_score,
    nearest_depth,
    needle_examples,
)
from lightning_llm.datamodules.tasks.long_context import NeedleTask
from lightning_llm.eviction import H2O, FullCache, SnapKV, StreamingLLM, generate_with_budget, record_prefill
from lightning_llm.metrics.intervals import wilson_interval

RATIOS = (0.1, 0.25, 0.5)

POLICIES = {"streaming_llm": StreamingLLM, "h2o": H2O, "snapkv": SnapKV}


def _batch(encoded: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    length = max(len(ids) for ids in encoded)
    ids = torch.full((len(encoded), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(encoded):
        ids[row, length - len(seq) :] = torch.tensor(seq)
        mask[row, length - len(seq) :] = 1
    return ids, (None if bool(mask.all()) else mask)


def _summary(correct: list[float]) -> dict[str, Any]:
    if not correct:
        return {"accuracy": None, "n": 0, "wilson95": None}
    low, high = wilson_interval(sum(correct), len(correct))
    return {"accuracy": sum(correct) / len(correct), "n": len(correct), "wilson95": [low, high]}


def run_accuracy(
    model: Any,
    tokenizer: Any,
    task: str,
    n: int,
    words: int,
    seed: int,
    batch_size: int,
    max_new_tokens: int,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Accuracy of the full cache and every policy x ratio on ``n`` prompts of ``task``; ``progress`` gets the
    report over the prompts done so far after every batch (``"complete": False`` until the last)."""
    examples = needle_examples(task, n, words, seed)
    encoded = encode_chat_prompts(tokenizer, examples)
    order = sorted(range(len(examples)), key=lambda i: (len(encoded[i]), i))
    arms = [("full", None, None)] + [
        (name, r, cls) for name in POLICIES for r in RATIOS for cls in [POLICIES[name]]
    ]
    labels = [name if ratio is None else f"{name}@{ratio:g}" for name, ratio, _ in arms]
    correct = {label: [0.0] * len(examples) for label in labels}
    completions = {label: [""] * len(examples) for label in labels}
    budgets = {label: [0] * len(examples) for label in labels}
    peak = dict.fromkeys(labels, 0)
    cpu: dict[str, float] = dict.fromkeys(["prefill", *labels], 0.0)
    eos = tokenizer.eos_token_id

    def report(done: list[int]) -> dict[str, Any]:
        done = sorted(done)
        lengths = [len(encoded[i]) for i in done]
        rows = []
        for (name, ratio, _), label in zip(arms, labels, strict=True):
            ok = [correct[label][i] for i in done]
            row = {"arm": label, "policy": name, "ratio": ratio, **_summary(ok)}
            if task == "needle":
                row["by_depth"] = {
                    f"{d:g}": _summary([correct[label][i] for i in done if nearest_depth(examples[i]) == d])
                    for d in DEPTHS
                }
            row["peak_cache_bytes"] = peak[label]
            row["mean_budget_fraction"] = (
                None if ratio is None else statistics.fmean(budgets[label][i] / len(encoded[i]) for i in done)
            )
            row["cpu_seconds"] = round(cpu[label], 1)
            row["per_prompt_correct"] = ok
            row["completions_first_10"] = [completions[label][i] for i in done[:10]]
            rows.append(row)
        return {
            "task": task,
            "n": len(done),
            "complete": len(done) == len(examples),
            "haystack_words": words,
            "seed": seed,
            "prompt_tokens": {"mean": statistics.fmean(lengths), "min": min(lengths), "max": max(lengths)},
            "per_prompt_depth": [nearest_depth(examples[i]) if task == "needle" else None for i in done],
            "answers_first_10": [examples[i].answer for i in done[:10]],
            "prefill_cpu_seconds": round(cpu["prefill"], 1),
            "rows": rows,
        }

    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        ids, mask = _batch([encoded[i] for i in chunk], eos)
        t0 = time.process_time()
        prefill = record_prefill(model, ids, mask)
        cpu["prefill"] += time.process_time() - t0
        for (_, ratio, cls), label in zip(arms, labels, strict=True):
            policy = FullCache() if cls is None else cls()
            budget = (
                None if ratio is None else max(policy.sinks + policy.window, math.ceil(ratio * ids.shape[1]))
            )
            t0 = time.process_time()
            out = generate_with_budget(
                model,
                ids,
                mask,
                policy=policy,
                budget=budget,
                max_new_tokens=max_new_tokens,
                prefill=prefill,
                eos_token_id=eos,
                pad_token_id=eos,
            )
            cpu[label] += time.process_time() - t0
            peak[label] = max(peak[label], out.peak_cache_bytes)
            texts = tokenizer.batch_decode(out.sequences[:, ids.shape[1] :], skip_special_tokens=True)
            for i, text in zip(chunk, texts, strict=True):
                correct[label][i] = first_number_score(text, examples[i])
                completions[label][i] = text
                budgets[label][i] = budget or 0
        del prefill
        done = order[: start + len(chunk)]
        print(
            f"{task}: {len(done)}/{len(order)} " + " ".join(f"{k}={sum(correct[k]):.0f}" for k in labels),
            flush=True,
        )
        if progress is not None:
            progress(report(done))
    result = report(order)
    for row in result["rows"]:
        print(f"{task} {row['arm']:18s} {row['accuracy']:.3f} {row['wilson95']}", flush=True)
    return result


def run_timing(
    model: Any, tokenizer: Any, lengths: Sequence[int], seed: int, steps: int = 40, reps: int = 5
) -> list[dict[str, Any]]:
    """Decode ms/token against context length: one prompt per length, full cache and each policy at 25%."""
    rows = []
    for target in lengths:
        words = max(1, round((target - 45) / 1.27))
        example = NeedleTask(haystack_words=words, depth=0.5, filler="prose").generate(1, seed)[0]
        ids = torch.tensor(encode_chat_prompts(tokenizer, [example]))
        prefill = record_prefill(model, ids)
        for name, cls in [("full", None), *POLICIES.items()]:
            policy = FullCache() if cls is None else cls()
            budget = None if cls is None else math.ceil(0.25 * ids.shape[1])
            out = generate_with_budget(
                model, ids, policy=policy, budget=budget, max_new_tokens=steps + 1, prefill=prefill
            )
            decode_cpu, decode_wall = out.step_cpu_seconds[1:], out.step_seconds[1:]
            block = len(decode_cpu) // reps
            per_rep = [1000 * statistics.fmean(decode_cpu[r * block : (r + 1) * block]) for r in range(reps)]
            per_rep_wall = [
                1000 * statistics.fmean(decode_wall[r * block : (r + 1) * block]) for r in range(reps)
            ]
            row = {
                "context_tokens": int(ids.shape[1]),
                "policy": name,
                "budget": budget,
                "decode_cpu_ms_per_token": {
                    "per_rep": per_rep,
                    "median": statistics.median(per_rep),
                    "min": min(per_rep),
                    "max": max(per_rep),
                },
                "decode_wall_ms_per_token": {
                    "per_rep": per_rep_wall,
                    "median": statistics.median(per_rep_wall),
                },
                "prefill_or_compress_cpu_s": out.step_cpu_seconds[0],
            }
            rows.append(row)
            print(
                f"timing {ids.shape[1]:5d} {name:14s} {row['decode_cpu_ms_per_token']['median']:.1f} ms",
                flush=True,
            )
        del prefill
    return rows


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine part files (run as separate processes): accuracy parts of the same task are pooled prompt by prompt
    (their seeds must differ) and their summaries recomputed; timings are concatenated; CPU seconds add up."""
    result = {k: v for k, v in parts[0].items() if k not in ("accuracy", "timing", "settings", "command")}
    result["parts"] = [
        {"settings": p["settings"], "command": p["command"], "cpu_seconds": p["cpu_seconds"]} for p in parts
    ]
    result["seeds"] = sorted({seed for p in parts for seed in p["seeds"]})
    result["cpu_seconds"] = round(sum(p["cpu_seconds"] for p in parts), 1)
    result["timing"] = [row for p in parts for row in p.get("timing", [])]
    pooled: dict[str, dict[str, Any]] = {}
    for part in [a for p in parts for a in p.get("accuracy", [])]:
        if part["task"] not in pooled:
            pooled[part["task"]] = {
                **part,
                "seed": [part["seed"]],
                "prompt_tokens_parts": [part["prompt_tokens"]],
            }
            continue
        into = pooled[part["task"]]
        if part["seed"] in into["seed"]:
            raise ValueError(f"two {part['task']} parts with seed {part['seed']}")
        into["seed"].append(part["seed"])
        into["n"] += part["n"]
        into["complete"] = bool(into.get("complete", True) and part.get("complete", True))
        into["prefill_cpu_seconds"] = round(into["prefill_cpu_seconds"] + part["prefill_cpu_seconds"], 1)
        into["per_prompt_depth"] += part["per_prompt_depth"]
        into["prompt_tokens_parts"].append(part["prompt_tokens"])
        for row, other in zip(into["rows"], part["rows"], strict=True):
            row["per_prompt_correct"] = row["per_prompt_correct"] + other["per_prompt_correct"]
            row["cpu_seconds"] = round(row["cpu_seconds"] + other["cpu_seconds"], 1)
            row["peak_cache_bytes"] = max(row["peak_cache_bytes"], other["peak_cache_bytes"])
            if row["mean_budget_fraction"] is not None:
                row["mean_budget_fraction"] = (
                    row["mean_budget_fraction"] + other["mean_budget_fraction"]
                ) / 2
    for part in pooled.values():
        tokens = part.pop("prompt_tokens_parts")
        part["prompt_tokens"] = {
            "mean": statistics.fmean(t["mean"] for t in tokens),
            "min": min(t["min"] for t in tokens),
            "max": max(t["max"] for t in tokens),
        }
        for row in part["rows"]:
            row.update(_summary(row["per_prompt_correct"]))
            if part["task"] == "needle":
                row["by_depth"] = {
                    f"{d:g}": _summary(
                        [
                            c
                            for c, pd in zip(row["per_prompt_correct"], part["per_prompt_depth"], strict=True)
                            if pd == d
                        ]
                    )
                    for d in DEPTHS
                }
    result["accuracy"] = list(pooled.values())
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--parts", nargs="+", default=["accuracy", "timing"], choices=["accuracy", "timing"])
    parser.add_argument("--tasks", nargs="+", default=["needle", "multikey_needle"])
    parser.add_argument(
        "--n", type=int, nargs="+", default=[100, 50], help="prompts per task (in --tasks order)"
    )
    parser.add_argument("--words", type=int, default=380, help="filler words (~512 tokens with SmolLM2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=11)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--merge", type=Path, nargs="+", help="combine these part files into --out")
    args = parser.parse_args(argv)
    refuse_existing(args.out, args.overwrite)
    if args.merge:
        result = merge(read_parts(args.merge))
    else:
        torch.set_num_threads(1)
        torch.manual_seed(args.seed)
        start = time.process_time()
        model, tokenizer = load_backbone(args.model)
        model.eval()
        result: dict[str, Any] = {
            "study": "kv_smollm2",
            "model": args.model,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "system_prompt": NEEDLE_SYSTEM_PROMPT,
            "policies": {name: repr(cls()) for name, cls in POLICIES.items()},
            "ratios": list(RATIOS),
            "scoring": "first run of digits in the greedy completion == the needle's value",
            "seeds": [args.seed],
            "host": host(),
            "command": " ".join(sys.argv),
        }
        if "accuracy" in args.parts:
            if len(args.n) != len(args.tasks):
                raise SystemExit("--n needs one count per --tasks entry")
            result["accuracy"] = []

            def progress(part: dict[str, Any]) -> None:  # a partial file after every batch
                partial = {**result, "accuracy": [*result["accuracy"], part]}
                partial["cpu_seconds"] = round(time.process_time() - start, 1)
                write_results(args.out.with_suffix(".partial.json"), partial)

            for task, n in zip(args.tasks, args.n, strict=True):
                result["accuracy"].append(
                    run_accuracy(
                        model,
                        tokenizer,
                        task,
                        n,
                        args.words,
                        args.seed,
                        args.batch_size,
                        args.max_new_tokens,
                        progress,
                    )
                )
        if "timing" in args.parts:
            result["timing"] = run_timing(model, tokenizer, args.lengths, args.seed)
        result["cpu_seconds"] = round(time.process_time() - start, 1)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
