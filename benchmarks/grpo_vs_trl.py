"""Time and peak memory of one GRPO optimisation step: ``lightning_llm`` ``GRPOModule`` vs TRL's ``GRPOTrainer``.

One step is everything a library does between two optimizer updates when every update consumes one fresh
generation batch: sample ``prompts × group_size`` completions, decode and score them, compute group-relative
advantages, the policy forward (log-probs + entropy), the clipped surrogate, backward, gradient clipping,
``optimizer.step()``, and each framework's per-step bookkeeping (Lightning's loop and ``self.log``; the HF
Trainer loop and TRL's metric/log buffers). It is measured as the wall-clock interval between the ends of
two consecutive steps (Lightning ``on_train_batch_end``; HF ``on_step_end``), so nothing a library does per
step — data loading included — falls outside the window. The first ``--warmup`` steps are discarded.

Each framework runs in its own fresh interpreter per repetition (``--reps``, interleaved, alternating which
goes first), so allocator state, imports and RSS high-water marks cannot leak between them.

Matched (the same on both sides):

* model: the embedded tiny Llama backbone; ours loads it with ``load_backbone("tiny")``, TRL from the same
  ``_tiny_dir()`` directory by path; fp32 weights, no gradient checkpointing (TRL's default is on: turned off),
  no bf16 autocast (TRL's default on CPU: turned off), no dropout in the model;
* prompts: the same arithmetic-task examples in the same order (ours: ``PromptDataModule(shuffle=False)``;
  TRL: ``shuffle_dataset=False``), given to TRL as conversational ``[{"role": "user", "content": prompt}]``
  and rendered by the same ChatML template; the parent process checks that TRL's tokenisation of every
  prompt equals the DataModule's token ids (``checks.prompt_tokens_identical``);
* reward: the task verifier (``task.score``) on the decoded completion (both decode with
  ``skip_special_tokens=True``);
* sampling: ``group_size`` = ``num_generations``, ``max_new_tokens`` = ``max_completion_length``, temperature
  1.0, top-p 1.0, no top-k (TRL ``top_k=0``; ours passes ``top_k=None``), no min-p / repetition penalty, stop on
  the EOS token, plain ``model.generate`` with the dynamic KV cache on both sides (TRL: no vLLM, no continuous
  batching, ``disable_compile``);
* objective: ``beta = 0`` (no reference model on either side), one update per generation batch (TRL:
  ``num_iterations=1``, ``steps_per_generation=1``, ``gradient_accumulation_steps=1``,
  ``per_device_train_batch_size = prompts × group_size``), so neither side computes "old" log-probs; clip
  ε = 0.2 both ways; token-mean loss over the batch (ours ``loss_aggregation="token-mean"``, TRL
  ``loss_type="dapo"``); group-std reward scaling (``scale_rewards="group"``, eps 1e-4 in both);
* optimiser: ``torch.optim.AdamW`` (TRL ``optim="adamw_torch"``, not the fused default), same lr, betas,
  eps, weight decay 0, constant schedule, no warm-up, gradient clipping at norm 1.0;
* no evaluation, no checkpointing, no loggers/reporters, no progress bars, no completion printing (TRL
  ``log_completions=False``, ``logging_strategy="no"``, ``report_to=[]``; Lightning ``logger=False``);
  ``use_cpu=True``; the same torch thread count (recorded per worker): one by default, because on a small
  shared machine OpenMP threads of a 2-thread process that competes with other jobs for 2 cores spin-wait on
  each other and single steps take 5-40x longer at random (measured: 1.3-22 s instead of 0.3 s), which
  swamps any difference between the libraries; ``--threads 0`` uses torch's default on a quiet machine.

Not matched (cannot be, or would no longer be "the library as it is"):

* RNG streams differ, so the sampled completions (and thus EOS-shortened lengths and rewards) differ; the
  random tiny model almost never samples EOS, so nearly every completion is ``max_new_tokens`` long on both
  sides — the mean completion length of every timed step is recorded (``completion_length``) to show it.
  ``--min-new-tokens N`` forces at least N tokens on both sides (``min_new_tokens`` in the generation config)
  when an exactly-equal generation workload is wanted;
* how each library computes log-probs is its own design and part of what is compared: ours runs the decoder
  then ``fused_linear_logprobs`` on completion tokens only; TRL patches the model with its chunked fused LM
  head, which on CPU (no Triton) scores every position, prompt included, then keeps the completion part;
* per-step bookkeeping that cannot be switched off: TRL always tokenises the prompts inside the step (chat
  template each step), fills its metric lists (several ``.item()`` syncs) and its prompt/completion log
  buffers even with logging off; ours tokenises prompts once in ``setup`` and logs ~15 scalars with
  ``self.log`` per step;
* baseline memory differs by framework (Lightning vs HF Trainer + Accelerate imports); only the increase
  over each process's own pre-training RSS is compared (absolute numbers are recorded too).

Usage (from the repository root)::

    python benchmarks/grpo_vs_trl.py                        # 4 prompts × 8, 32 new tokens, 5 reps × 10 steps
    python benchmarks/grpo_vs_trl.py --prompts 8 --group-size 4 --max-new-tokens 64 --steps 8 --reps 5

Writes ``benchmarks/results/grpo_vs_trl.json`` (``--no-write`` to skip) and exits 1 if our median step time is
above TRL's (the acceptance criterion: our step must not be slower than TRL's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

from _common import (
    StepRecorder,
    machine_info,
    package_versions,
    rss_bytes,
    spawn_worker,
    summary_row,
    utc_now,
    write_result,
)

NAME = "grpo_vs_trl"
FRAMEWORKS = ("ours", "trl")
TIME_CRITERION = 1.0  # ours' median step time must be at most this fraction of TRL's
_MIB = 2**20

MEASUREMENT = {
    "time": "per repetition, a fresh process per framework trains warmup + steps GRPO steps; a step's time is "
    "the wall-clock interval between the ends of consecutive optimisation steps (Lightning "
    "on_train_batch_end / HF on_step_end; the first from the train-start hook), so it covers generation, "
    "scoring, advantages, loss, backward, clipping, optimizer step, data loading and each framework's per-step "
    "bookkeeping. Warm-up steps are dropped. Per repetition the median of its timed steps; the reported "
    "median/min are over the repetitions' medians, `all_steps` lists every timed step",
    "memory_cpu": "each framework in its own fresh subprocess: baseline = RSS (psutil) right before "
    "trainer.fit / trainer.train, after the model, data and trainer are built (gc.collect() first). At the end "
    "of the last warm-up step the kernel's RSS high-water mark is reset (/proc/self/clear_refs = 5); "
    "peak_mib = VmHWM after the timed steps - baseline: the worst resident memory of a steady-state step "
    "including optimizer state, gradients and whatever the framework kept from earlier steps (ru_maxrss over "
    "the process lifetime where VmHWM cannot be reset); step_mib = the same VmHWM - RSS at the reset point "
    "(what a steady-state step adds on top of what earlier steps left resident; noisy, since RSS between steps "
    "moves by tens of MiB with the allocator, so not in the summary). Reported: medians over repetitions; RSS "
    "after every step is kept per repetition",
}


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (batch_size)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--min-new-tokens",
        type=int,
        default=0,
        help="force at least this many new tokens on both sides (0: stop at EOS as usual)",
    )
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--digits", type=int, default=2, help="operand digits of the arithmetic task")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repetition (>= 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (fresh processes per framework)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads in both workers (0: torch's default, one per core); see the module docstring",
    )
    parser.add_argument(
        "--profile",
        choices=FRAMEWORKS,
        help="instead of benchmarking, cProfile the timed steps of one framework and print the top entries",
    )
    parser.add_argument(
        "--no-write", action="store_true", help="print the result instead of writing the JSON"
    )
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)  # internal: run one framework
    parser.add_argument("--profile-out", help=argparse.SUPPRESS)  # internal: where a worker dumps its profile
    args = parser.parse_args(argv)
    if args.steps < 5 or args.reps < 1 or args.warmup < 1:
        parser.error("need --steps >= 5, --reps >= 1 and --warmup >= 1")
    if args.group_size < 2:
        parser.error("--group-size must be >= 2")
    return args


# ------------------------------------------------------------------------------------------------ helpers


def _total_steps(args: argparse.Namespace) -> int:
    return args.warmup + args.steps


def _datamodule(args: argparse.Namespace) -> Any:
    """The arithmetic prompts both sides train on, in a fixed order (one epoch covers every step)."""
    from lightning_llm.datamodules import PromptDataModule

    dm = PromptDataModule(
        task="arithmetic",
        task_kwargs={"digits": args.digits},
        num_train=args.prompts * _total_steps(args),
        num_val=0,
        batch_size=args.prompts,
        seed=args.seed,
        shuffle=False,
    )
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _train_examples(dm: Any) -> list[Any]:
    return [item["example"] for item in dm._train_data]


class _Recorder(StepRecorder):
    """Step timing and memory (:class:`StepRecorder`) plus per-step completion lengths and RSS; optionally
    profiles the timed steps."""

    def __init__(self, warmup: int, profiler: Any = None) -> None:
        super().__init__(warmup)
        self.profiler = profiler
        self.lengths: list[float] = []
        self.rss_mib: list[float] = []
        self._length: float | None = None

    def step_end(self, mean_length: float | None) -> None:
        self._length = mean_length
        super().step_end()

    def _record(self) -> None:
        self.lengths.append(float("nan") if self._length is None else float(self._length))
        self.rss_mib.append(rss_bytes() / _MIB)

    def _warmup_end(self) -> None:
        if self.profiler is not None:
            self.profiler.enable()

    def result(self) -> dict[str, Any]:
        if self.profiler is not None:
            self.profiler.disable()
        timed = self.timed
        return {
            "time_s": {
                "median": statistics.median(timed),
                "min": min(timed),
                "mean": statistics.fmean(timed),
                "steps": timed,
                "warmup_steps": self.intervals[: self.warmup],
            },
            "memory": {**self.memory(), "rss_after_each_step_mib": self.rss_mib},
            "completion_length": {
                "timed_steps_mean": statistics.fmean(self.lengths[self.warmup :]),
                "per_step": self.lengths,
            },
            "torch_threads": sorted(set(self.threads)),
        }


# ------------------------------------------------------------------------------------------------- ours


def _run_ours(args: argparse.Namespace, recorder: _Recorder) -> dict[str, Any]:
    import lightning as L

    from lightning_llm.modules.grpo import GRPOModule

    L.seed_everything(args.seed, verbose=False)
    dm = _datamodule(args)
    module = GRPOModule(
        model="tiny",
        rewards=["task"],
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        lr=args.lr,
        beta=0.0,
        ppo_epochs=1,
        mini_batches=1,
        loss_aggregation="token-mean",
        scale_rewards="group",
        epsilon=0.2,
        max_grad_norm=1.0,
        weight_decay=0.0,
    )
    if args.min_new_tokens:
        module.model.generation_config.min_new_tokens = args.min_new_tokens

    class Timer(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            recorder.train_start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *_: Any) -> None:
            length = trainer.callback_metrics.get("train/completions/mean_length")
            recorder.step_end(None if length is None else float(length))

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=_total_steps(args),
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
    return {"param_dtype": str(next(module.model.parameters()).dtype), "optimizer_steps": trainer.global_step}


# -------------------------------------------------------------------------------------------------- TRL


def _run_trl(args: argparse.Namespace, recorder: _Recorder) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lightning_llm.backbone import _tiny_dir

    dm = _datamodule(args)
    task = dm.task
    examples = _train_examples(dm)
    path = str(_tiny_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": ex.prompt}] for ex in examples],
            "example_index": list(range(len(examples))),
        }
    )

    def task_reward(completions: list[Any], example_index: list[int], **_: Any) -> list[float]:
        return [
            task.score(c[0]["content"], examples[i]) for c, i in zip(completions, example_index, strict=True)
        ]

    rows = args.prompts * args.group_size
    generation_kwargs = {"min_new_tokens": args.min_new_tokens} if args.min_new_tokens else None
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            per_device_train_batch_size=rows,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_iterations=1,
            num_generations=args.group_size,
            max_completion_length=args.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            min_p=None,
            repetition_penalty=1.0,
            generation_kwargs=generation_kwargs,
            beta=0.0,
            epsilon=0.2,
            loss_type="dapo",
            scale_rewards="group",
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            optim="adamw_torch",
            max_grad_norm=1.0,
            max_steps=_total_steps(args),
            shuffle_dataset=False,
            seed=args.seed,
            report_to=[],
            logging_strategy="no",
            log_completions=False,
            save_strategy="no",
            eval_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            dataloader_pin_memory=False,
        )
        trainer = GRPOTrainer(
            model=path,
            reward_funcs=[task_reward],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
        )

        class Timer(TrainerCallback):
            def on_train_begin(self, *_: Any, **__: Any) -> None:
                recorder.train_start()

            def on_step_end(self, *_: Any, **__: Any) -> None:
                lengths = trainer._metrics["train"].get("completions/mean_length")
                recorder.step_end(lengths[-1] if lengths else None)

        trainer.add_callback(Timer())
        recorder.before_fit()
        trainer.train()
        if trainer.state.global_step != _total_steps(args):
            raise RuntimeError(
                f"TRL ran {trainer.state.global_step} optimizer steps, expected {_total_steps(args)}"
            )
        return {
            "param_dtype": str(next(trainer.model.parameters()).dtype),
            "optimizer_steps": trainer.state.global_step,
            "optimizer": type(trainer.optimizer.optimizer).__name__
            if hasattr(trainer.optimizer, "optimizer")
            else type(trainer.optimizer).__name__,
            "generation_config": {
                k: getattr(trainer.generation_config, k)
                for k in ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_p", "top_k")
            },
        }


# ----------------------------------------------------------------------------------------------- driver


def _run_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    profiler = None
    if args.profile_out:
        import cProfile

        profiler = cProfile.Profile()
    recorder = _Recorder(args.warmup, profiler)
    run = _run_ours if args.worker == "ours" else _run_trl
    info = run(args, recorder)
    result = recorder.result()
    if profiler is not None:
        profiler.dump_stats(args.profile_out)
    return {**result, "info": info}


def _prompt_check(args: argparse.Namespace) -> dict[str, Any]:
    """Does TRL's chat-template tokenisation of the conversational prompts give the DataModule's token ids?"""
    dm = _datamodule(args)
    tokenizer = dm.tokenizer
    ours = [item["input_ids"].tolist() for item in dm._train_data]
    conversations = [[{"role": "user", "content": ex.prompt}] for ex in _train_examples(dm)]
    trl = tokenizer.apply_chat_template(
        conversations, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    mismatches = sum(a != b for a, b in zip(ours, trl["input_ids"], strict=True))
    return {
        "prompt_tokens_identical": mismatches == 0,
        "prompts_compared": len(ours),
        "mismatches": mismatches,
        "prompt_tokens_min_max": [min(map(len, ours)), max(map(len, ours))],
    }


def _profile(args: argparse.Namespace, argv: list[str]) -> int:
    import pstats

    framework = args.profile
    with tempfile.NamedTemporaryFile(suffix=".pstats", delete=False) as f:
        out = f.name
    worker_argv = [a for a in argv if a not in ("--no-write", "--profile", framework)]
    result = spawn_worker(
        __file__, framework, [*worker_argv, "--profile-out", out], env={"WANDB_DISABLED": "true"}
    )
    print(
        f"{framework}: median step {result['time_s']['median'] * 1e3:.1f} ms under cProfile "
        f"({args.steps} steps)"
    )
    stats = pstats.Stats(out)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(25)
    os.unlink(out)
    return 0


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    medians = [r["time_s"]["median"] for r in runs]
    peaks = [r["memory"]["peak_mib"] for r in runs]
    return {
        "time_s": {
            "median": statistics.median(medians),
            "min": min(medians),
            "all": medians,
            "all_steps": [s for r in runs for s in r["time_s"]["steps"]],
            "fastest_step": min(s for r in runs for s in r["time_s"]["steps"]),
        },
        "memory": {
            "peak_mib": statistics.median(peaks),
            "min": min(peaks),
            "all": peaks,
            "step_mib": statistics.median(r["memory"]["step_mib"] for r in runs),
            "step_mib_all": [r["memory"]["step_mib"] for r in runs],
            "baseline_rss_mib": [r["memory"]["baseline_rss_mib"] for r in runs],
            "peak_rss_mib": [r["memory"]["peak_rss_mib"] for r in runs],
            "peak_source": sorted({r["memory"]["peak_source"] for r in runs}),
        },
        "completion_length_mean": statistics.fmean(r["completion_length"]["timed_steps_mean"] for r in runs),
        "torch_threads": sorted({t for r in runs for t in r["torch_threads"]}),
        "info": runs[0]["info"],
        "repetitions": runs,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse_args(argv)
    if args.worker:
        print(json.dumps(_run_worker(args)))
        return 0
    if args.profile:
        return _profile(args, argv)

    checks = _prompt_check(args)
    worker_argv = [a for a in argv if a != "--no-write"]
    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in FRAMEWORKS}
    for rep in range(args.reps):
        order = FRAMEWORKS if rep % 2 == 0 else FRAMEWORKS[::-1]
        for framework in order:
            print(f"rep {rep + 1}/{args.reps}: running {framework} ...", file=sys.stderr, flush=True)
            runs[framework].append(
                spawn_worker(__file__, framework, worker_argv, env={"WANDB_DISABLED": "true"})
            )
            r = runs[framework][-1]
            print(
                f"  median {r['time_s']['median'] * 1e3:.1f} ms/step, peak +{r['memory']['peak_mib']:.1f} MiB, "
                f"mean completion length {r['completion_length']['timed_steps_mean']:.1f}",
                file=sys.stderr,
                flush=True,
            )
    results = {f: _aggregate(runs[f]) for f in FRAMEWORKS}
    ours, trl = results["ours"], results["trl"]
    time_ratio = ours["time_s"]["median"] / trl["time_s"]["median"]
    memory_ratio = ours["memory"]["peak_mib"] / trl["memory"]["peak_mib"]
    step_memory_ratio = ours["memory"]["step_mib"] / trl["memory"]["step_mib"]
    passed = time_ratio <= TIME_CRITERION
    rows = args.prompts * args.group_size
    unit = f"{args.prompts} prompts x {args.group_size}, {args.max_new_tokens} new tokens, tiny, fp32, cpu"
    payload = {
        "benchmark": NAME,
        "description": "one GRPO optimisation step (generate + score + loss + backward + optimizer step)",
        "config": {
            "model": "tiny (lightning_llm.backbone; TRL loads the same directory by path)",
            "task": {"name": "arithmetic", "digits": args.digits},
            "prompts_per_step": args.prompts,
            "group_size": args.group_size,
            "rows_per_step": rows,
            "max_new_tokens": args.max_new_tokens,
            "min_new_tokens": args.min_new_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": None,
            "lr": args.lr,
            "beta": 0.0,
            "epsilon": 0.2,
            "updates_per_generation_batch": 1,
            "loss": "token mean over the batch (ours token-mean, TRL dapo)",
            "scale_rewards": "group",
            "optimizer": "torch.optim.AdamW, constant lr, weight decay 0, grad clip 1.0",
            "dtype": "float32",
            "device": "cpu",
            "steps": args.steps,
            "warmup": args.warmup,
            "reps": args.reps,
            "seed": args.seed,
            "worker_torch_threads": args.threads or "torch default",
        },
        "frameworks": {
            "ours": {"description": "lightning_llm.modules.grpo.GRPOModule + lightning.Trainer", **ours},
            "trl": {"description": "trl.GRPOTrainer (transformers generate path)", **trl},
        },
        "ratios": {
            "time_ours_over_trl": time_ratio,
            "peak_memory_ours_over_trl": memory_ratio,
            "step_memory_ours_over_trl": step_memory_ratio,
        },
        "acceptance": {
            "criterion": f"median step time ours <= {TIME_CRITERION:g} x TRL's",
            "passed": passed,
        },
        "checks": checks,
        "measurement": MEASUREMENT,
        "versions": package_versions(
            ["torch", "transformers", "trl", "accelerate", "lightning", "datasets", "psutil"]
        ),
        "machine": machine_info(),
        "date": utc_now(),
        "summary": [
            summary_row(
                NAME,
                "GRPOModule (Lightning)",
                "TRL GRPOTrainer",
                f"median time per optimisation step, s ({unit})",
                ours["time_s"]["median"],
                trl["time_s"]["median"],
                better="lower",
            ),
            summary_row(
                NAME,
                "GRPOModule (Lightning)",
                "TRL GRPOTrainer",
                f"peak RSS increase during steps, MiB ({unit})",
                ours["memory"]["peak_mib"],
                trl["memory"]["peak_mib"],
                better="lower",
            ),
        ],
    }

    for framework in FRAMEWORKS:
        r = results[framework]
        print(
            f"{framework:>4}: median {r['time_s']['median'] * 1e3:8.1f} ms/step  min {r['time_s']['min'] * 1e3:8.1f}"
            f"  reps {[round(t * 1e3, 1) for t in r['time_s']['all']]}  peak +{r['memory']['peak_mib']:.1f} MiB"
            f"  completion length {r['completion_length_mean']:.1f}"
        )
    print(
        f"time ratio ours/TRL {time_ratio:.3f}, peak memory ratio ours/TRL {memory_ratio:.3f} "
        f"(above post-warm-up RSS: {step_memory_ratio:.3f})"
    )
    print(f"prompt tokens identical: {checks['prompt_tokens_identical']}")
    print(f"acceptance ({payload['acceptance']['criterion']}): {'PASS' if passed else 'FAIL'}")
    if args.no_write:
        print(json.dumps(payload, indent=2))
    else:
        print(f"wrote {write_result(NAME, payload)}")
    return 0 if passed and checks["prompt_tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
