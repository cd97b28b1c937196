"""Zero-shot greedy accuracy of a backbone on the synthetic tasks, each prompted with its own instructions.

Each setting is a task with its parameters; its held-out examples are those a ``PromptDataModule`` with
``system_prompt="task"`` validates on (the worked exchange of the prompt comes from the training split).
Completions are greedy, one turn, scored by the task's verifier. Multi-turn tasks (search, twenty questions)
are left out: a single turn cannot call their tools.

Run: ``python -m lightning_llm.studies.zero_shot --model smollm2-135m --n 32 --seeds 0 1 2 --out results.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_llm.backbones import load_backbone
from lightning_llm.datamodules import PromptDataModule

__all__ = ["SETTINGS", "zero_shot_accuracy"]

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


@torch.no_grad()
def zero_shot_accuracy(
    model: Any,
    tokenizer: Any,
    task: str,
    task_kwargs: dict[str, Any],
    *,
    n: int,
    seed: int,
    max_new_tokens: int,
    batch_size: int = 16,
) -> float:
    """Fraction of ``n`` held-out examples (DataModule seed ``seed``) that greedy decoding answers correctly."""
    data = PromptDataModule(
        task=task,
        task_kwargs=task_kwargs,
        system_prompt="task",
        num_train=64,
        num_val=n,
        seed=seed,
        batch_size=batch_size,
        max_length=2048,
        shuffle=False,
    )
    data.use_tokenizer(tokenizer)
    data.setup("fit")
    correct = 0.0
    for batch in data.val_dataloader():
        out = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(data.task.score(text, ex) for text, ex in zip(texts, batch["example"], strict=True))
    return correct / len(data.val_examples)


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
    if args.out.exists() and not args.update:
        raise SystemExit(f"{args.out} exists; remove it, choose another --out, or pass --update")
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
