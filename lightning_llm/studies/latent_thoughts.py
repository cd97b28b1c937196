"""LT-Tuning vs Coconut vs explicit CoT on a real backbone with LoRA, at an equal number of optimiser steps.

Three arms are trained from the same backbone on 3-operand 1-digit arithmetic (``ArithmeticTask``, evaluated
left to right) and scored on the same held-out prompts:

- ``cot``: SFT on explicit chains of thought (``<think>3 + 4 = 7; 7 + 5 = 12</think><answer>12</answer>``).
- ``coconut``: ``latent_steps`` untrained ``<thinking>`` placeholders per reasoning step instead of the chain,
  fed back at α = 1 (the hidden state), and that fixed count forced at generation (``num_latents``).
- ``lt_tuning``: :class:`~lightning_llm.callbacks.LatentThoughtsCurriculum` with one epoch per stage (CoT, then
  ``<thinking>`` inserted before low-confidence tokens at α = 1, then the fusion at the curriculum's α, 0.6),
  and dynamic ``<thinking>`` switching at generation (a latent step whenever the argmax is ``<thinking>``).

Every arm trains ``3 × epoch`` steps on the same ``num_train`` items (the curriculum's rebuilt items are as
many), with LoRA on the attention and MLP projections. With ``--train-thinking-row`` (default on) the
``<thinking>`` row of the input embedding, which is tied to the LM head in SmolLM2, is trainable too: a
gradient hook zeroes every other row's gradient and weight decay is 0, so all other rows stay exactly the
pretrained ones (AdamW's update of a parameter entry whose gradients were always 0 is 0). The row is
initialised when the embeddings are resized (transformers' ``mean_resizing``: a draw from a normal with the
pretrained rows' mean and covariance).

Per arm and seed it records greedy accuracy, explicit tokens and latent steps per answer, and the collapse of
the latents fed at generation (:func:`~lightning_llm.modules.latent_collapse`: mean pairwise cosine and
effective rank of each answer's chain of latents). As references it scores the untrained backbone zero-shot,
answering directly and with a chain of thought, prompted with the task's instructions and one worked exchange
(:func:`lightning_llm.studies.zero_shot.zero_shot_accuracy`; its held-out prompts come from the same task and
seed, drawn by a ``PromptDataModule``).

Run: ``python -m lightning_llm.studies.latent_thoughts --out benchmarks/results/lt_tuning_smollm2.json``; seeds
run separately combine with ``--merge a.json b.json --out both.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_llm.callbacks import LatentThoughtsCurriculum
from lightning_llm.datamodules import ChatSFTDataModule
from lightning_llm.lora import LoRAConfig
from lightning_llm.modules import LatentThoughtsModule, latent_collapse
from lightning_llm.text import finite_json
from lightning_llm.trainer import quiet_trainer

__all__ = ["ARMS", "evaluate", "merge", "run", "summarize", "train_arm"]

ARMS = ("cot", "coconut", "lt_tuning")
DEFAULT_OUT = Path("benchmarks/results/lt_tuning_smollm2.json")


class _StudyModule(LatentThoughtsModule):
    """:class:`LatentThoughtsModule` whose ``<thinking>`` embedding row stays trainable under LoRA (see the module
    docstring); with ``train_thinking_row=False`` it is the plain module."""

    def __init__(self, *args: Any, train_thinking_row: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train_thinking_row = train_thinking_row

    def prepare_model(self, model: Any) -> Any:
        model = super().prepare_model(model)
        if self.train_thinking_row:
            if self.hparams.weight_decay != 0:
                raise ValueError("train_thinking_row needs weight_decay=0 (decay would move the frozen rows)")
            weight = model.get_input_embeddings().weight
            self.initial_thinking_row = weight[self.thinking_id].detach().clone()
            weight.requires_grad_(True)
            row = torch.zeros(weight.shape[0], 1, dtype=weight.dtype)
            row[self.thinking_id] = 1.0
            weight.register_hook(lambda grad: grad * row.to(grad.device))
        return model


class _InsertionLog(L.Callback):
    """Records the curriculum's ``<thinking>`` insertions at each stage change (it keeps only the last)."""

    def __init__(self, curriculum: LatentThoughtsCurriculum) -> None:
        self.curriculum = curriculum
        self.inserted: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.curriculum.stage > len(self.inserted) + 1:
            items = len(trainer.datamodule.train_items)
            self.inserted.append(
                {
                    "stage": self.curriculum.stage,
                    "inserted": self.curriculum.inserted,
                    "per_item": self.curriculum.inserted / items,
                }
            )


def _task(arm: str, ops: str, latent_steps: int, digits: int = 1, operands: int = 3) -> dict[str, Any]:
    task = {"digits": digits, "operands": operands, "ops": ops}
    return {**task, "latent_steps": latent_steps} if arm == "coconut" else {**task, "chain_of_thought": True}


def train_arm(
    arm: str,
    *,
    model: str,
    seed: int,
    num_train: int,
    num_eval: int,
    batch_size: int,
    ops: str,
    latent_steps: int,
    lora_r: int,
    lr: float,
    train_thinking_row: bool,
    thresholds: tuple[float, float] = (0.3, 0.2),
    digits: int = 1,
    operands: int = 3,
    stage_epochs: tuple[int, int] = (1, 1),
    max_length: int = 128,
    max_steps: int = -1,
    trainer_kwargs: dict[str, Any] | None = None,
) -> tuple[LatentThoughtsModule, ChatSFTDataModule, dict[str, Any]]:
    """Train one arm for ``1 + sum(stage_epochs)`` epochs (``max_steps`` caps them, for timing); returns module,
    data and its record.

    The data (train items and held-out prompts) is drawn with seed 0 for every arm and seed; ``seed`` sets the
    LoRA initialisation and the batch order. ``thresholds`` are the curriculum's confidence thresholds τ entering
    stages 2 and 3 (LT-Tuning only). The task is ``operands`` numbers of ``digits`` digits; Coconut takes
    ``latent_steps`` latents per reasoning step (``operands - 1`` steps). ``trainer_kwargs`` go to the Trainer
    (e.g. ``accelerator="gpu"``, ``precision="bf16-mixed"``).
    """
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    L.seed_everything(seed, verbose=False)
    kwargs: dict[str, Any] = {"alpha": 1.0} if arm != "lt_tuning" else {"alpha": 0.55}
    if arm == "coconut":
        kwargs["num_latents"] = latent_steps * (operands - 1)  # one reasoning step per operation
    if arm == "cot":
        kwargs["max_latent_steps"] = 0  # plain CoT decoding: never switch to a latent
    module = _StudyModule(
        model,
        lr=lr,
        weight_decay=0.0,
        lora=LoRAConfig(r=lora_r, alpha=2.0 * lora_r),
        train_thinking_row=train_thinking_row,
        **kwargs,
    )
    data = ChatSFTDataModule(
        task="arithmetic",
        task_kwargs=_task(arm, ops, latent_steps, digits, operands),
        num_train=num_train,
        num_val=num_eval,
        batch_size=batch_size,
        max_length=max_length,
        seed=0,
    )
    callbacks: list[L.Callback] = []
    log = None
    if arm == "lt_tuning":
        curriculum = LatentThoughtsCurriculum(
            stage_epochs=(1, 1), thresholds=thresholds, batch_size=batch_size
        )
        log = _InsertionLog(curriculum)
        callbacks = [curriculum, log]
    trainer = quiet_trainer(
        max_steps,
        max_epochs=1 + sum(stage_epochs),
        reload_dataloaders_every_n_epochs=1,
        callbacks=callbacks,
        **(trainer_kwargs or {}),
    )
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, data)
    record: dict[str, Any] = {
        "steps": int(trainer.global_step),
        "train_seconds": round(time.perf_counter() - start, 1),
        "train_cpu_seconds": round(time.process_time() - cpu, 1),
        "final_alpha": float(module.hparams.alpha),
    }
    if log is not None:
        record["curriculum"] = log.inserted
    module.eval()
    return module, data, record


@torch.no_grad()
def evaluate(
    module: LatentThoughtsModule,
    data: ChatSFTDataModule,
    *,
    max_new_tokens: int = 64,
    batch_size: int = 32,
) -> dict[str, Any]:
    """Greedy latent decoding of the held-out prompts: accuracy, tokens and latent steps per answer, collapse."""
    examples = list(data.val_examples)
    texts: list[str] = []
    tokens: list[int] = []
    steps: list[int] = []
    chains: list[torch.Tensor] = []
    start, cpu = time.perf_counter(), time.process_time()
    for first in range(0, len(examples), batch_size):
        chunk = examples[first : first + batch_size]
        out = module.generate_latent(
            **module.encode_prompts([ex.prompt for ex in chunk]), max_new_tokens=max_new_tokens
        )
        texts += out["texts"]
        tokens += out["explicit_tokens"]
        steps += out["latent_steps"]
        chains += [c.float().cpu() for c in out["latents"] if c.shape[0] >= 2]
    stats: dict[str, Any] = {"mean_cosine": float("nan"), "effective_rank": float("nan"), "chains": 0}
    if chains:
        width = max(c.shape[0] for c in chains)
        padded = torch.zeros(len(chains), width, chains[0].shape[1])
        keep = torch.zeros(len(chains), width, dtype=torch.bool)
        for i, chain in enumerate(chains):
            padded[i, : len(chain)], keep[i, : len(chain)] = chain, True
        stats = latent_collapse(padded, keep)
    n = len(examples)
    return {
        "accuracy": sum(data.task.score(t, ex) for t, ex in zip(texts, examples, strict=True)) / n,
        "explicit_tokens": sum(tokens) / n,
        "latent_steps": sum(steps) / n,
        "latent_cosine": stats["mean_cosine"],
        "latent_effective_rank": stats["effective_rank"],
        "latent_chains": stats["chains"],
        "examples": [{"prompt": examples[i].prompt, "completion": texts[i]} for i in range(min(3, n))],
        "eval_seconds": round(time.perf_counter() - start, 1),
        "eval_cpu_seconds": round(time.process_time() - cpu, 1),
    }


def _references(model: str, ops: str, n: int) -> dict[str, Any]:
    from lightning_llm.backbones import load_backbone
    from lightning_llm.studies.zero_shot import zero_shot_accuracy

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
                args.partial.write_text(
                    json.dumps(finite_json({"settings": settings, "runs": runs}), indent=2) + "\n"
                )
    summary = summarize(runs)
    references = _references(args.model, args.ops, args.num_eval) if args.references else None
    if references:
        print(f"zero-shot: direct {references['direct_zero_shot']:.3f} CoT {references['cot_zero_shot']:.3f}")
    return {
        "study": "LT-Tuning vs Coconut vs CoT at equal optimiser steps (lightning_llm.studies.latent_thoughts)",
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


_SUMMARY_KEYS = ("accuracy", "explicit_tokens", "latent_steps", "latent_cosine", "latent_effective_rank")


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per arm, the mean and the ``[min, max]`` over seeds of each summary figure (None where no seed has one:
    an arm that fed no latent chain has no collapse figures)."""
    mean: dict[str, dict[str, float | None]] = {}
    spread: dict[str, dict[str, list[float] | None]] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rows = [r for r in runs if r["arm"] == arm]
        mean[arm], spread[arm] = {}, {}
        for key in _SUMMARY_KEYS:
            values = [r[key] for r in rows if r[key] is not None and not math.isnan(r[key])]
            mean[arm][key] = statistics.mean(values) if values else None
            spread[arm][key] = [min(values), max(values)] if values else None
    return {"mean": mean, "range": spread}


def merge(paths: Sequence[Path]) -> dict[str, Any]:
    """One study from results files of the same settings run with different seeds (runs concatenated, summaries
    recomputed, the first file's references kept, CPU and wall times added). A ``--partial`` file counts with the
    seeds of the runs it holds and the times of those runs. Refuses files whose settings differ in anything but
    the seeds, or that repeat a seed."""
    studies = [json.loads(Path(p).read_text()) for p in paths]
    if not studies:
        raise ValueError("merge needs at least one results file")
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
        "study": "LT-Tuning vs Coconut vs CoT at equal optimiser steps (lightning_llm.studies.latent_thoughts)",
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
        "--train-thinking-row", action=argparse.BooleanOptionalAction, default=True, help="see the docstring"
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
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; remove it or choose another --out")
    result = merge(args.merge) if args.merge else run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("x") as handle:  # "x": never overwrite, even if created meanwhile
        handle.write(json.dumps(finite_json(result), indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
