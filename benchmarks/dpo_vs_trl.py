"""DPO training throughput, peak memory and loss: ``lightning_llm`` ``DPOModule`` vs TRL's ``DPOTrainer``.

Same policy, preference pairs and hyper-parameters on both sides. A step is everything a library does between
two optimizer updates: collate ``B`` pairs, the policy forward over chosen + rejected (one stacked batch on both
sides), the frozen reference forward, sequence log-probs, the sigmoid DPO loss, backward, clipping,
``optimizer.step()`` and per-step bookkeeping. Step time is the interval between the ends of consecutive steps
(Lightning ``on_train_batch_end``; HF ``on_step_end``), the first ``--warmup`` dropped; throughput = ``B x
steps / sum of the timed intervals``. Each framework runs in a fresh process per repetition (paired).

Matched: the model (``--model``, loaded by path on TRL's side), fp32, no gradient checkpointing, autocast or
dropout, a frozen copy as reference; exactly the ``HoneypotPreferenceDataModule`` pairs, in the same order, as
a conversational dataset for TRL (both workers digest the token sequences they train on: they must agree;
``checks.tokens`` counts what each side scores); sigmoid DPO, ``beta``, no label smoothing or SFT term;
AdamW (0.9, 0.999, 1e-8), constant lr, clipping at 1.0; no evaluation, checkpoints or progress bars.

Not matched: ours labels each response up to and including ``<|im_end|>``; TRL's completion also holds the
``"\\n"`` the chat template writes after it (one more log-prob term per sequence; the input sequences are
identical, the step-0 loss is log 2 on both sides, later losses differ slightly); log-probs: ours fused kernel
on labelled tokens, TRL's chunked LM head on every position; TRL's per-step log (``logging_steps=1``, how its
losses are read back) is inside its timed window; memory baselines differ by framework (only the increase over
each process's pre-training RSS is compared). Exits 1 when a step-0 loss is not log 2 or the inputs differ.

    python benchmarks/dpo_vs_trl.py                      # 8 pairs/step, 2 warm-up + 20 timed steps, 5 reps
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from typing import Any

from _harness import (
    StepClock,
    column,
    digest,
    finish,
    parser,
    result,
    row,
    run_workers,
    worker_argv,
    worker_main,
)

NAME = "dpo_vs_trl"
SIDES = ("ours", "trl")
LOG2 = math.log(2.0)
LOSS0_TOLERANCE = 1e-4  # policy = reference at step 0, so the loss is log 2 up to fp32 rounding
BETAS, EPS, MAX_GRAD_NORM = (0.9, 0.999), 1e-8, 1.0


def _datamodule(args: argparse.Namespace) -> Any:
    from lightning_llm.datamodules import HoneypotPreferenceDataModule

    total = args.batch_size * (args.warmup + args.steps)
    # fmt: off
    dm = HoneypotPreferenceDataModule(
        negatives="honeypot", tokenizer=args.model, num_train=total, num_val=0, batch_size=args.batch_size,
        max_length=args.max_length, seed=args.seed, shuffle=False,
    )
    # fmt: on
    dm.prepare_data()
    dm.setup("fit")
    if len(dm._train_data) < total:
        raise RuntimeError(f"only {len(dm._train_data)} pairs for {args.warmup + args.steps} steps")
    return dm


def _trained(args: argparse.Namespace) -> int:
    return args.batch_size * (args.warmup + args.steps)


def _ours_inputs(dm: Any, n: int) -> str:
    return digest(
        [item[f"{s}_input_ids"].tolist() for item in dm._train_data[:n] for s in ("chosen", "rejected")]
    )


def _run_ours(args: argparse.Namespace, clock: StepClock) -> dict[str, Any]:
    import lightning as L

    from lightning_llm.modules import DPOModule
    from lightning_llm.trainer import quiet_trainer

    L.seed_everything(args.seed, verbose=False)
    dm = _datamodule(args)
    # fmt: off
    module = DPOModule(
        model=args.model, beta=args.beta, label_smoothing=0.0, sft_weight=0.0, lr=args.lr, weight_decay=0.0,
        betas=BETAS, warmup_ratio=0.0, min_lr_ratio=1.0, dtype="float32",
    )
    # fmt: on

    class Timer(L.Callback):
        def on_train_start(self, *_: Any) -> None:
            clock.train_start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *_: Any) -> None:
            clock.step_end(loss=float(outputs["loss"]))

    trainer = quiet_trainer(
        args.warmup + args.steps, precision="32-true", gradient_clip_val=MAX_GRAD_NORM, callbacks=[Timer()]
    )
    clock.before_fit()
    trainer.fit(module, datamodule=dm)
    return {"inputs": _ours_inputs(dm, _trained(args)), "losses": clock.values["loss"]}


def _token_check(dm: Any, rows: Any, max_length: int, n: int) -> dict[str, Any]:
    """TRL's tokenised rows vs the DataModule's items: identical input sequences? Which tokens does each score?"""
    from lightning_llm.types import IGNORE_INDEX

    counts = {"sides": 0, "sequences_identical": 0, "scored_identical": 0, "trl_scores_more": 0}
    sequences = []
    for item, r in zip(dm._train_data[:n], rows.select(range(n)), strict=True):
        for side in ("chosen", "rejected"):
            ours_ids = item[f"{side}_input_ids"].tolist()
            trl_ids = (r["prompt_ids"] + r[f"{side}_ids"])[:max_length]
            sequences.append(trl_ids)
            trl_scored = [len(r["prompt_ids"]) <= i for i in range(len(trl_ids))]
            ours_scored = [label != IGNORE_INDEX for label in item[f"{side}_labels"].tolist()]
            counts["sides"] += 1
            counts["sequences_identical"] += trl_ids == ours_ids
            counts["scored_identical"] += trl_ids == ours_ids and trl_scored == ours_scored
            counts["trl_scores_more"] += sum(trl_scored) > sum(ours_scored)
    return {**counts, "inputs": digest(sequences)}


def _run_trl(args: argparse.Namespace, clock: StepClock) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    dm = _datamodule(args)
    train, _ = dm._examples()
    kept = [pair for pair in dm._pairs(train, "train") if dm._items([pair])]  # the pairs the DataModule keeps
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p.prompt}] for p in kept],
            "chosen": [[{"role": "assistant", "content": p.chosen}] for p in kept],
            "rejected": [[{"role": "assistant", "content": p.rejected}] for p in kept],
        }
    )
    path = dm.tokenizer.name_or_path
    with tempfile.TemporaryDirectory(prefix="dpo_vs_trl_") as output_dir:
        # fmt: off
        config = DPOConfig(
            output_dir=output_dir, use_cpu=True, bf16=False, fp16=False,
            model_init_kwargs={"dtype": torch.float32}, gradient_checkpointing=False, disable_dropout=True,
            per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
            max_length=args.max_length, truncation_mode="keep_start", loss_type=["sigmoid"], beta=args.beta,
            label_smoothing=0.0, precompute_ref_log_probs=False, learning_rate=args.lr,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
            adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, max_grad_norm=MAX_GRAD_NORM,
            max_steps=args.warmup + args.steps, train_sampling_strategy="sequential", seed=args.seed,
            report_to=[], logging_strategy="steps", logging_steps=1, save_strategy="no", eval_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False,
        )
        # fmt: on
        trainer = DPOTrainer(
            model=path,
            args=config,
            train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(path),
        )
        tokens = _token_check(dm, trainer.train_dataset, args.max_length, _trained(args))

        class Timer(TrainerCallback):
            def on_train_begin(self, *_: Any, **__: Any) -> None:
                clock.train_start()

            def on_step_end(self, *_: Any, **__: Any) -> None:
                clock.step_end()

        trainer.add_callback(Timer())
        clock.before_fit()
        trainer.train()
        logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e and "step" in e}
    return {
        "inputs": tokens.pop("inputs"),
        "tokens": tokens,
        "losses": [float(logged[s]) for s in sorted(logged)],
    }


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    clock = StepClock(args.warmup)
    info = (_run_ours if args.worker == "ours" else _run_trl)(args, clock)
    out = clock.result()
    del out["values"]
    losses = info.pop("losses")
    timed = clock.timed
    return {
        **out,
        **info,
        "pairs_per_s": args.batch_size * len(timed) / sum(timed),
        "loss0": losses[0],
        "loss_final": losses[-1],
        "loss_steps": len(losses),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__, warmup=2, sides=SIDES)
    p.add_argument("--model", default="tiny", help="backbone name or directory (both sides)")
    p.add_argument("--batch-size", type=int, default=8, help="preference pairs per optimisation step")
    p.add_argument("--max-length", type=int, default=96, help="token budget of one side of a pair")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=20, help="timed steps per repetition")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args, _worker)

    runs = run_workers(
        __file__, SIDES, worker_argv(argv), args.reps, env={"HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    )
    total = args.warmup + args.steps
    checks = {
        "inputs_identical": True,  # run_workers raises otherwise
        "step0_loss_is_log2": all(abs(r["loss0"] - LOG2) <= LOSS0_TOLERANCE for s in SIDES for r in runs[s]),
        "losses_every_step": all(r["loss_steps"] == total for s in SIDES for r in runs[s]),
        "tokens": runs["trl"][0]["tokens"],
        "final_loss": {s: column(runs[s], "loss_final") for s in SIDES},
    }
    unit = f"{args.batch_size} pairs/step, max_length {args.max_length}, {args.model}, fp32, cpu"
    ours, peer = "DPOModule (Lightning)", "TRL DPOTrainer"
    # fmt: off
    summary = [
        row(NAME, f"DPO training throughput, pairs/s ({unit})", ours, peer,
            column(runs["ours"], "pairs_per_s"), column(runs["trl"], "pairs_per_s"), "higher"),
        row(NAME, f"peak RSS increase during DPO training, MiB ({unit})", ours, peer,
            column(runs["ours"], "peak_mib"), column(runs["trl"], "peak_mib"), "lower"),
    ]
    # fmt: on
    payload = result(
        NAME,
        __doc__,
        summary,
        config={**vars(args), "worker": None, "no_write": None},
        checks=checks,
        passed=checks["step0_loss_is_log2"] and checks["losses_every_step"],
        packages=("torch", "transformers", "trl", "accelerate", "lightning", "datasets", "psutil"),
    )
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
