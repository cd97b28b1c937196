"""What each reward- and prompt-shaping RL method (issue 4) costs per GRPO step, against plain GRPO on the same task.

None of these methods has a peer implementation a user could pick instead (TRL's ``GRPOTrainer`` has no hindsight
auxiliary task, no context swap between generation and training and no per-turn belief rewards; adding one means
subclassing its trainer), so the honest comparison is the price of the method itself: the median wall-clock time
of one optimisation step of ``GRPOModule`` + the method's callback over the same ``GRPOModule`` without it, same
tiny model, task, prompts, sampling budget and seed.

Variants (each in a fresh process per repetition, repetitions interleaved):

* ``grpo_length``: GRPO on the ``length`` task with the ``length`` reward (LARFT's reward alone) — baseline of
* ``larft``: the same + ``HindsightLengthAwareness`` (one extra forward/backward over the word-count prompts of
  the update's rows) and ``entropy_coef=0.01, beta=0.001`` as in the paper (so a reference model too);
* ``recontext``: the same as ``grpo_length`` + ``Recontextualization`` (generation prompt differs from the
  training prompt: one old-log-prob pass on x_gen, re-tokenised prompts, the update on x_train);
* ``grpo_20q``: multi-turn GRPO on ``TwentyQuestionsEnvironment`` with the env reward — baseline of
* ``delta_belief``: the same + ``DeltaBeliefReward`` (one batched no-grad probe pass per turn boundary).

A step's time is the interval between consecutive ``on_train_batch_end`` calls (generation, scoring, the
method's extra passes, loss, backward and optimizer step included); the first ``--warmup`` steps are dropped.
Per repetition the median of its steps; reported are medians over repetitions, and ratio = method / baseline.

Usage (repository root)::

    python benchmarks/rl_method_overhead.py                 # 5 reps x 8 timed steps per variant
    python benchmarks/rl_method_overhead.py --reps 3 --steps 5 --no-write
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from _common import machine_info, package_versions, spawn_worker, summary_row, utc_now, write_result

NAME = "rl_method_overhead"
VARIANTS = ("grpo_length", "larft", "recontext", "grpo_20q", "delta_belief")
BASELINE = {"larft": "grpo_length", "recontext": "grpo_length", "delta_belief": "grpo_20q"}
LABELS = {
    "larft": "GRPO + HindsightLengthAwareness (+ entropy bonus, KL 0.001)",
    "recontext": "GRPO + Recontextualization",
    "delta_belief": "GRPO + DeltaBeliefReward (turn-wise)",
    "grpo_length": "GRPO, length reward only",
    "grpo_20q": "GRPO, twenty questions, env reward only",
}


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rollout batch")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24, help="per completion (per turn for 20Q)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per repetition")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.reps < 1 or args.warmup < 1 or args.group_size < 2:
        parser.error("need --steps, --reps, --warmup >= 1 and --group-size >= 2")
    return args


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_llm.callbacks import DeltaBeliefReward, HindsightLengthAwareness, Recontextualization
    from lightning_llm.datamodules import PromptDataModule
    from lightning_llm.envs import TwentyQuestionsEnvironment
    from lightning_llm.modules import GRPOModule

    torch.set_num_threads(args.threads)
    L.seed_everything(0, verbose=False)
    variant = args.worker
    total = args.warmup + args.steps
    common = dict(group_size=args.group_size, max_new_tokens=args.max_new_tokens, lr=1e-4)
    callbacks: list[Callback] = []
    if variant in ("grpo_20q", "delta_belief"):
        env = TwentyQuestionsEnvironment(num_items=8, max_turns=5)
        module = GRPOModule(rewards=["env"], env=env, **{**common, "max_new_tokens": 8})
        task, task_kwargs = "twenty_questions", {"num_items": 8, "max_turns": 5}
        if variant == "delta_belief":
            callbacks.append(DeltaBeliefReward())
    else:
        extra = {"entropy_coef": 0.01, "beta": 0.001} if variant == "larft" else {}
        module = GRPOModule(rewards=["length"], **common, **extra)
        task, task_kwargs = "length", {"min_words": 3, "max_words": 12}
        if variant == "larft":
            callbacks.append(HindsightLengthAwareness(total_steps=total))
        elif variant == "recontext":
            callbacks.append(Recontextualization(generation_prompt="{prompt} Use plain words only."))

    times: list[float] = []

    class _Clock(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.last = time.perf_counter()

        def on_train_batch_end(self, *_: Any) -> None:
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now

    data = PromptDataModule(
        task=task,
        task_kwargs=task_kwargs,
        num_train=args.prompts * total,
        num_val=0,
        batch_size=args.prompts,
        shuffle=False,
        seed=0,
    )
    trainer = L.Trainer(
        max_steps=total,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[*callbacks, _Clock()],
    )
    trainer.fit(module, data)
    timed = times[args.warmup :]
    return {"median_s": statistics.median(timed), "all_s": timed, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0
    variants = list(dict.fromkeys([*args.variants, *(BASELINE[v] for v in args.variants if v in BASELINE)]))
    argv_worker = [
        f"--prompts={args.prompts}",
        f"--group-size={args.group_size}",
        f"--max-new-tokens={args.max_new_tokens}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--threads={args.threads}",
    ]
    per_rep: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(args.reps):
        order = variants if rep % 2 == 0 else variants[::-1]
        for v in order:
            out = spawn_worker(__file__, v, argv_worker)
            per_rep[v].append(out["median_s"])
            print(f"rep {rep} {v}: {out['median_s']:.3f} s/step", file=sys.stderr)
    medians = {v: statistics.median(t) for v, t in per_rep.items()}
    setting = (
        f"{args.prompts} prompts x {args.group_size}, {args.max_new_tokens} new tokens, tiny, fp32, cpu, "
        f"{args.threads} thread(s)"
    )
    summary = [
        summary_row(
            NAME,
            LABELS[v],
            LABELS[BASELINE[v]],
            f"median time per GRPO step, s ({setting})",
            medians[v],
            medians[BASELINE[v]],
            "lower",
        )
        for v in args.variants
        if v in BASELINE
    ]
    payload = {
        "benchmark": NAME,
        "description": "per-step cost of each issue-4 RL method over plain GRPO on the same task",
        "config": vars(args) | {"worker": None},
        "variants": {v: {"median_s": medians[v], "reps_s": per_rep[v]} for v in variants},
        "measurement": "fresh process per variant and repetition (interleaved, order alternating); per "
        "repetition the median interval between consecutive on_train_batch_end calls after the warm-up steps; "
        "median over repetitions",
        "versions": package_versions(["torch", "transformers", "lightning"]),
        "machine": machine_info(),
        "date": utc_now(),
        "summary": summary,
    }
    if args.no_write:
        print(json.dumps(payload, indent=2))
    else:
        print(f"wrote {write_result(NAME, payload)}")
    for row in summary:
        print(f"{row['ours']}: {row['ours_value']:.3f} s vs {row['peer_value']:.3f} s -> x{row['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
