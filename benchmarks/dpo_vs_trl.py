"""DPO training throughput, peak memory and loss: ``lightning_llm`` ``DPOModule`` vs TRL's ``DPOTrainer``.

Both libraries train the same policy on the same preference pairs with the same hyper-parameters; a step is
everything a library does between two optimizer updates: collate a batch of ``B`` pairs, the policy forward
over chosen + rejected (one stacked batch on both sides), the frozen reference forward under ``no_grad``,
sequence log-probs, the sigmoid DPO loss, backward, gradient clipping, ``optimizer.step()`` and each
framework's per-step bookkeeping (Lightning's loop and ``self.log``; the HF Trainer loop, TRL's metric
buffers and its per-step log, which is how the loss of every step is read back). Step time is the wall-clock
interval between the ends of two consecutive steps (Lightning ``on_train_batch_end``; HF ``on_step_end``);
the first ``--warmup`` steps are dropped, and throughput is ``B × steps / (sum of the timed intervals)``.
Model loading, data building and tokenisation happen before the first step and are not timed.

Each framework runs in its own fresh interpreter per repetition (``--reps``, interleaved, alternating which
goes first), so imports, allocator state and RSS high-water marks cannot leak between them.

Matched (the same on both sides):

* model: the embedded tiny Llama backbone; ours loads it with ``load_backbone("tiny")``, TRL from the same
  ``_tiny_dir()`` directory by path (so both start from identical weights), fp32, no gradient checkpointing
  (TRL's default is on: turned off), no bf16 autocast (TRL's default: turned off), no dropout (the model has
  none; TRL ``disable_dropout``). The reference is a frozen copy of the initial policy on both sides (ours
  deep-copies it, TRL loads the same directory again);
* data: ``HoneypotPreferenceDataModule(negatives="honeypot", tokenizer="tiny", max_length=...)``; TRL gets a
  conversational ``datasets.Dataset`` (``prompt = [user]``, ``chosen``/``rejected`` = ``[assistant]``) of
  exactly the pairs the DataModule kept — rebuilt with ``honeypot_pairs`` from the DataModule's own train
  examples and seed, and checked pair by pair against the DataModule's token ids — in the same order (ours
  ``shuffle=False``; TRL ``train_sampling_strategy="sequential"``), so step ``k`` sees the same ``B`` pairs on
  both sides. Both render with the same ChatML template; the TRL worker compares TRL's tokenised dataset with
  the DataModule's items (``checks.tokens``);
* objective: sigmoid DPO, ``beta``, no label smoothing, no SFT/RPO term (ours ``sft_weight=0``), the loss is
  the mean over the batch's pairs; sequence log-probs are sums over response tokens;
* optimiser: ``torch.optim.AdamW`` (TRL ``optim="adamw_torch"``), same lr, betas (0.9, 0.999), eps 1e-8,
  weight decay 0, constant LR with no warm-up (ours ``warmup_ratio=0, min_lr_ratio=1``; TRL
  ``lr_scheduler_type="constant"``), gradient clipping at norm 1.0 (Lightning ``gradient_clip_val``; TRL
  ``max_grad_norm``);
* no evaluation, checkpointing, reporters or progress bars; ``use_cpu=True``; the same torch thread count in
  both workers (one by default: on a small shared machine OpenMP threads that compete with other jobs for
  two cores spin-wait on each other and swamp any difference; ``--threads 0`` keeps torch's default).

Not matched (each library as it is):

* trained tokens: our DataModule labels the response up to and including ``<|im_end|>``; the ``"\\n"`` the
  ChatML template writes after it stays in the input unlabelled. TRL's completion is everything after the
  generation prompt, so it also scores that trailing ``"\\n"``: one more log-prob term per sequence
  (``checks.tokens`` counts it). The input sequences are identical, so the forward work is the same; the loss
  at step 0 is log 2 on both sides whatever the tokens (policy = reference), and later losses differ slightly;
* how log-probs are computed is each library's own design: ours runs the decoder then the fused log-prob
  kernel on labelled tokens only; TRL patches the model with its chunked fused LM head, which on CPU scores
  every position and masks afterwards;
* the loss of every step is read from each library's own log: Lightning's step output (ours) and TRL's
  ``logging_steps=1`` log history, whose per-step ``.item()`` and metric gathering are inside TRL's timed
  window (ours logs its seven DPO scalars with ``self.log`` every step as well);
* baseline memory differs by framework (Lightning vs HF Trainer + Accelerate imports); only the increase over
  each process's own pre-training RSS is compared (absolute numbers are recorded too).

Usage (from the repository root, in an environment with ``trl``)::

    python benchmarks/dpo_vs_trl.py                      # 8 pairs/step, 2 warm-up + 20 timed steps, 3 reps
    python benchmarks/dpo_vs_trl.py --batch-size 16 --steps 10 --reps 5
    python benchmarks/dpo_vs_trl.py --quick              # smoke run: 1 rep × 5 steps, prints, writes nothing

Writes ``benchmarks/results/dpo_vs_trl.json`` (``--no-write`` to skip). Exits 1 if a correctness check fails
(step-0 loss not log 2 on either side, or the pairs/prompt tokens of the two sides differ).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from typing import Any

from _common import (
    StepRecorder,
    machine_info,
    package_versions,
    spawn_worker,
    summary_row,
    utc_now,
    write_result,
)

NAME = "dpo_vs_trl"
FRAMEWORKS = ("ours", "trl")
LOG2 = math.log(2.0)
LOSS0_TOLERANCE = (
    1e-4  # |step-0 loss - log 2| allowed (policy = reference, so it is log 2 up to fp32 rounding)
)
BETAS = (0.9, 0.999)
EPS = 1e-8
MAX_GRAD_NORM = 1.0

MEASUREMENT = {
    "throughput": "per repetition, a fresh process per framework trains warmup + steps DPO steps; a step's "
    "time is the wall-clock interval between the ends of consecutive optimisation steps (Lightning "
    "on_train_batch_end / HF on_step_end; the first from the train-start hook), covering collation, policy and "
    "reference forwards, loss, backward, clipping, optimizer step and per-step bookkeeping. Warm-up steps are "
    "dropped; pairs/s = batch_size x timed steps / sum of timed intervals. Reported: median over repetitions "
    "(min/max and every step kept)",
    "memory_cpu": "baseline = RSS (psutil) right before trainer.fit / trainer.train, after model, reference, "
    "data and trainer are built (gc.collect() first). At the end of the last warm-up step the kernel's RSS "
    "high-water mark is reset (/proc/self/clear_refs = 5); peak_mib = VmHWM after the timed steps - baseline "
    "(optimizer state, gradients, activations of a steady-state step); ru_maxrss over the process lifetime "
    "where VmHWM cannot be reset. Reported: median over repetitions",
    "loss": "the DPO loss of each optimisation step as the library reports it (computed before that step's "
    "update): ours from the training_step output, TRL from its log history (logging_steps=1). Step 0 must be "
    "log 2 (policy = reference); 'final' is the loss of the last step. Same pairs in the same order on both "
    "sides; RNG plays no role (no dropout, no sampling), so repetitions agree up to thread-count effects",
}


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=8, help="preference pairs per optimisation step")
    parser.add_argument("--max-length", type=int, default=96, help="token budget of one side of a pair")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per repetition")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (fresh processes per framework)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads in both workers (0: torch's default, one per core); see the module docstring",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 rep, 1 warm-up + 5 timed steps, implies --no-write"
    )
    parser.add_argument(
        "--no-write", action="store_true", help="print the result instead of writing the JSON"
    )
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)  # internal: run one framework
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.warmup, args.steps, args.no_write = 1, 1, 5, True
    if args.steps < 3 or args.reps < 1 or args.warmup < 1:
        parser.error("need --steps >= 3, --reps >= 1 and --warmup >= 1")
    if args.batch_size < 1 or args.beta <= 0 or args.lr <= 0:
        parser.error("--batch-size, --beta and --lr must be positive")
    return args


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The resolved settings (``--quick`` applied) as the command line of a worker."""
    return [
        f"--batch-size={args.batch_size}",
        f"--max-length={args.max_length}",
        f"--beta={args.beta}",
        f"--lr={args.lr}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        "--reps=1",
        f"--seed={args.seed}",
        f"--threads={args.threads}",
    ]


# ------------------------------------------------------------------------------------------------ data


def _total_steps(args: argparse.Namespace) -> int:
    return args.warmup + args.steps


def _datamodule(args: argparse.Namespace) -> Any:
    """The honeypot preference pairs, in a fixed order; one epoch covers every step (>= 1 pair per example)."""
    from lightning_llm.datamodules import HoneypotPreferenceDataModule

    dm = HoneypotPreferenceDataModule(
        negatives="honeypot",
        tokenizer="tiny",
        num_train=args.batch_size * _total_steps(args),
        num_val=0,
        batch_size=args.batch_size,
        max_length=args.max_length,
        seed=args.seed,
        shuffle=False,
    )
    dm.prepare_data()
    dm.setup("fit")
    if len(dm._train_data) < args.batch_size * _total_steps(args):
        raise RuntimeError(f"only {len(dm._train_data)} pairs for {_total_steps(args)} steps")
    return dm


def _kept_pairs(dm: Any) -> list[Any]:
    """The DataModule's training pairs, rebuilt from its own examples and seed, minus the ones it dropped.

    ``honeypot_pairs`` is what the DataModule calls in ``_pairs`` (seed ``2 * seed`` for the train split); a
    pair is kept when both sides keep a response token within ``max_length`` (its ``_encode`` / ``_truncate``).
    Every kept pair is checked against the DataModule's item token by token (ids and labels), so a change in
    how it builds pairs fails loudly instead of feeding TRL different data.
    """
    import torch

    from lightning_llm.datamodules.preference import honeypot_pairs
    from lightning_llm.datamodules.tasks import Example, split_train_val

    hp = dm.hparams
    train, _ = split_train_val(dm.task, hp.num_train, hp.num_val, hp.seed)
    pairs = honeypot_pairs(
        dm.task,
        train,
        negatives=hp.negatives,
        honeypot_role=hp.honeypot_role,
        honeypot_fraction=hp.honeypot_fraction,
        seed=2 * hp.seed,
    )
    items = dm._train_data
    kept = []
    for pair in pairs:
        sides = dm._encode([Example(pair.prompt, pair.chosen, ""), Example(pair.prompt, pair.rejected, "")])
        truncated = [dm._truncate(*side) for side in sides]
        if any(side is None for side in truncated):
            continue  # the DataModule drops this pair too
        index = len(kept)
        same = index < len(items) and all(
            torch.equal(truncated[k][field], items[index][f"{side}_{field}"])
            for k, side in enumerate(("chosen", "rejected"))
            for field in ("input_ids", "labels")
        )
        if not same:
            raise RuntimeError(f"rebuilt pair {index} differs from the DataModule's item {index}")
        kept.append(pair)
    if len(kept) != len(items):
        raise RuntimeError(f"rebuilt {len(kept)} pairs, the DataModule has {len(items)}")
    return kept


def _trl_dataset(pairs: list[Any]) -> Any:
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p.prompt}] for p in pairs],
            "chosen": [[{"role": "assistant", "content": p.chosen}] for p in pairs],
            "rejected": [[{"role": "assistant", "content": p.rejected}] for p in pairs],
        }
    )


def _token_check(dm: Any, trl_dataset: Any, max_length: int, n: int) -> dict[str, Any]:
    """Compare TRL's tokenised training rows (prompt_ids/chosen_ids/rejected_ids) with the DataModule's items.

    Per side of the first ``n`` pairs (the ones trained on): are the input sequences identical (TRL's
    ``prompt_ids + completion_ids`` cut to ``max_length`` as its collator does), and which tokens does each
    score (ours: labels != -100; TRL: the completion positions)?
    """
    from lightning_llm.datamodules.sources import IGNORE_INDEX

    tokenizer = dm.tokenizer
    counts = {"sequences_identical": 0, "scored_identical": 0, "trl_scores_ours_plus_suffix": 0, "other": 0}
    extra_tokens: dict[str, int] = {}
    compared = 0
    for item, row in zip(dm._train_data[:n], trl_dataset.select(range(n)), strict=True):
        for side in ("chosen", "rejected"):
            compared += 1
            ours_ids = item[f"{side}_input_ids"].tolist()
            ours_labels = item[f"{side}_labels"].tolist()
            trl_ids = (row["prompt_ids"] + row[f"{side}_ids"])[:max_length]
            trl_scored = [len(row["prompt_ids"]) <= i for i in range(len(trl_ids))]
            ours_scored = [label != IGNORE_INDEX for label in ours_labels]
            if trl_ids == ours_ids:
                counts["sequences_identical"] += 1
            if trl_ids == ours_ids and trl_scored == ours_scored:
                counts["scored_identical"] += 1
            elif (
                trl_ids == ours_ids
                and all(t or not o for t, o in zip(trl_scored, ours_scored, strict=True))
                and ours_scored.index(True) == trl_scored.index(True)
            ):
                counts["trl_scores_ours_plus_suffix"] += 1
                extra = tokenizer.decode(
                    [t for t, a, b in zip(trl_ids, trl_scored, ours_scored, strict=True) if a and not b]
                )
                extra_tokens[extra] = extra_tokens.get(extra, 0) + 1
            else:
                counts["other"] += 1
    lengths = [len(item["chosen_input_ids"]) for item in dm._train_data[:n]]
    lengths += [len(item["rejected_input_ids"]) for item in dm._train_data[:n]]
    return {
        "sides_compared": compared,
        **counts,
        "extra_tokens_trl_scores": extra_tokens,
        "sequence_tokens_min_max": [min(lengths), max(lengths)],
        "truncated_sides": sum(length == max_length for length in lengths),
    }


# ------------------------------------------------------------------------------------------- recording


class _Recorder(StepRecorder):
    """Step timing and memory (:class:`StepRecorder`) plus the loss of each step."""

    def __init__(self, warmup: int) -> None:
        super().__init__(warmup)
        self.losses: list[float] = []
        self._loss: float | None = None

    def step_end(self, loss: float | None = None) -> None:
        self._loss = loss
        super().step_end()

    def _record(self) -> None:
        if self._loss is not None:
            self.losses.append(self._loss)

    def result(self, batch_size: int) -> dict[str, Any]:
        timed = self.timed
        return {
            "pairs_per_s": batch_size * len(timed) / sum(timed),
            "time_s": {
                "median_step": statistics.median(timed),
                "min_step": min(timed),
                "steps": timed,
                "warmup_steps": self.intervals[: self.warmup],
            },
            "memory": self.memory(),
            "losses": self.losses,
            "torch_threads": sorted(set(self.threads)),
        }


def _optimizer_settings(optimizer: Any) -> dict[str, Any]:
    """What the optimizer actually uses: per-parameter-group values (the constructor defaults may differ)."""
    groups = optimizer.param_groups
    return {
        "class": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        "betas": sorted({tuple(g["betas"]) for g in groups}),
        "eps": sorted({g["eps"] for g in groups}),
        "weight_decay": sorted({g["weight_decay"] for g in groups}),
        "lr_at_end": sorted({g["lr"] for g in groups}),
        "foreach_fused": sorted({(bool(g.get("foreach")), bool(g.get("fused"))) for g in groups}),
    }


# ------------------------------------------------------------------------------------------------- ours


def _run_ours(args: argparse.Namespace, recorder: _Recorder) -> dict[str, Any]:
    import lightning as L

    from lightning_llm.modules import DPOModule

    L.seed_everything(args.seed, verbose=False)
    dm = _datamodule(args)
    module = DPOModule(
        model="tiny",
        beta=args.beta,
        label_smoothing=0.0,
        sft_weight=0.0,
        lr=args.lr,
        weight_decay=0.0,
        betas=BETAS,
        warmup_ratio=0.0,
        min_lr_ratio=1.0,
        dtype="float32",
    )

    class Timer(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            recorder.train_start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *_: Any) -> None:
            recorder.step_end(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=_total_steps(args),
        gradient_clip_val=MAX_GRAD_NORM,
        gradient_clip_algorithm="norm",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Timer()],
    )
    recorder.before_fit()
    trainer.fit(module, datamodule=dm)
    if trainer.global_step != _total_steps(args):
        raise RuntimeError(f"ours ran {trainer.global_step} optimizer steps, expected {_total_steps(args)}")
    optimizer = trainer.optimizers[0]
    return {
        "param_dtype": str(next(module.model.parameters()).dtype),
        "optimizer_steps": trainer.global_step,
        "optimizer": _optimizer_settings(optimizer),
        "final_lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0],
    }


# -------------------------------------------------------------------------------------------------- TRL


def _run_trl(args: argparse.Namespace, recorder: _Recorder) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from lightning_llm.backbone import _tiny_dir

    dm = _datamodule(args)
    dataset = _trl_dataset(_kept_pairs(dm))
    path = str(_tiny_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    with tempfile.TemporaryDirectory(prefix="dpo_vs_trl_") as output_dir:
        config = DPOConfig(
            output_dir=output_dir,
            use_cpu=True,
            bf16=False,
            fp16=False,
            model_init_kwargs={"dtype": torch.float32},
            gradient_checkpointing=False,
            disable_dropout=True,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=1,
            max_length=args.max_length,
            truncation_mode="keep_start",
            loss_type=["sigmoid"],
            beta=args.beta,
            label_smoothing=0.0,
            precompute_ref_log_probs=False,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            optim="adamw_torch",
            adam_beta1=BETAS[0],
            adam_beta2=BETAS[1],
            adam_epsilon=EPS,
            max_grad_norm=MAX_GRAD_NORM,
            max_steps=_total_steps(args),
            train_sampling_strategy="sequential",
            seed=args.seed,
            report_to=[],
            logging_strategy="steps",
            logging_steps=1,
            save_strategy="no",
            eval_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            dataloader_pin_memory=False,
        )
        trainer = DPOTrainer(model=path, args=config, train_dataset=dataset, processing_class=tokenizer)
        tokens = _token_check(
            dm, trainer.train_dataset, args.max_length, args.batch_size * _total_steps(args)
        )

        class Timer(TrainerCallback):
            def on_train_begin(self, *_: Any, **__: Any) -> None:
                recorder.train_start()

            def on_step_end(self, *_: Any, **__: Any) -> None:
                recorder.step_end()

        trainer.add_callback(Timer())
        recorder.before_fit()
        trainer.train()
        if trainer.state.global_step != _total_steps(args):
            raise RuntimeError(
                f"TRL ran {trainer.state.global_step} optimizer steps, expected {_total_steps(args)}"
            )
        logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e and "step" in e}
        recorder.losses = [float(logged[s]) for s in sorted(logged)]
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        return {
            "param_dtype": str(next(trainer.model.parameters()).dtype),
            "ref_param_dtype": str(next(trainer.ref_model.parameters()).dtype),
            "optimizer_steps": trainer.state.global_step,
            "optimizer": _optimizer_settings(optimizer),
            "final_lr": trainer.lr_scheduler.get_last_lr()[0],
            "train_rows": len(trainer.train_dataset),
            "tokens": tokens,
        }


# ----------------------------------------------------------------------------------------------- driver


def _run_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    recorder = _Recorder(args.warmup)
    run = _run_ours if args.worker == "ours" else _run_trl
    info = run(args, recorder)
    return {**recorder.result(args.batch_size), "info": info}


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    throughput = [r["pairs_per_s"] for r in runs]
    peaks = [r["memory"]["peak_mib"] for r in runs]
    first, final = [r["losses"][0] for r in runs], [r["losses"][-1] for r in runs]
    return {
        "pairs_per_s": {
            "median": statistics.median(throughput),
            "min": min(throughput),
            "max": max(throughput),
            "all": throughput,
        },
        "step_time_s": {
            "median_of_rep_medians": statistics.median(r["time_s"]["median_step"] for r in runs),
            "fastest_step": min(s for r in runs for s in r["time_s"]["steps"]),
            "all_steps": [s for r in runs for s in r["time_s"]["steps"]],
        },
        "memory": {
            "peak_mib": statistics.median(peaks),
            "min": min(peaks),
            "all": peaks,
            "baseline_rss_mib": [r["memory"]["baseline_rss_mib"] for r in runs],
            "peak_rss_mib": [r["memory"]["peak_rss_mib"] for r in runs],
            "peak_source": sorted({r["memory"]["peak_source"] for r in runs}),
        },
        "loss": {
            "step0": statistics.median(first),
            "step0_all": first,
            "final": statistics.median(final),
            "final_all": final,
            "per_step_rep0": runs[0]["losses"],
        },
        "torch_threads": sorted({t for r in runs for t in r["torch_threads"]}),
        "info": runs[0]["info"],
        "repetitions": runs,
    }


def _load_note(machine: dict[str, Any]) -> str:
    """How far to trust the timings, from the load average measured when the result was written."""
    load, cores = machine.get("load_avg_1m"), machine.get("cpu_cores")
    if load is None or not cores:
        return "load average unknown"
    if load > 0.75 * cores:
        return (
            f"machine shared with other jobs: 1-minute load {load:.2f} on {cores} cores at the end of the run, "
            "so step times vary between repetitions (see pairs_per_s.all); compare medians"
        )
    return f"1-minute load {load:.2f} on {cores} cores at the end of the run"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse_args(argv)
    if args.worker:
        print(json.dumps(_run_worker(args)))
        return 0

    worker_argv = _worker_argv(args)
    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in FRAMEWORKS}
    for rep in range(args.reps):
        order = FRAMEWORKS if rep % 2 == 0 else FRAMEWORKS[::-1]
        for framework in order:
            print(f"rep {rep + 1}/{args.reps}: running {framework} ...", file=sys.stderr, flush=True)
            env = {"WANDB_DISABLED": "true", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
            runs[framework].append(spawn_worker(__file__, framework, worker_argv, env=env))
            r = runs[framework][-1]
            print(
                f"  {r['pairs_per_s']:.1f} pairs/s (median step {r['time_s']['median_step'] * 1e3:.1f} ms), "
                f"peak +{r['memory']['peak_mib']:.1f} MiB, loss {r['losses'][0]:.5f} -> {r['losses'][-1]:.5f}",
                file=sys.stderr,
                flush=True,
            )
    results = {f: _aggregate(runs[f]) for f in FRAMEWORKS}
    ours, trl = results["ours"], results["trl"]
    tokens = trl["info"]["tokens"]
    ours_steps, trl_steps = ours["loss"]["per_step_rep0"], trl["loss"]["per_step_rep0"]
    loss_gap = [abs(a - b) for a, b in zip(ours_steps, trl_steps, strict=True)]
    checks = {
        "step0_loss_is_log2": {
            f: all(abs(v - LOG2) <= LOSS0_TOLERANCE for v in results[f]["loss"]["step0_all"])
            for f in FRAMEWORKS
        },
        "log2": LOG2,
        "tolerance": LOSS0_TOLERANCE,
        "losses_logged_every_step": all(
            len(r["losses"]) == _total_steps(args) for f in FRAMEWORKS for r in runs[f]
        ),
        "same_input_sequences": tokens["sequences_identical"] == tokens["sides_compared"],
        "tokens": tokens,
        "per_step_loss_abs_diff_rep0": {"max": max(loss_gap), "final": loss_gap[-1]},
    }
    passed = (
        all(checks["step0_loss_is_log2"].values())
        and checks["losses_logged_every_step"]
        and checks["same_input_sequences"]
    )
    ratio = ours["pairs_per_s"]["median"] / trl["pairs_per_s"]["median"]
    memory_ratio = ours["memory"]["peak_mib"] / trl["memory"]["peak_mib"]
    unit = f"{args.batch_size} pairs/step, max_length {args.max_length}, tiny, fp32, cpu"
    load = machine_info()
    payload = {
        "benchmark": NAME,
        "description": "DPO training (policy + frozen reference forward, sigmoid loss, backward, AdamW step)",
        "config": {
            "model": "tiny (lightning_llm.backbone; TRL loads the same directory by path)",
            "data": {
                "datamodule": "HoneypotPreferenceDataModule(negatives='honeypot', tokenizer='tiny')",
                "max_length": args.max_length,
                "pairs_trained_on": args.batch_size * _total_steps(args),
                "order": "fixed, identical on both sides (ours shuffle=False, TRL sequential sampler)",
            },
            "batch_size_pairs": args.batch_size,
            "beta": args.beta,
            "loss": "sigmoid DPO, mean over pairs, no label smoothing, no SFT term",
            "lr": args.lr,
            "optimizer": f"torch.optim.AdamW betas={BETAS} eps={EPS}, weight decay 0, constant lr, no warm-up, "
            f"grad clip {MAX_GRAD_NORM}",
            "dtype": "float32",
            "device": "cpu",
            "steps": args.steps,
            "warmup": args.warmup,
            "reps": args.reps,
            "seed": args.seed,
            "worker_torch_threads": args.threads or "torch default",
        },
        "frameworks": {
            "ours": {"description": "lightning_llm.modules.DPOModule + lightning.Trainer", **ours},
            "trl": {"description": "trl.DPOTrainer", **trl},
        },
        "ratios": {
            "pairs_per_s_ours_over_trl": ratio,
            "peak_memory_ours_over_trl": memory_ratio,
            # the least-disturbed step of each side: what a quiet machine would show, not a summary value
            "fastest_step_time_ours_over_trl": ours["step_time_s"]["fastest_step"]
            / trl["step_time_s"]["fastest_step"],
        },
        "checks": checks,
        "checks_passed": passed,
        "differences": [
            "trained tokens: ours labels each response up to and including <|im_end|>; TRL's completion also "
            "contains the '\\n' the ChatML template writes after it, so TRL sums one more token log-prob per "
            "sequence (checks.tokens.extra_tokens_trl_scores); input sequences are identical "
            "(checks.tokens.sequences_identical), so the losses after step 0 differ slightly "
            "(checks.per_step_loss_abs_diff_rep0)",
            "log-prob computation: ours fused log-prob kernel on labelled tokens only; TRL's chunked fused LM head "
            "(CPU path) scores every position then masks",
            "reference model: ours deep-copies the policy at construction; TRL loads the same checkpoint again "
            "(identical weights either way)",
            "loss read-out: ours from the training_step output; TRL from its log history with logging_steps=1 "
            "(TRL's per-step logging is inside its timed window)",
            "memory baseline: each framework's own process RSS before training (Lightning vs HF Trainer + "
            "Accelerate imports differ); only the increase during training is compared",
        ],
        "measurement": MEASUREMENT,
        "versions": package_versions(
            ["torch", "transformers", "trl", "accelerate", "lightning", "datasets", "psutil"]
        ),
        "machine": load,
        "note": _load_note(load),
        "date": utc_now(),
        "summary": [
            summary_row(
                NAME,
                "DPOModule (Lightning)",
                "TRL DPOTrainer",
                f"DPO training throughput, pairs/s ({unit})",
                ours["pairs_per_s"]["median"],
                trl["pairs_per_s"]["median"],
                better="higher",
            ),
            summary_row(
                NAME,
                "DPOModule (Lightning)",
                "TRL DPOTrainer",
                f"peak RSS increase during DPO training, MiB ({unit})",
                ours["memory"]["peak_mib"],
                trl["memory"]["peak_mib"],
                better="lower",
            ),
        ],
    }

    for framework in FRAMEWORKS:
        r = results[framework]
        print(
            f"{framework:>4}: {r['pairs_per_s']['median']:7.1f} pairs/s  reps "
            f"{[round(t, 1) for t in r['pairs_per_s']['all']]}  peak +{r['memory']['peak_mib']:.1f} MiB  "
            f"loss step0 {r['loss']['step0']:.5f} final {r['loss']['final']:.5f}"
        )
    print(f"throughput ratio ours/TRL {ratio:.3f}, peak memory ratio ours/TRL {memory_ratio:.3f}")
    print(f"step-0 loss = log 2: {checks['step0_loss_is_log2']}, tokens: {tokens}")
    print(f"checks: {'PASS' if passed else 'FAIL'}")
    if args.no_write:
        print(json.dumps(payload, indent=2))
    else:
        print(f"wrote {write_result(NAME, payload)}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
