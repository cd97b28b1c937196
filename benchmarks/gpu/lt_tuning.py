"""LT-Tuning vs Coconut vs explicit CoT on SmolLM2-135M-Instruct at GPU scale: one prepared run.

The CPU study (``experiments/latent_thoughts.py``, 160 items, 30 steps per arm) could not exercise
LT-Tuning: after one epoch of CoT the model was confident on almost every token, so the curriculum inserted
almost no ``<thinking>``. This script runs the same three arms on a harder, longer task with the paper's full
curriculum:

- data: 4 operands of 2 digits, ``+`` and ``-`` evaluated left to right (3 reasoning steps per item), from the
  library's arithmetic generator; ``--num-train`` items (default 2,000), 256 held-out prompts;
- every arm: LoRA r 16 + the trainable ``<thinking>`` row, batch 64, ``1 + 2 + 2`` epochs (stage 1 CoT, 2 epochs
  at α = 1, 2 epochs of fusion α = 0.55 for LT-Tuning; Coconut 1 latent per step, fixed), bf16 mixed precision;
- τ = 0.3 / 0.2 (the paper's) by default, ``--thresholds`` to change them.

Run (on a CUDA machine with ``smollm2-135m`` fetched, ``python -m lightning_llm.backbones fetch smollm2-135m``):

    python benchmarks/gpu/lt_tuning.py --out $OUT/lt_tuning_gpu.json

Expected output: one line per arm and seed (accuracy, explicit tokens, latent steps, latent cosine and effective
rank, train seconds) and the JSON of ``experiments/latent_thoughts.py`` (same schema: ``runs``,
``summary_mean_over_seeds``, ``summary_range_over_seeds``). Sized for a few minutes per seed on one H100
(about 160 optimiser steps per arm); not yet run. Seeds run in separate calls combine with
``python experiments/latent_thoughts.py --merge a.json b.json --out both.json``. The claim holds if
LT-Tuning inserts latents (``latent_steps`` > 0), its latent cosine is below Coconut's, and its accuracy is at
least Coconut's.

The device machines this project borrows reach no network and take at most 64 MiB of carried files, so they
cannot obtain the backbone (270 MB even in bf16): run this where the package index is reachable.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_llm.evaluation.latent_thoughts import ARMS, evaluate, summarize, train_arm
from lightning_llm.text import finite_json

SETTINGS = {
    "ops": "+-",
    "digits": 2,
    "operands": 4,
    "latent_steps": 1,
    "lora_r": 16,
    "lr": 1e-3,
    "train_thinking_row": True,
    "stage_epochs": (2, 2),
    "max_length": 192,
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-eval", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--accelerator", choices=["gpu", "cpu"], default="gpu", help="cpu: a plumbing check on a small model"
    )
    parser.add_argument("--thresholds", type=float, nargs=2, default=[0.3, 0.2])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    gpu = args.accelerator == "gpu"
    if gpu and not torch.cuda.is_available():
        raise SystemExit(
            "no CUDA device: this is the GPU-scale run (--accelerator cpu only checks the plumbing)"
        )
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose another --out")
    trainer_kwargs = {"accelerator": "gpu", "precision": "bf16-mixed"} if gpu else {"accelerator": "cpu"}
    cpu0, wall0 = time.process_time(), time.perf_counter()
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
                thresholds=tuple(args.thresholds),
                trainer_kwargs=trainer_kwargs,
                **SETTINGS,
            )
            if gpu:
                module.cuda()
            evaluation = evaluate(module, data, max_new_tokens=96, batch_size=128)
            record = {"arm": arm, "seed": seed, **record, **evaluation}
            runs.append(record)
            print(
                f"{arm:>10} seed {seed}: acc {record['accuracy']:.3f} tokens {record['explicit_tokens']:.1f} "
                f"latents {record['latent_steps']:.2f} cos {record['latent_cosine']:.3f} "
                f"rank {record['latent_effective_rank']:.2f} ({record['train_seconds']} s train)",
                flush=True,
            )
            del module, data
            if gpu:
                torch.cuda.empty_cache()
    summary = summarize(runs)
    result = {
        "study": "LT-Tuning vs Coconut vs CoT, GPU scale (benchmarks/gpu/lt_tuning.py)",
        "settings": {
            "model": args.model,
            "seeds": args.seeds,
            "num_train": args.num_train,
            "num_eval": args.num_eval,
            "batch_size": args.batch_size,
            **SETTINGS,
            "thresholds": args.thresholds,
        },
        "steps_per_arm": runs[0]["steps"],
        "runs": runs,
        "summary_mean_over_seeds": summary["mean"],
        "summary_range_over_seeds": summary["range"],
        "references": None,
        "total_cpu_seconds": round(time.process_time() - cpu0, 1),
        "total_wall_seconds": round(time.perf_counter() - wall0, 1),
        "device": torch.cuda.get_device_name() if gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("x") as handle:
        handle.write(json.dumps(finite_json(result), indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
