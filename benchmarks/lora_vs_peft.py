"""Time per training step and peak memory of LoRA fine-tuning: ``lightning_llm`` LoRA (plain, ScaLoRA) vs PEFT.

Four variants train the same LoRA adapter on the same model with the same batches, in the identical bare torch
step (``loss = model(input_ids, attention_mask, labels=labels).loss``, ``backward``, [rescale],
``optimizer.step()``, ``zero_grad``), so only the LoRA implementations differ (``grpo_vs_trl.py`` compares
whole frameworks): ``lora``, ours :func:`lightning_llm.lora.apply_lora` (``LoRALinear``: the fused
``lora_linear`` op on CUDA, the same formula in plain PyTorch on CPU); ``scalora1`` / ``scalora10``, ours +
``ScaLoRA(interval).rescale(model, optimizer)`` after the backward every step / every 10th step (the callback's
rule, ``rank_every=0``); ``peft``, ``peft.get_peft_model`` with the same config.

Matched: the model (``--model``, loaded by path on PEFT's side), fp32, no dropout; ``r``, ``alpha``, the
q/k/v/o/gate/up/down targets, PEFT's default init from the same seed (trainable parameter counts checked);
the same ``ChatSFTDataModule`` batches in the same order (the workers' batch digests must agree); AdamW, no
schedule or clipping; one torch thread. ScaLoRA changes the trajectory (its purpose), not the work per step.

A step's time is the interval around those calls; per repetition the MEAN over the timed steps (amortised, so
one rescale in ten counts; ``--steps`` a multiple of 10), each variant in a fresh process per repetition
(paired). Correctness (in the parent first): the step-0 losses of both same-seed inits agree, then with PEFT's
factors set to ours both train ``--check-steps`` steps with every loss within ``--check-tol``. Exits 1 if that
fails or ScaLoRA at interval 10 costs more than 1.3x a plain LoRA step (the issue's acceptance criterion).

    python benchmarks/lora_vs_peft.py                       # batch 8, 5 warm-up + 60 timed steps, 5 reps
    python benchmarks/lora_vs_peft.py --model DIR --r 16 --alpha 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
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
    set_threads,
    worker_argv,
    worker_main,
)

NAME = "lora_vs_peft"
SIDES = ("lora", "scalora1", "scalora10", "peft")
SCALORA_INTERVAL = {"scalora1": 1, "scalora10": 10}
SCALORA10_CRITERION = 1.3  # ScaLoRA at interval 10: amortised step time at most this multiple of plain LoRA's


def _config(args: argparse.Namespace) -> Any:
    from lightning_llm.lora import DEFAULT_TARGET_MODULES, LoRAConfig

    return LoRAConfig(r=args.r, alpha=args.alpha, target_modules=list(DEFAULT_TARGET_MODULES), dropout=0.0)


def _batches(args: argparse.Namespace, count: int) -> list[dict[str, Any]]:
    """``count`` collated SFT batches in a fixed order."""
    from lightning_llm.datamodules import ChatSFTDataModule

    # fmt: off
    dm = ChatSFTDataModule(
        task="arithmetic", tokenizer=args.model, num_train=args.batch_size * count, num_val=0,
        batch_size=args.batch_size, max_length=args.max_length, seed=args.seed, shuffle=False,
    )
    # fmt: on
    dm.prepare_data()
    dm.setup("fit")
    batches = [{k: b[k] for k in ("input_ids", "attention_mask", "labels")} for b in dm.train_dataloader()]
    if len(batches) < count:
        raise RuntimeError(f"the DataModule gave {len(batches)} batches, expected {count}")
    return batches[:count]


def _ours(args: argparse.Namespace) -> Any:
    import torch

    from lightning_llm.backbones import load_backbone
    from lightning_llm.lora import apply_lora

    model, _ = load_backbone(args.model)
    model.config.use_cache = False
    torch.manual_seed(args.seed)
    apply_lora(model, _config(args))
    return model.train()


def _peft(args: argparse.Namespace) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_llm.backbones import load_tokenizer

    config = _config(args)
    model = AutoModelForCausalLM.from_pretrained(load_tokenizer(args.model).name_or_path)
    model.config.use_cache = False
    torch.manual_seed(args.seed)
    # fmt: off
    peft_config = LoraConfig(
        r=config.r, lora_alpha=config.alpha, target_modules=list(config.target_modules), lora_dropout=0.0,
        bias="none", use_rslora=False, init_lora_weights=True, task_type="CAUSAL_LM",
    )
    # fmt: on
    return get_peft_model(model, peft_config).train()


def _optimizer(model: Any, lr: float) -> Any:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def _trainable(model: Any) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _loss(model: Any, batch: dict[str, Any]) -> Any:
    return model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    ).loss


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    batches = _batches(args, args.warmup + args.steps)
    model = _peft(args) if args.worker == "peft" else _ours(args)
    optimizer = _optimizer(model, args.lr)
    scalora = None
    if args.worker in SCALORA_INTERVAL:
        from lightning_llm.callbacks import ScaLoRA

        scalora = ScaLoRA(interval=SCALORA_INTERVAL[args.worker], rank_every=0)
    clock = StepClock(args.warmup)
    clock.before_fit()
    for step, batch in enumerate(batches):
        clock.train_start()
        loss = _loss(model, batch)
        loss.backward()
        if scalora is not None and step % scalora.interval == 0:
            scalora.rescale(model, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.step_end(loss=float(loss.detach()))
    out = clock.result()
    del out["values"]
    return {**out, "inputs": digest(batches), "trainable_params": _trainable(model)}


def _correctness(args: argparse.Namespace) -> dict[str, Any]:
    """Step-0 losses of independent same-seed inits, then N steps' losses with PEFT's factors set to ours."""
    import torch

    from lightning_llm.lora import lora_layers

    set_threads(args.threads)
    batches = _batches(args, args.check_steps)
    ours, peft = _ours(args), _peft(args)
    with torch.no_grad():
        step0 = abs(float(_loss(ours, batches[0])) - float(_loss(peft, batches[0])))
        inner = peft.base_model.model
        for path, layer in lora_layers(ours).items():
            target = inner.get_submodule(path)
            target.lora_A["default"].weight.copy_(layer.lora_A.weight)
            target.lora_B["default"].weight.copy_(layer.lora_B.weight)
    optimizers = _optimizer(ours, args.lr), _optimizer(peft, args.lr)
    diffs = []
    for batch in batches:
        losses = []
        for model, opt in zip((ours, peft), optimizers, strict=True):
            loss = _loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        diffs.append(abs(losses[0] - losses[1]))
    return {
        "step0_abs_diff": step0,
        "max_abs_loss_diff": max(diffs),
        "tolerance": args.check_tol,
        "trainable_params_equal": _trainable(ours) == _trainable(peft),
        "passed": step0 <= args.check_tol
        and max(diffs) <= args.check_tol
        and _trainable(ours) == _trainable(peft),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__, warmup=5, sides=SIDES)
    p.add_argument("--model", default="tiny", help="backbone name or directory (every variant)")
    p.add_argument("--r", type=int, default=8, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale alpha / r)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=60, help="timed steps per repetition (a multiple of 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-steps", type=int, default=10, help="training steps of the correctness check")
    p.add_argument("--check-tol", type=float, default=1e-5, help="max |loss_ours - loss_peft| allowed")
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args, _worker)

    correctness = _correctness(args)
    runs = run_workers(__file__, SIDES, worker_argv(argv), args.reps)
    means = {s: column(runs[s], "step_s_mean") for s in SIDES}
    overhead = statistics.median(a / b for a, b in zip(means["scalora10"], means["lora"], strict=True))
    checks = {
        "correctness": correctness,
        "inputs_identical": True,  # run_workers raises otherwise
        "trainable_params_identical": len({r["trainable_params"] for s in SIDES for r in runs[s]}) == 1,
        "scalora10_over_lora_median_paired_ratio": overhead,
        "scalora10_overhead_le_1_3": overhead <= SCALORA10_CRITERION,
    }
    unit = (
        f"r={args.r}, alpha={args.alpha:g}, qkvo+mlp, batch {args.batch_size}, {args.model}, fp32, cpu, "
        f"{args.threads or 'default'} thread(s)"
    )
    metric = f"mean time per training step, s ({unit})"
    # fmt: off
    summary = [
        row(NAME, metric, "LoRA (apply_lora)", "PEFT LoRA", means["lora"], means["peft"], "lower"),
        row(NAME, f"peak RSS increase during steps, MiB ({unit})", "LoRA (apply_lora)", "PEFT LoRA",
            column(runs["lora"], "peak_mib"), column(runs["peft"], "peak_mib"), "lower"),
        row(NAME, metric, "LoRA + ScaLoRA (interval 10)", "PEFT LoRA", means["scalora10"], means["peft"],
            "lower"),
        row(NAME, metric, "LoRA + ScaLoRA (interval 1)", "PEFT LoRA", means["scalora1"], means["peft"],
            "lower"),
    ]
    # fmt: on
    payload = result(
        NAME,
        __doc__,
        summary,
        config={**vars(args), "worker": None, "no_write": None},
        checks=checks,
        passed=correctness["passed"]
        and checks["trainable_params_identical"]
        and checks["scalora10_overhead_le_1_3"],
        details={s: {"peak_mib": column(runs[s], "peak_mib"), "step_s_mean": means[s]} for s in SIDES},
        packages=("torch", "transformers", "peft", "lightning", "psutil"),
    )
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
