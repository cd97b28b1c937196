"""What each reward- and prompt-shaping RL method (issue 4) costs per GRPO step, against plain GRPO on the same task.

None of these methods has a peer implementation a user could pick instead (TRL's ``GRPOTrainer`` has no
hindsight auxiliary task, no context swap between generation and training and no per-turn belief rewards), so
the honest comparison is the price of the method itself: the step time of ``GRPOModule`` + the method's callback
over the same ``GRPOModule`` without it, same tiny model, task, prompts, sampling budget and seed.

* ``grpo_length``: GRPO on the ``length`` task with the ``length`` reward (LARFT's reward alone), baseline of
* ``larft``: + ``HindsightLengthAwareness`` (one extra forward/backward over the word-count prompts) and
  ``entropy_coef=0.01, beta=0.001`` as in the paper (so a reference model too);
* ``recontext``: + ``Recontextualization`` (generation prompt differs from the training prompt);
* ``grpo_20q``: multi-turn GRPO on ``TwentyQuestionsEnvironment`` with the env reward, baseline of
* ``delta_belief``: + ``DeltaBeliefReward`` (one batched no-grad probe pass per turn boundary).

A step is the interval between consecutive ``on_train_batch_end`` calls (generation, scoring, the method's extra
passes, loss, backward and optimizer step); the first ``--warmup`` steps are dropped; per repetition the median
step; every variant in a fresh process per repetition (paired, order alternating).

    python benchmarks/rl_method_overhead.py                 # 5 reps x 8 timed steps per variant
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from _harness import StepClock, column, finish, parser, result, row, run_workers, worker_argv, worker_main

NAME = "rl_method_overhead"
SIDES = ("grpo_length", "larft", "recontext", "grpo_20q", "delta_belief")
BASELINE = {"larft": "grpo_length", "recontext": "grpo_length", "delta_belief": "grpo_20q"}
LABELS = {
    "larft": "GRPO + HindsightLengthAwareness (+ entropy bonus, KL 0.001)",
    "recontext": "GRPO + Recontextualization",
    "delta_belief": "GRPO + DeltaBeliefReward (turn-wise)",
    "grpo_length": "GRPO, length reward only",
    "grpo_20q": "GRPO, twenty questions, env reward only",
}


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_llm.callbacks import DeltaBeliefReward, HindsightLengthAwareness, Recontextualization
    from lightning_llm.datamodules import PromptDataModule
    from lightning_llm.envs import TwentyQuestionsEnvironment
    from lightning_llm.modules import GRPOModule
    from lightning_llm.trainer import quiet_trainer

    L.seed_everything(0, verbose=False)
    variant, total = args.worker, args.warmup + args.steps
    common = dict(group_size=args.group_size, max_new_tokens=args.max_new_tokens, lr=1e-4)
    callbacks: list[Callback] = []
    if variant in ("grpo_20q", "delta_belief"):
        env = TwentyQuestionsEnvironment(num_items=8, max_turns=5)
        module = GRPOModule(rewards=["env"], env=env, **{**common, "max_new_tokens": 8})
        task, task_kwargs = "twenty_questions", {"num_items": 8, "max_turns": 5}
        if variant == "delta_belief":
            callbacks.append(DeltaBeliefReward())
    else:
        module = GRPOModule(
            rewards=["length"],
            **common,
            **({"entropy_coef": 0.01, "beta": 0.001} if variant == "larft" else {}),
        )
        task, task_kwargs = "length", {"min_words": 3, "max_words": 12}
        if variant == "larft":
            callbacks.append(HindsightLengthAwareness(total_steps=total))
        elif variant == "recontext":
            callbacks.append(Recontextualization(generation_prompt="{prompt} Use plain words only."))
    clock = StepClock(args.warmup)

    class Timer(Callback):
        def on_train_start(self, *_: Any) -> None:
            clock.train_start()

        def on_train_batch_end(self, *_: Any) -> None:
            clock.step_end()

    # fmt: off
    data = PromptDataModule(
        task=task, task_kwargs=task_kwargs, num_train=args.prompts * total, num_val=0,
        batch_size=args.prompts, shuffle=False, seed=0,
    )
    # fmt: on
    trainer = quiet_trainer(total, callbacks=[*callbacks, Timer()])
    clock.before_fit()
    trainer.fit(module, data)
    out = clock.result()
    del out["values"]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__, warmup=2, sides=SIDES)
    p.add_argument("--prompts", type=int, default=4, help="prompts per rollout batch")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24, help="per completion (20Q: 8 per turn)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per repetition")
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args, _worker)

    runs = run_workers(__file__, SIDES, worker_argv(argv), args.reps)
    setting = (
        f"{args.prompts} prompts x {args.group_size}, {args.max_new_tokens} new tokens, tiny, fp32, cpu, "
        f"{args.threads} thread(s)"
    )
    summary = [
        row(
            NAME,
            f"median time per GRPO step, s ({setting})",
            LABELS[v],
            LABELS[base],
            column(runs[v], "step_s_median"),
            column(runs[base], "step_s_median"),
            "lower",
        )
        for v, base in BASELINE.items()
    ]
    payload = result(
        NAME,
        __doc__,
        summary,
        config={**vars(args), "worker": None, "no_write": None},
        details={v: {"peak_mib": column(runs[v], "peak_mib")} for v in SIDES},
    )
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
