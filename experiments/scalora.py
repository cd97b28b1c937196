"""LoRA vs ScaLoRA vs merge-and-restart LoRA: SFT of a real backbone, validation-loss curves and update rank.

Three arms fine-tune the same backbone with the same rank-``r`` adapters (all attention and MLP projections),
the same data in the same order, the same AdamW settings and learning-rate schedule:

- ``lora``: plain LoRA.
- ``scalora``: :class:`~lightning_llm.callbacks.ScaLoRA` (column rescaling before every ``interval``-th step,
  ``Lη = 10``, the scalar fallback).
- ``restart``: :class:`~lightning_llm.callbacks.LoRARestart` (merge ``s B A`` into the base weight, re-initialise
  the factors and drop their optimizer state every ``restart_interval`` steps).

The data is ``ArithmeticTask`` (2-digit operands, ``+`` and ``-``) with the task's answer format as the system
message (no worked exchange), so a conversation is about 55 tokens and a step is cheap. Data
(training items, their order, the held-out set) is drawn with seed 0 for every arm and seed; ``seed`` sets the
LoRA initialisation (and the re-initialisations of ``restart``).

Per arm and seed it records the token-mean validation loss on the fixed held-out set at step 0 and every
``val_every`` optimizer steps, the training-loss curve, greedy accuracy on the held-out prompts at the end, and
the rank of the accumulated update ``ΔW = W_t − W_0`` of every adapted layer (``W_t = W_0' + s B A``, with
``W_0'`` the base weight after any folds): its stable rank ``‖ΔW‖²_F / ‖ΔW‖²_2`` (what ``ScaLoRA`` and
``UpdateRankMonitor`` log) and its numerical rank, the number of singular values above ``rank_tol · σ_max``.
Plain LoRA's ``ΔW = s B A`` has rank at most ``r``.

Run: ``python experiments/scalora.py --out benchmarks/results/scalora_smollm2.json``. The committed
file was made by five such processes, at most two at a time (``--arms lora restart --seeds 0``, ``--arms scalora
--seeds 0``, then one per remaining arm at seed 1, each with its own ``--out``), merged with
``--combine part*.json --out benchmarks/results/scalora_smollm2.json``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _results import read_parts, refuse_existing, write_results
from typing_extensions import override

from lightning_llm.callbacks import LoRARestart, ScaLoRA
from lightning_llm.datamodules import ChatSFTDataModule
from lightning_llm.datamodules.tasks.arithmetic import ArithmeticTask
from lightning_llm.lora import LoRAConfig, iter_effective_weights
from lightning_llm.modules import CausalLMModule
from lightning_llm.trainer import quiet_trainer

__all__ = ["ARMS", "UpdateRank", "ValidationCurve", "run", "train_arm", "update_rank"]

ARMS = ("lora", "scalora", "restart")
DEFAULT_OUT = Path("benchmarks/results/scalora_smollm2.json")


@torch.no_grad()
def validation_loss(module: CausalLMModule, data: ChatSFTDataModule) -> float:
    """Token-mean NLL of the assistant responses of the held-out set (every labelled token weighs the same)."""
    was_training = module.training
    module.eval()
    total, count = 0.0, 0
    try:
        for batch in data.val_dataloader():
            logprobs, _ = module.token_logprobs({k: v.to(module.device) for k, v in batch.items()})
            total -= float(logprobs.double().sum())
            count += logprobs.numel()
    finally:
        module.train(was_training)
    if count == 0:
        raise ValueError("the held-out set has no labelled tokens")
    return total / count


class ValidationCurve(L.Callback):
    """Validation loss before training and every ``every`` optimizer steps; training loss of every step.

    Attributes:
        val: ``[(optimizer step, validation loss)]``.
        train: training loss of each step, in order.
        val_seconds: wall seconds spent in validation.
    """

    def __init__(self, data: ChatSFTDataModule, every: int) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.data = data
        self.every = every
        self.val: list[tuple[int, float]] = []
        self.train: list[float] = []
        self.val_seconds = 0.0

    def _measure(self, pl_module: L.LightningModule, step: int) -> None:
        start = time.perf_counter()
        self.val.append((step, validation_loss(pl_module, self.data)))
        self.val_seconds += time.perf_counter() - start

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._measure(pl_module, trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.train.append(float(outputs["loss"]))
        step = trainer.global_step
        if step % self.every == 0 or step == trainer.max_steps:
            self._measure(pl_module, step)


class UpdateRank(L.Callback):
    """Keeps an fp32 CPU copy of every adapted layer's effective weight at the start of training."""

    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = {name: w.cpu().clone() for name, w in iter_effective_weights(pl_module)}
        if not self.initial:
            raise ValueError("UpdateRank needs a model with LoRA layers")


@torch.no_grad()
def update_rank(module: torch.nn.Module, initial: dict[str, torch.Tensor], rank_tol: float) -> dict[str, Any]:
    """Stable and numerical rank of ``W_t − W_0`` per adapted layer, and their means over layers.

    The numerical rank counts singular values above ``rank_tol`` times the largest; a zero update has rank 0.
    """
    stable, numerical = {}, {}
    for name, weight in iter_effective_weights(module):
        sv = torch.linalg.svdvals(weight.cpu() - initial[name])
        top = float(sv[0])
        stable[name] = float((sv.square().sum() / sv[0] ** 2).item()) if top > 0 else 0.0
        numerical[name] = int((sv > rank_tol * top).sum()) if top > 0 else 0
    kinds: dict[str, list[float]] = {}
    for name, value in stable.items():
        kinds.setdefault(name.rsplit(".", 1)[-1], []).append(value)
    return {
        "stable_rank_mean": statistics.mean(stable.values()),
        "stable_rank_max": max(stable.values()),
        "numerical_rank_mean": statistics.mean(numerical.values()),
        "numerical_rank_max": max(numerical.values()),
        "stable_rank_mean_by_projection": {k: statistics.mean(v) for k, v in sorted(kinds.items())},
        "layers": len(stable),
    }


def _callbacks(arm: str, args: argparse.Namespace) -> list[L.Callback]:
    if arm == "lora":
        return []
    if arm == "scalora":
        return [ScaLoRA(interval=args.scalora_interval, rank_every=0)]
    if arm == "restart":
        return [LoRARestart(interval=args.restart_interval)]
    raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")


def make_data(args: argparse.Namespace) -> ChatSFTDataModule:
    """The SFT data of every arm and seed (seed 0: same items, order and held-out set)."""
    return ChatSFTDataModule(
        task="arithmetic",
        task_kwargs={"digits": args.digits, "ops": args.ops},
        system_prompt=ArithmeticTask.answer_format,
        num_train=args.steps * args.batch_size,
        num_val=args.num_val,
        batch_size=args.batch_size,
        max_length=args.max_length,
        seed=0,
    )


@torch.no_grad()
def greedy_accuracy(module: CausalLMModule, data: ChatSFTDataModule, max_new_tokens: int) -> dict[str, Any]:
    """Greedy completions of the held-out prompts (same prompt prefix as training), scored by the task."""
    examples = list(data.val_examples)
    texts: list[str] = []
    for first in range(0, len(examples), 32):
        chunk = examples[first : first + 32]
        texts += module.generate(
            [ex.prompt for ex in chunk], max_new_tokens=max_new_tokens, system_prompt=data.system_prompt
        )
    score = sum(data.task.score(t, ex) for t, ex in zip(texts, examples, strict=True)) / len(examples)
    return {
        "accuracy": score,
        "examples": [
            {"prompt": examples[i].prompt, "completion": texts[i]} for i in range(min(3, len(texts)))
        ],
    }


def train_arm(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Fine-tune one arm for ``args.steps`` optimizer steps; returns its record (curves, accuracy, rank, cost)."""
    callbacks = _callbacks(arm, args)
    L.seed_everything(seed, verbose=False)
    module = CausalLMModule(
        args.model,
        lr=args.lr,
        weight_decay=0.0,
        warmup_ratio=args.warmup_ratio,
        min_lr_ratio=args.min_lr_ratio,
        lora=LoRAConfig(r=args.lora_r, alpha=args.lora_alpha),
    )
    data = make_data(args)
    curve, rank = ValidationCurve(data, args.val_every), UpdateRank()
    trainer = quiet_trainer(args.steps, max_epochs=-1, callbacks=[rank, curve, *callbacks])
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, data)
    train_cpu = time.process_time() - cpu
    record: dict[str, Any] = {
        "arm": arm,
        "seed": seed,
        "steps": int(trainer.global_step),
        "val_loss": curve.val,
        "final_val_loss": curve.val[-1][1],
        "train_loss": curve.train,
        "train_wall_seconds": round(time.perf_counter() - start, 1),
        "train_cpu_seconds": round(train_cpu, 1),
        "val_wall_seconds": round(curve.val_seconds, 1),
    }
    if arm == "scalora":
        counts = callbacks[0].counts
        record["scalora_rescales"] = dict(counts)
        record["scalora_fallback_rate"] = counts["scalar"] / max(1, sum(counts.values()))
    if arm == "restart":
        record["restarts"] = callbacks[0].restarts
    cpu = time.process_time()
    record["update_rank"] = update_rank(module, rank.initial, args.rank_tol)
    record.update(greedy_accuracy(module, data, args.max_new_tokens))
    record["eval_cpu_seconds"] = round(time.process_time() - cpu, 1)
    return record


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "spread": max(values) - min(values),
    }


def summarise(runs: list[dict[str, Any]], arms: Sequence[str]) -> dict[str, Any]:
    """Per arm: median, min, max and spread over seeds of the final validation loss, accuracy and ranks, and for
    the other arms the per-seed difference of the final validation loss from plain LoRA's."""
    summary = {}
    for arm in arms:
        rows = [r for r in runs if r["arm"] == arm]
        if not rows:
            continue
        summary[arm] = {
            "seeds": [r["seed"] for r in rows],
            "final_val_loss": _spread([r["final_val_loss"] for r in rows]),
            "accuracy": _spread([r["accuracy"] for r in rows]),
            "stable_rank_mean": _spread([r["update_rank"]["stable_rank_mean"] for r in rows]),
            "numerical_rank_mean": _spread([r["update_rank"]["numerical_rank_mean"] for r in rows]),
            "train_cpu_seconds": _spread([r["train_cpu_seconds"] for r in rows]),
        }
        lora = {r["seed"]: r["final_val_loss"] for r in runs if r["arm"] == "lora"}
        paired = [r["final_val_loss"] - lora[r["seed"]] for r in rows if r["seed"] in lora]
        if arm != "lora" and paired:
            # Same seed = same LoRA initialisation and data: the per-seed difference is the paired effect.
            summary[arm]["final_val_loss_minus_lora"] = {"per_seed": paired, **_spread(paired)}
    return summary


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "model",
        "arms",
        "seeds",
        "steps",
        "batch_size",
        "digits",
        "ops",
        "num_val",
        "max_length",
        "lora_r",
        "lora_alpha",
        "lr",
        "warmup_ratio",
        "min_lr_ratio",
        "scalora_interval",
        "restart_interval",
        "val_every",
        "rank_tol",
        "max_new_tokens",
    )
    return {k: getattr(args, k) for k in keys}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole study as a JSON-ready dict (seeds × arms, their summary, cost and host)."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    settings = _settings(args)
    runs: list[dict[str, Any]] = []
    for seed in args.seeds:
        for arm in args.arms:
            record = train_arm(arm, seed, args)
            runs.append(record)
            print(
                f"{arm:>8} seed {seed}: val {record['val_loss'][0][1]:.3f} -> {record['final_val_loss']:.3f} "
                f"acc {record['accuracy']:.3f} stable rank {record['update_rank']['stable_rank_mean']:.2f} "
                f"numerical rank {record['update_rank']['numerical_rank_mean']:.1f} "
                f"({record['train_cpu_seconds']} CPU-s train)",
                flush=True,
            )
            if args.partial is not None:  # progress so far, in case the run is cut short
                write_results(args.partial, {"settings": settings, "runs": runs})
    return {
        "study": "LoRA vs ScaLoRA vs LoRA-restart SFT (experiments/scalora.py)",
        "settings": settings,
        "data": (
            "arithmetic (2-digit operands), answer format as the system message; data seed 0 for every run, "
            "seed = LoRA initialisation"
        ),
        "runs": runs,
        "summary": summarise(runs, args.arms),
        "total_cpu_seconds": round(time.process_time() - cpu0, 1),
        "total_wall_seconds": round(time.perf_counter() - wall0, 1),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
    }


def combine(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from runs of the study made in separate processes (e.g. one per seed or arm), equal settings.

    A part is a result file or a ``--partial`` file (settings and the runs finished so far). Runs are ordered by
    seed, then arm. ``total_cpu_seconds`` is the sum over runs of their training and evaluation CPU seconds
    (process start-up is not counted); wall time is not summed, since the processes overlapped. Host and
    library details come from the first complete result file.
    """
    if not parts:
        raise ValueError("nothing to combine")
    first = {k: v for k, v in parts[0]["settings"].items() if k not in ("seeds", "arms")}
    for part in parts[1:]:
        other = {k: v for k, v in part["settings"].items() if k not in ("seeds", "arms")}
        if other != first:
            raise ValueError(f"settings differ: {first} vs {other}")
    order = {arm: i for i, arm in enumerate(ARMS)}
    runs = sorted((r for p in parts for r in p["runs"]), key=lambda r: (r["seed"], order[r["arm"]]))
    keys = [(r["seed"], r["arm"]) for r in runs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a (seed, arm) run appears twice: {keys}")
    arms = [arm for arm in ARMS if any(r["arm"] == arm for r in runs)]
    base = next((p for p in parts if "study" in p), None)
    if base is None:
        raise ValueError("at least one part must be a complete result file (host and library details)")
    return {
        **base,
        "settings": {**base["settings"], "seeds": sorted({r["seed"] for r in runs}), "arms": arms},
        "runs": runs,
        "summary": summarise(runs, arms),
        "total_cpu_seconds": round(sum(r["train_cpu_seconds"] + r["eval_cpu_seconds"] for r in runs), 1),
        "total_wall_seconds": None,
        "processes": len(parts),
    }


def build_parser() -> argparse.ArgumentParser:
    """The study's command-line options (defaults: the committed run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per arm (one epoch)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--ops", default="+-")
    parser.add_argument("--num-val", type=int, default=32, help="held-out items (loss and greedy accuracy)")
    parser.add_argument("--max-length", type=int, default=160)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-ratio", type=float, default=0.05)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--scalora-interval", type=int, default=1)
    parser.add_argument("--restart-interval", type=int, default=10)
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--rank-tol", type=float, default=1e-2, help="numerical rank: σ > rank_tol · σ_max")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument(
        "--partial", type=Path, default=None, help="rewritten after each run with the runs so far"
    )
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        default=None,
        help="merge these result files (same settings, e.g. one process per seed) into --out; trains nothing",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    refuse_existing(args.out, args.overwrite)
    write_results(args.out, combine(read_parts(args.combine)) if args.combine else run(args))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
