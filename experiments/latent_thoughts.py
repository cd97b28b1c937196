"""LT-Tuning vs Coconut vs explicit CoT on SmolLM2 with LoRA, at an equal number of optimiser steps.

The arms, their training and scoring are :mod:`lightning_llm.evaluation.latent_thoughts`'s (``cot``, ``coconut``,
``lt_tuning``; 3-operand 1-digit arithmetic, same held-out prompts). Per arm and seed it records greedy
accuracy, explicit tokens and latent steps per answer, and the collapse of the latents fed at generation
(:func:`~lightning_llm.modules.latent_collapse`: mean pairwise cosine and effective rank of each answer's chain
of latents). As references it scores the untrained backbone zero-shot,
answering directly and with a chain of thought, prompted with the task's instructions and one worked exchange
(:func:`lightning_llm.evaluation.zero_shot.zero_shot_accuracy`; its held-out prompts come from the same task and
seed, drawn by a ``PromptDataModule``).

Run: ``python experiments/latent_thoughts.py --out benchmarks/results/lt_tuning_smollm2.json``; seeds run
separately combine with ``--merge a.json b.json --out both.json``.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _results import read_parts, refuse_existing, write_results

from lightning_llm.backbones import load_backbone
from lightning_llm.evaluation.latent_thoughts import ARMS, evaluate, summarize, train_arm
from lightning_llm.evaluation.zero_shot import zero_shot_accuracy

DEFAULT_OUT = Path("benchmarks/results/lt_tuning_smollm2.json")


def _references(model: str, ops: str, n: int) -> dict[str, Any]:
    backbone, tokenizer = load_backbone(model)
    backbone.eval()
    task = {"digits": 1, "operands": 3, "ops": ops}
    start, cpu = time.perf_counter(), time.process_time()
    direct = zero_shot_accuracy(backbone, tokenizer, "arithmetic", task, n=n, seed=0, max_new_tokens=24)
    cot = zero_shot_accuracy(
        backbone, tokenizer, "arithmetic", {**task, "chain_of_thought": True}, n=n, seed=0, max_new_tokens=64
    )
    return {
        "direct_zero_shot": direct,
        "cot_zero_shot": cot,
        "prompting": "task instructions as the system message plus one worked exchange (system_prompt='task')",
        "seconds": round(time.perf_counter() - start, 1),
        "cpu_seconds": round(time.process_time() - cpu, 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole study as a JSON-ready dict (arms × seeds, their summaries, the zero-shot references)."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    settings = {
        k: getattr(args, k)
        for k in (
            "model",
            "seeds",
            "num_train",
            "num_eval",
            "batch_size",
            "ops",
            "latent_steps",
            "lora_r",
            "lr",
            "train_thinking_row",
            "thresholds",
            "max_new_tokens",
        )
    }
    runs = []
    for seed in args.seeds:
        for arm in args.arms:
            module, data, record = train_arm(
                arm,
                model=args.model,
                seed=seed,
                num_train=args.num_train,
                num_eval=args.num_eval,
                batch_size=args.batch_size,
                ops=args.ops,
                latent_steps=args.latent_steps,
                lora_r=args.lora_r,
                lr=args.lr,
                train_thinking_row=args.train_thinking_row,
                thresholds=tuple(args.thresholds),
            )
            record = {
                "arm": arm,
                "seed": seed,
                **record,
                **evaluate(module, data, max_new_tokens=args.max_new_tokens),
            }
            runs.append(record)
            print(
                f"{arm:>10} seed {seed}: acc {record['accuracy']:.3f} tokens {record['explicit_tokens']:.1f} "
                f"latents {record['latent_steps']:.2f} cos {record['latent_cosine']:.3f} "
                f"rank {record['latent_effective_rank']:.2f} ({record['train_seconds']} s train, "
                f"{record['eval_seconds']} s eval)",
                flush=True,
            )
            del module, data
            if args.partial is not None:  # progress so far, in case the run is cut short
                write_results(args.partial, {"settings": settings, "runs": runs})
    summary = summarize(runs)
    references = _references(args.model, args.ops, args.num_eval) if args.references else None
    if references:
        print(f"zero-shot: direct {references['direct_zero_shot']:.3f} CoT {references['cot_zero_shot']:.3f}")
    return {
        "study": "LT-Tuning vs Coconut vs CoT at equal optimiser steps (experiments/latent_thoughts.py)",
        "settings": settings,
        "steps_per_arm": runs[0]["steps"] if runs else 0,
        "runs": runs,
        "summary_mean_over_seeds": summary["mean"],
        "summary_range_over_seeds": summary["range"],
        "references": references,
        "total_cpu_seconds": round(time.process_time() - cpu0, 1),
        "total_wall_seconds": round(time.perf_counter() - wall0, 1),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }


def merge(paths: Sequence[Path]) -> dict[str, Any]:
    """One study from results files of the same settings run with different seeds (runs concatenated, summaries
    recomputed, the first file's references kept, CPU and wall times added). A ``--partial`` file counts with the
    seeds of the runs it holds and the times of those runs. Refuses files whose settings differ in anything but
    the seeds, or that repeat a seed."""
    studies = read_parts(paths)
    for study in studies:
        study["settings"].setdefault(
            "thresholds", [0.3, 0.2]
        )  # written before --thresholds existed: the default
        study["settings"]["seeds"] = list(dict.fromkeys(r["seed"] for r in study["runs"]))
    first = {k: v for k, v in studies[0]["settings"].items() if k != "seeds"}
    for path, study in zip(paths, studies, strict=True):
        other = {k: v for k, v in study["settings"].items() if k != "seeds"}
        if other != first:
            changed = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
            raise ValueError(f"{path}: settings differ from {paths[0]} in {changed}; only seeds may differ")
    seeds = [s for study in studies for s in study["settings"]["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"the files repeat a seed: {seeds}")
    runs = [r for study in studies for r in study["runs"]]
    summary = summarize(runs)
    references = next((s["references"] for s in studies if s.get("references")), None)

    def total(study: dict[str, Any], key: str, parts: tuple[str, str]) -> float:
        if key in study:
            return study[key]
        return sum(r[parts[0]] + r[parts[1]] for r in study["runs"])

    return {
        "study": "LT-Tuning vs Coconut vs CoT at equal optimiser steps (experiments/latent_thoughts.py)",
        **{k: v for k, v in studies[0].items() if k not in ("settings", "runs")},
        "settings": {**studies[0]["settings"], "seeds": seeds},
        "steps_per_arm": runs[0]["steps"] if runs else 0,
        "runs": runs,
        "summary_mean_over_seeds": summary["mean"],
        "summary_range_over_seeds": summary["range"],
        "references": references,
        "total_cpu_seconds": round(
            sum(total(s, "total_cpu_seconds", ("train_cpu_seconds", "eval_cpu_seconds")) for s in studies), 1
        ),
        "total_wall_seconds": round(
            sum(total(s, "total_wall_seconds", ("train_seconds", "eval_seconds")) for s in studies), 1
        ),
        "merged_from": [str(p) for p in paths],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--num-train", type=int, default=256, help="training items; 3 epochs per arm")
    parser.add_argument("--num-eval", type=int, default=64, help="held-out prompts per arm")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--ops", default="+", choices=["+", "+-"])
    parser.add_argument("--latent-steps", type=int, default=1, help="Coconut: latents per reasoning step")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--thresholds",
        type=float,
        nargs=2,
        default=[0.3, 0.2],
        metavar=("TAU2", "TAU3"),
        help="LT-Tuning: confidence below which <thinking> is inserted entering stages 2 and 3",
    )
    parser.add_argument(
        "--train-thinking-row",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train the <thinking> embedding row (lightning_llm.evaluation.latent_thoughts)",
    )
    parser.add_argument("--references", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--partial", type=Path, default=None, help="rewritten after each arm with the runs so far"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="instead of training, combine these results files (same settings, different seeds) into --out",
    )
    args = parser.parse_args(argv)
    refuse_existing(args.out, hint="remove it or choose another --out")
    # replace=False: never overwrite, even a file created meanwhile
    write_results(args.out, merge(args.merge) if args.merge else run(args), replace=False)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
