"""Time and peak memory of one GRPO optimisation step: ``lightning_llm`` ``GRPOModule`` vs TRL's ``GRPOTrainer``.

A step is everything a library does between two optimizer updates when every update consumes one fresh
generation batch: sample ``prompts x group_size`` completions, decode and score them, group-relative advantages,
the policy forward (log-probs + entropy), the clipped surrogate, backward, clipping, ``optimizer.step()`` and
each framework's per-step bookkeeping. It is the interval between the ends of consecutive steps (Lightning
``on_train_batch_end``; HF ``on_step_end``); the first ``--warmup`` steps are dropped; per repetition the median
step; each framework in a fresh process per repetition (paired, order alternating).

Matched: the model (``--model``, loaded by path on TRL's side), fp32, no gradient checkpointing or autocast;
the same arithmetic prompts in the same order through the same chat template (the parent checks TRL's token
ids against the DataModule's, the workers' prompt digests must agree); the task verifier as reward; sampling
(temperature 1, top-p 1, no top-k, EOS stop, plain ``generate``); ``beta = 0``, one update per generation
batch, clip 0.2, token-mean loss (TRL ``dapo``), group-std reward scaling; AdamW, constant lr, clipping at
1.0; no evaluation, checkpoints, loggers or progress bars; one torch thread.

Not matched (each library as it is): RNG streams, so completions and their lengths differ (recorded;
``--min-new-tokens`` forces equal work); log-probs (ours ``fused_linear_logprobs`` on completion tokens, TRL's
chunked LM head on every position); TRL re-tokenises prompts every step, ours logs ~15 scalars; memory
baselines differ by framework, so only the increase over each process's pre-training RSS is compared (the
model, with its adapters, is built before that baseline on both sides).

LoRA (``--lora-r``): our ``LoRAConfig`` and PEFT's ``LoraConfig`` with the same rank, alpha, target modules
(``--lora-targets``, default every attention and MLP projection) and no dropout; only the adapters train, and
the parent checks that both sides' optimizers see the same number of trainable parameters.

Settings share one results file: a run replaces the rows of its own setting (named in the metric) and keeps
the others' (``--fresh`` drops them); each setting's config, checks and provenance are under
``details["settings"]``.

    python benchmarks/grpo_vs_trl.py                        # tiny: 4 prompts x 8, 32 new tokens, 5 reps x 10 steps
    python benchmarks/grpo_vs_trl.py --model smollm2-135m --lora-r 16 --lora-alpha 32 --prompts 2 \
        --group-size 4 --max-new-tokens 16 --min-new-tokens 16 --warmup 1 --steps 3   # SmolLM2 + LoRA
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from _harness import (
    RESULTS_DIR,
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

NAME = "grpo_vs_trl"
SIDES = ("ours", "trl")


def _datamodule(args: argparse.Namespace) -> Any:
    """The arithmetic prompts both sides train on, in a fixed order (one epoch covers every step)."""
    from lightning_llm.datamodules import PromptDataModule

    if args.task == "needle":
        task_kwargs = {"haystack_words": args.haystack_words, "filler": "prose"}
    else:
        task_kwargs = {"digits": args.digits}
    # fmt: off
    dm = PromptDataModule(
        task=args.task, task_kwargs=task_kwargs, tokenizer=args.model,
        num_train=args.prompts * (args.warmup + args.steps), num_val=0, batch_size=args.prompts,
        seed=args.seed, shuffle=False, system_prompt=args.system_prompt, max_length=args.max_prompt_tokens,
    )
    # fmt: on
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _examples(dm: Any) -> list[Any]:
    return [item["example"] for item in dm._train_data]


def _conversation(dm: Any, example: Any) -> list[dict[str, str]]:
    """The chat messages the DataModule renders for ``example``: its system prefix (if any), then the prompt."""
    from lightning_llm.text import prefix_messages

    return [*prefix_messages(dm.system_prompt), {"role": "user", "content": example.prompt}]


def _targets(args: argparse.Namespace) -> list[str]:
    return [t.strip() for t in args.lora_targets.split(",") if t.strip()]


def _trainable(model: Any) -> int:
    """Parameters the optimizer updates (all of them, or the adapters under LoRA)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _run_ours(args: argparse.Namespace, clock: StepClock) -> dict[str, Any]:
    import lightning as L

    from lightning_llm.lora import LoRAConfig
    from lightning_llm.modules.grpo import GRPOModule
    from lightning_llm.trainer import quiet_trainer

    L.seed_everything(args.seed, verbose=False)
    dm = _datamodule(args)
    lora = (
        LoRAConfig(r=args.lora_r, alpha=args.lora_alpha, target_modules=_targets(args), dropout=0.0)
        if args.lora_r
        else None
    )
    # fmt: off
    module = GRPOModule(
        model=args.model, rewards=["task"], group_size=args.group_size, max_new_tokens=args.max_new_tokens,
        temperature=1.0, top_p=1.0, lr=args.lr, beta=0.0, ppo_epochs=1, mini_batches=1,
        loss_aggregation="token-mean", scale_rewards="group", epsilon=0.2, max_grad_norm=1.0,
        weight_decay=0.0, lora=lora, shared_prefix=not args.no_shared_prefix,
    )
    # fmt: on
    model = module.model  # built (and adapted) now, so the memory baseline holds it, as TRL's does
    if args.min_new_tokens:
        model.generation_config.min_new_tokens = args.min_new_tokens
    trainable = _trainable(model)

    class Timer(L.Callback):
        def on_train_start(self, *_: Any) -> None:
            clock.train_start()

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            length = trainer.callback_metrics.get("train/completions/mean_length")
            clock.step_end(completion_length=None if length is None else float(length))

    total = args.warmup + args.steps
    trainer = quiet_trainer(total, callbacks=[Timer()])
    clock.before_fit()
    trainer.fit(module, datamodule=dm)
    if trainer.global_step != total:
        raise RuntimeError(f"ours ran {trainer.global_step} optimizer steps, expected {total}")
    return {"inputs": digest([ex.prompt for ex in _examples(dm)]), "trainable_params": trainable}


def _run_trl(args: argparse.Namespace, clock: StepClock) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lightning_llm.backbones import resolve_backbone

    dm = _datamodule(args)
    task, examples = dm.task, _examples(dm)
    path = resolve_backbone(args.model)
    peft_config = None
    if args.lora_r:
        from peft import LoraConfig

        # fmt: off
        peft_config = LoraConfig(
            r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=_targets(args), lora_dropout=0.0,
            bias="none", task_type="CAUSAL_LM",
        )
        # fmt: on
    dataset = Dataset.from_dict(
        {
            "prompt": [_conversation(dm, ex) for ex in examples],
            "index": list(range(len(examples))),
        }
    )

    def task_reward(completions: list[Any], index: list[int], **_: Any) -> list[float]:
        return [task.score(c[0]["content"], examples[i]) for c, i in zip(completions, index, strict=True)]

    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as output_dir:
        # fmt: off
        config = GRPOConfig(
            output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
            per_device_train_batch_size=args.prompts * args.group_size, gradient_accumulation_steps=1,
            steps_per_generation=1, num_iterations=1, num_generations=args.group_size,
            max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
            repetition_penalty=1.0,
            generation_kwargs={"min_new_tokens": args.min_new_tokens} if args.min_new_tokens else None,
            beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", learning_rate=args.lr,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
            max_grad_norm=1.0, max_steps=total, shuffle_dataset=False, seed=args.seed, report_to=[],
            logging_strategy="no", log_completions=False, save_strategy="no", eval_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False,
        )
        # fmt: on
        trainer = GRPOTrainer(
            model=path,
            reward_funcs=[task_reward],
            args=config,
            train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(path),
            peft_config=peft_config,
        )
        trainable = _trainable(trainer.model)

        class Timer(TrainerCallback):
            def on_train_begin(self, *_: Any, **__: Any) -> None:
                clock.train_start()

            def on_step_end(self, *_: Any, **__: Any) -> None:
                lengths = trainer._metrics["train"].get("completions/mean_length")
                clock.step_end(completion_length=lengths[-1] if lengths else None)

        trainer.add_callback(Timer())
        clock.before_fit()
        trainer.train()
        if trainer.state.global_step != total:
            raise RuntimeError(f"TRL ran {trainer.state.global_step} optimizer steps, expected {total}")
    return {
        "inputs": digest([conv[-1]["content"] for conv in dataset["prompt"]]),
        "trainable_params": trainable,
    }


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    clock = StepClock(args.warmup)
    info = (_run_ours if args.worker == "ours" else _run_trl)(args, clock)
    out = clock.result()
    out["completion_length"] = sum(out.pop("values")["completion_length"][args.warmup :]) / args.steps
    return {**out, **info}


def _prompt_check(args: argparse.Namespace) -> dict[str, Any]:
    """Does TRL's chat-template tokenisation of the conversational prompts give the DataModule's token ids?"""
    dm = _datamodule(args)
    ours = [item["input_ids"].tolist() for item in dm._train_data]
    trl = dm.tokenizer.apply_chat_template(
        [_conversation(dm, ex) for ex in _examples(dm)],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    lengths = sorted(len(ids) for ids in ours)
    return {
        "prompt_tokens_identical": ours == trl,
        "prompts_compared": len(ours),
        "prompt_tokens_median": lengths[len(lengths) // 2],
    }


def _unit(config: dict[str, Any]) -> str:
    """The setting a run measured, as its rows name it (also the key of its provenance in ``details``)."""
    lengths = f"{config['max_new_tokens']} new tokens"
    if config.get("min_new_tokens"):
        lengths += f" (min {config['min_new_tokens']})"
    model = config["model"] + (f" + LoRA r={config['lora_r']}" if config.get("lora_r") else "")
    task = config.get("task", "arithmetic")
    parts = [f"needle {config['haystack_words']} words"] if task == "needle" else []
    if config.get("system_prompt"):
        parts.append(f"{task if task != 'needle' else 'needle'} with system prompt {config['system_prompt']}")
    if config.get("no_shared_prefix"):
        model += ", ours unshared"
    setting = "".join(f"{p}, " for p in parts)
    return f"{config['prompts']} prompts x {config['group_size']}, {setting}{lengths}, {model}, fp32, cpu"


def _provenance(payload: dict[str, Any]) -> dict[str, Any]:
    keys = ("passed", "checks", "config", "versions", "machine", "date")
    return {k: payload[k] for k in keys} | {"metrics": [r["metric"] for r in payload["summary"]]}


def _merge(payload: dict[str, Any], path: Path) -> dict[str, Any]:
    """``payload`` with the rows of the other settings already in ``path`` kept (this setting's replaced), and
    every setting's config, checks and provenance under ``details["settings"][unit]``; passed only if all
    settings passed. The top-level config and checks are this run's."""
    settings: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    unit = _unit(payload["config"])
    if path.is_file():
        old = json.loads(path.read_text())
        settings = old["details"].get("settings") or {_unit(old["config"]): _provenance(old)}
        settings.pop(unit, None)
        mine = {r["metric"] for r in payload["summary"]}
        rows = [r for r in old["summary"] if r["metric"] not in mine]
    settings[unit] = _provenance(payload)
    return payload | {
        "summary": rows + payload["summary"],
        "passed": all(s["passed"] for s in settings.values()),
        "details": {**payload["details"], "settings": settings},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__, warmup=3, sides=SIDES)
    p.add_argument("--model", default="tiny", help="backbone name or directory (both sides)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--min-new-tokens", type=int, default=0, help="force at least this many tokens on both sides"
    )
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank on both sides (0: train all weights)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    p.add_argument(
        "--lora-targets",
        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        help="comma-separated module names that get adapters (both sides)",
    )
    p.add_argument("--task", choices=("arithmetic", "needle"), default="arithmetic", help="the prompts' task")
    p.add_argument("--digits", type=int, default=2, help="operand digits of the arithmetic task")
    p.add_argument("--haystack-words", type=int, default=300, help="prose filler words of the needle task")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=1024, help="longer prompts are dropped (both sides)"
    )
    p.add_argument(
        "--system-prompt", choices=("task",), default=None,
        help="'task': the task's format and one worked exchange before each prompt (the README main job's)",
    )  # fmt: skip
    p.add_argument(
        "--no-shared-prefix", action="store_true", help="ours encodes every row whole (shared_prefix=False)"
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="drop the other settings' rows from the results file")
    args = p.parse_args(argv)
    if args.lora_r < 0:
        p.error(f"--lora-r must be >= 0, got {args.lora_r}")
    if args.lora_r and args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.lora_r
    if args.worker:
        return worker_main(args, _worker)

    checks = _prompt_check(args)
    runs = run_workers(__file__, SIDES, worker_argv(argv), args.reps)
    checks["inputs_identical"] = True  # run_workers raises otherwise
    checks["trainable_params"] = {s: sorted(set(column(runs[s], "trainable_params"))) for s in SIDES}
    checks["trainable_params_identical"] = (
        len({n for v in checks["trainable_params"].values() for n in v}) == 1
    )
    checks["completion_length"] = {s: column(runs[s], "completion_length") for s in SIDES}
    config = {**vars(args), "worker": None, "no_write": None, "fresh": None}
    unit = _unit(config)
    ours, peer = "GRPOModule (Lightning)", "TRL GRPOTrainer"
    # fmt: off
    summary = [
        row(NAME, f"median time per optimisation step, s ({unit})", ours, peer,
            column(runs["ours"], "step_s_median"), column(runs["trl"], "step_s_median"), "lower"),
        row(NAME, f"peak RSS increase during steps, MiB ({unit})", ours, peer,
            column(runs["ours"], "peak_mib"), column(runs["trl"], "peak_mib"), "lower"),
    ]
    # fmt: on
    payload = result(
        NAME,
        __doc__,
        summary,
        config=config,
        checks=checks,
        passed=checks["prompt_tokens_identical"] and checks["trainable_params_identical"],
        packages=("torch", "transformers", "trl", "peft", "accelerate", "lightning", "datasets", "psutil"),
    )
    if not args.no_write and not args.fresh:
        payload = _merge(payload, RESULTS_DIR / f"{NAME}{f'-{args.tag}' if args.tag else ''}.json")
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
