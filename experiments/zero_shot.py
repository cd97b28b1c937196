"""Zero-shot greedy accuracy of a backbone on the synthetic tasks, each prompted with its own instructions.

Each setting is a task with its parameters, scored by
:func:`lightning_llm.evaluation.zero_shot.zero_shot_accuracy` on the held-out examples of a ``PromptDataModule``
with ``system_prompt="task"`` (the worked exchange of the prompt comes from the training split). Multi-turn tasks
(search, twenty questions) are left out: a single turn cannot call their tools.

    python experiments/zero_shot.py --model smollm2-135m --n 32 --seeds 0 1 2 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _results import refuse_existing, write_results

from lightning_llm.backbones import load_backbone
from lightning_llm.evaluation.zero_shot import zero_shot_accuracy

#: ``(label, task, task_kwargs, max_new_tokens)`` of the table.
SETTINGS: list[tuple[str, str, dict[str, Any], int]] = [
    *[
        (f"arithmetic {d}-digit {op}", "arithmetic", {"digits": d, "ops": op}, 24)
        for d in (1, 2, 3)
        for op in "+-*"
    ],
    *[
        (
            f"arithmetic {d}-digit {op} (CoT)",
            "arithmetic",
            {"digits": d, "ops": op, "chain_of_thought": True},
            64,
        )
        for d in (1, 2)
        for op in "+*"
    ],
    ("copy", "copy", {}, 32),
    ("word_count", "word_count", {}, 24),
    ("needle (200 words)", "needle", {}, 24),
    ("associative_recall", "associative_recall", {}, 24),
    ("latin_square", "latin_square", {}, 48),
]


def run(
    model_name: str, n: int, seeds: Sequence[int], settings: Sequence[tuple] = SETTINGS
) -> dict[str, Any]:
    """The table: per setting, the accuracy of each seed, their median and range."""
    model, tokenizer = load_backbone(model_name)
    model.eval()
    rows = []
    for label, task, kwargs, max_new in settings:
        start = time.perf_counter()
        accs = [
            zero_shot_accuracy(model, tokenizer, task, kwargs, n=n, seed=s, max_new_tokens=max_new)
            for s in seeds
        ]
        rows.append(
            {
                "setting": label,
                "task": task,
                "task_kwargs": kwargs,
                "per_seed": accs,
                "median": statistics.median(accs),
                "min": min(accs),
                "max": max(accs),
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
        print(f"{label:32s} {statistics.median(accs):6.1%}  {accs}", flush=True)
    return {"model": model_name, "n_per_seed": n, "seeds": list(seeds), "decoding": "greedy", "rows": rows}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n", type=int, default=32, help="held-out examples per seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--settings", nargs="+", help="only these settings (labels of SETTINGS)")
    parser.add_argument(
        "--update",
        action="store_true",
        help="replace those settings' rows in an existing --out, keep the rest",
    )
    args = parser.parse_args(argv)
    refuse_existing(args.out, args.update, "remove it, choose another --out, or pass --update")
    chosen = [s for s in SETTINGS if not args.settings or s[0] in args.settings]
    if args.settings and len(chosen) != len(args.settings):
        raise SystemExit(f"unknown settings; known: {[s[0] for s in SETTINGS]}")
    result = run(args.model, args.n, args.seeds, chosen)
    if args.update and args.out.exists():
        old = json.loads(args.out.read_text())
        if (old["model"], old["n_per_seed"], old["seeds"]) != (
            result["model"],
            result["n_per_seed"],
            result["seeds"],
        ):
            raise SystemExit(f"{args.out} was measured with another model, n or seeds; cannot update it")
        new = {row["setting"]: row for row in result["rows"]}
        result["rows"] = [new.pop(row["setting"], row) for row in old["rows"]] + list(new.values())
    write_results(args.out, result)


if __name__ == "__main__":
    main()
