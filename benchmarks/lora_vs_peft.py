"""Time per training step and peak memory of LoRA fine-tuning: ``lightning_llm`` LoRA (plain and with ScaLoRA) vs PEFT.

Four variants train the same LoRA adapter on the same tiny model with the same batches:

* ``lora``      — ours: :func:`lightning_llm.modules.lora.apply_lora` (``LoRALinear``: on CUDA its forward is
  the fused op :func:`lightning_llm.kernels.lora_linear`; on CPU, as here, the same formula in plain PyTorch);
* ``scalora1``  — ours + ScaLoRA every step: ``ScaLoRA(interval=1).rescale(model, optimizer)`` after the
  backward pass and before ``optimizer.step()``, exactly what the callback's ``on_before_optimizer_step`` does;
* ``scalora10`` — the same every 10th optimizer step (step index ``% 10 == 0``, the callback's rule);
* ``peft``      — ``peft.get_peft_model`` with the same ``LoraConfig``.

Why a bare torch loop, not ``CausalLMModule`` under a Lightning ``Trainer``: the question is what the LoRA
implementations (and ScaLoRA's rescale) cost, so every variant runs the identical hand-written step —
``loss = model(input_ids, attention_mask, labels=labels).loss`` (the HF model's own loss on every side),
``loss.backward()``, [rescale], ``optimizer.step()``, ``optimizer.zero_grad()`` — and nothing else differs.
A Lightning-vs-bare-loop comparison would mostly measure the loops (``benchmarks/grpo_vs_trl.py`` compares
whole frameworks).

A step's time is the wall-clock interval around those calls; batches are collated before training, so data
loading is outside. The first ``--warmup`` steps are discarded. Because ScaLoRA at interval 10 does its work
on one step in ten, the per-step *median* would hide it; the headline number is therefore the amortised
time, the **mean over the timed steps** of one repetition (``--steps`` should be a multiple of 10 so every
variant's window holds a whole number of rescale periods), and across repetitions the median of those
means. Per-step medians and every step's time are recorded too.

Each variant runs in its own fresh interpreter per repetition (``--reps``, interleaved, alternating the order
each repetition), so allocator state, imports and RSS high-water marks cannot leak between variants.

Matched (the same for all variants):

* model: the embedded tiny Llama backbone, fp32; ours loads it with ``load_backbone("tiny")``, PEFT's side
  with ``AutoModelForCausalLM.from_pretrained(_tiny_dir())`` (the same directory); the default attention
  implementation (recorded), ``use_cache=False`` (as ``CausalLMModule`` sets), train mode, no gradient
  checkpointing, no dropout anywhere;
* LoRA: ``r``, ``alpha`` (scale ``alpha / r``, no rsLoRA), targets q/k/v/o/gate/up/down projections of every
  layer, adapter dropout 0, no bias training; init as PEFT's default on both sides (``A`` Kaiming-uniform
  with ``a = √5``, ``B = 0``) from the same seed; the number of trainable parameters (checked equal);
* data: the same ``ChatSFTDataModule(task="arithmetic", shuffle=False)`` batches in the same order, collated
  before the timed loop; the parent checks that every worker saw identical batches (a digest of them);
* loss: the HF model's own masked next-token cross-entropy (``labels`` with ``-100`` on prompt and padding);
* optimizer: ``torch.optim.AdamW`` over the trainable parameters, same lr, betas, eps, weight decay 0, no
  schedule, no gradient clipping, ``zero_grad(set_to_none=True)``;
* torch threads: one by default in every worker (recorded), for the reason ``grpo_vs_trl.py`` gives: on a
  small shared machine, OpenMP threads of a multi-threaded process that competes with other jobs spin-wait on
  each other and single steps become several times slower at random; ``--threads 0`` uses torch's default.

Not matched / not measured:

* ScaLoRA changes the training trajectory (that is its purpose), so its losses differ from plain LoRA's
  after the first rescale; the model and batch shapes, hence the forward/backward work, do not change;
* the ScaLoRA callback's logging (``pl_module.log``) and its optional stable-rank SVD every ``rank_every``
  steps (default 50) are Lightning-side extras outside ``rescale`` and are not timed here (``rank_every=0``);
* baseline memory differs by variant (PEFT and Lightning import different modules); only the increase over
  each process's own pre-training RSS is compared (absolute numbers are recorded too).

Correctness check (in the parent, before timing, same thread count): at step 0, with each side initialised
from the same seed and ``B = 0``, the two losses on the first batch must agree; then PEFT's ``lora_A``/``lora_B``
are overwritten with ours and both train ``--check-steps`` steps on the same batches: every step's loss must
agree to ``--check-tol`` (default 1e-5), which shows the timed computation is the same on both sides.

Usage (from the repository root)::

    python benchmarks/lora_vs_peft.py                           # batch 8, 5 warm-up + 60 timed steps, 9 reps
    python benchmarks/lora_vs_peft.py --batch-size 16 --steps 30 --reps 3 --r 16 --alpha 32

Writes ``benchmarks/results/lora_vs_peft.json`` (``--no-write`` to skip) and exits 1 if the correctness check
fails or ScaLoRA at interval 10 costs more than 1.3x a plain LoRA step (the issue's acceptance criterion).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import sys
import time
from typing import Any

from _common import (
    machine_info,
    package_versions,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    spawn_worker,
    summary_row,
    utc_now,
    write_result,
)

NAME = "lora_vs_peft"
VARIANTS = ("lora", "scalora1", "scalora10", "peft")
SCALORA_INTERVAL = {"scalora1": 1, "scalora10": 10}
SCALORA10_CRITERION = 1.3  # ScaLoRA at interval 10: amortised step time at most this multiple of plain LoRA's
DESCRIPTIONS = {
    "lora": "lightning_llm apply_lora (LoRALinear, fused lora_linear op; torch reference path on CPU)",
    "scalora1": "lightning_llm LoRA + ScaLoRA(interval=1).rescale before every optimizer.step()",
    "scalora10": "lightning_llm LoRA + ScaLoRA(interval=10).rescale before every 10th optimizer.step()",
    "peft": "peft.get_peft_model(LoraConfig(...)) on the same model directory",
}
_MIB = 2**20

MEASUREMENT = {
    "time": "per repetition, a fresh process per variant runs warmup + steps identical training steps "
    "(forward with labels, backward, [ScaLoRA rescale], AdamW step, zero_grad), timed with perf_counter "
    "around exactly those calls; batches are collated beforehand. Warm-up steps are dropped. Per repetition: "
    "the mean over the timed steps (amortised, so one rescale in ten counts for ScaLoRA-10) and the median; "
    "reported: the median over repetitions of the per-repetition means (time_s.median), their min, and "
    "every timed step (all_steps)",
    "memory_cpu": "each variant in its own fresh subprocess: baseline = RSS (psutil) after the model, LoRA "
    "layers, optimizer and batches exist, right before the first step (gc.collect() first). At the end of the "
    "last warm-up step the kernel's RSS high-water mark is reset (/proc/self/clear_refs = 5); peak_mib = "
    "VmHWM after the timed steps - baseline: the worst resident memory of a steady-state step including "
    "AdamW state and gradients (ru_maxrss over the process lifetime where VmHWM cannot be reset); step_mib = "
    "VmHWM - RSS at the reset point (not in the summary). Reported: medians over repetitions",
}


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--r", type=int, default=8, help="LoRA rank")
    parser.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale alpha / r)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per repetition (>= 10)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--reps", type=int, default=9, help="repetitions (fresh processes per variant)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads in every worker (0: torch's default, one per core); see the module docstring",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS),
        help="which variants to time (ratios need lora, scalora10 and peft)",
    )
    parser.add_argument("--check-steps", type=int, default=10, help="training steps of the correctness check")
    parser.add_argument("--check-tol", type=float, default=1e-5, help="max |loss_ours - loss_peft| allowed")
    parser.add_argument(
        "--no-write", action="store_true", help="print the result instead of writing the JSON"
    )
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: run one variant
    args = parser.parse_args(argv)
    if args.steps < 10 or args.reps < 1 or args.warmup < 1 or args.check_steps < 1:
        parser.error("need --steps >= 10, --reps >= 1, --warmup >= 1 and --check-steps >= 1")
    if "peft" not in args.variants and not args.no_write and not args.worker:
        parser.error(
            "the result file's summary compares with PEFT: keep 'peft' in --variants or use --no-write"
        )
    return args


# ------------------------------------------------------------------------------------------------ setup


def _total_steps(args: argparse.Namespace) -> int:
    return args.warmup + args.steps


def _lora_config(args: argparse.Namespace) -> Any:
    from lightning_llm.modules.lora import DEFAULT_TARGET_MODULES, LoRAConfig

    return LoRAConfig(r=args.r, alpha=args.alpha, target_modules=list(DEFAULT_TARGET_MODULES), dropout=0.0)


def _batches(args: argparse.Namespace, count: int) -> list[dict[str, Any]]:
    """``count`` collated SFT batches in a fixed order (one epoch of distinct examples)."""
    from lightning_llm.datamodules import ChatSFTDataModule

    dm = ChatSFTDataModule(
        task="arithmetic",
        num_train=args.batch_size * count,
        num_val=0,
        batch_size=args.batch_size,
        max_length=args.max_length,
        seed=args.seed,
        shuffle=False,
    )
    dm.prepare_data()
    dm.setup("fit")
    batches = [
        {k: batch[k] for k in ("input_ids", "attention_mask", "labels")} for batch in dm.train_dataloader()
    ]
    if len(batches) < count:
        raise RuntimeError(f"the DataModule gave {len(batches)} batches, expected {count}")
    return batches[:count]


def _digest(batches: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for batch in batches:
        for key in ("input_ids", "attention_mask", "labels"):
            h.update(batch[key].numpy().tobytes())
            h.update(str(tuple(batch[key].shape)).encode())
    return h.hexdigest()[:16]


def _ours_model(args: argparse.Namespace) -> Any:
    """The tiny model with our LoRA layers (A drawn from the global RNG, seeded here)."""
    import torch

    from lightning_llm.backbone import load_backbone
    from lightning_llm.modules.lora import apply_lora

    model, _ = load_backbone("tiny")
    model.config.use_cache = False
    torch.manual_seed(args.seed)
    apply_lora(model, _lora_config(args))
    return model.train()


def _peft_model(args: argparse.Namespace) -> Any:
    """The same directory loaded by path, wrapped by PEFT with the same LoRA config (PEFT's default init)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_llm.backbone import _tiny_dir

    config = _lora_config(args)
    model = AutoModelForCausalLM.from_pretrained(str(_tiny_dir()))
    model.config.use_cache = False
    torch.manual_seed(args.seed)
    peft_config = LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        target_modules=list(config.target_modules),
        lora_dropout=0.0,
        bias="none",
        use_rslora=False,
        init_lora_weights=True,  # A Kaiming-uniform (a = √5), B = 0
        task_type="CAUSAL_LM",
    )
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


# ------------------------------------------------------------------------------------------------ worker


def _run_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    variant = args.worker
    batches = _batches(args, _total_steps(args))
    model = _peft_model(args) if variant == "peft" else _ours_model(args)
    optimizer = _optimizer(model, args.lr)
    scalora = None
    if variant in SCALORA_INTERVAL:
        from lightning_llm.callbacks import ScaLoRA

        scalora = ScaLoRA(interval=SCALORA_INTERVAL[variant], rank_every=0)

    gc.collect()
    baseline = rss_bytes()
    times: list[float] = []
    losses: list[float] = []
    rss_mib: list[float] = []
    rss_at_reset, hwm_reset, rescales = 0, False, 0
    for step, batch in enumerate(batches):
        start = time.perf_counter()
        loss = _loss(model, batch)
        loss.backward()
        if scalora is not None and step % scalora.interval == 0:
            scalora.rescale(model, optimizer)
            rescales += step >= args.warmup
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        rss_mib.append(rss_bytes() / _MIB)
        if step + 1 == args.warmup:
            rss_at_reset = rss_bytes()
            hwm_reset = reset_peak_rss()
    peak = peak_rss_bytes()
    timed = times[args.warmup :]
    return {
        "time_s": {
            "mean": statistics.fmean(timed),
            "median_step": statistics.median(timed),
            "min_step": min(timed),
            "steps": timed,
            "warmup_steps": times[: args.warmup],
        },
        "memory": {
            "peak_mib": (peak - baseline) / _MIB,
            "baseline_rss_mib": baseline / _MIB,
            "rss_after_warmup_mib": rss_at_reset / _MIB,
            "step_mib": (peak - rss_at_reset) / _MIB,
            "peak_rss_mib": peak / _MIB,
            "rss_after_each_step_mib": rss_mib,
            "peak_source": "VmHWM reset after warm-up"
            if hwm_reset
            else "ru_maxrss over the process lifetime",
        },
        "losses": losses,
        "info": {
            "trainable_params": _trainable(model),
            "batch_digest": _digest(batches),
            "tokens_per_step_mean": statistics.fmean(b["input_ids"].numel() for b in batches),
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "param_dtype": str(next(model.parameters()).dtype),
            "torch_threads": torch.get_num_threads(),
            "scalora_rescales_in_timed_steps": rescales if scalora is not None else None,
            "scalora_counts": dict(scalora.counts) if scalora is not None else None,
        },
    }


# ------------------------------------------------------------------------------------------ correctness


def _correctness_check(args: argparse.Namespace) -> dict[str, Any]:
    """Step-0 losses with independent same-seed inits, then losses of N steps with PEFT's factors set to ours."""
    import torch

    from lightning_llm.modules.lora import lora_layers

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = _batches(args, args.check_steps)
    ours, peft = _ours_model(args), _peft_model(args)
    with torch.no_grad():
        step0 = (float(_loss(ours, batches[0])), float(_loss(peft, batches[0])))

    # Give PEFT exactly our factors (A from our init, B = 0) so both trajectories start identical.
    inner = peft.base_model.model
    copied = 0
    same_a_at_init = True
    with torch.no_grad():
        for path, layer in lora_layers(ours).items():
            target = inner.get_submodule(path)
            peft_a, peft_b = target.lora_A["default"].weight, target.lora_B["default"].weight
            same_a_at_init &= bool(torch.equal(peft_a, layer.lora_A.weight))
            peft_a.copy_(layer.lora_A.weight)
            peft_b.copy_(layer.lora_B.weight)
            copied += 1
    opt_ours, opt_peft = _optimizer(ours, args.lr), _optimizer(peft, args.lr)
    losses: dict[str, list[float]] = {"ours": [], "peft": []}
    for batch in batches:
        for key, model, opt in (("ours", ours, opt_ours), ("peft", peft, opt_peft)):
            loss = _loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[key].append(float(loss.detach()))
    diffs = [abs(a - b) for a, b in zip(losses["ours"], losses["peft"], strict=True)]
    max_factor_diff = 0.0
    with torch.no_grad():
        for path, layer in lora_layers(ours).items():
            target = inner.get_submodule(path)
            for mine, theirs in (
                (layer.lora_A.weight, target.lora_A["default"]),
                (layer.lora_B.weight, target.lora_B["default"]),
            ):
                max_factor_diff = max(max_factor_diff, float((mine - theirs.weight).abs().max()))
    step0_diff = abs(step0[0] - step0[1])
    return {
        "step0_loss": {"ours": step0[0], "peft": step0[1], "abs_diff": step0_diff},
        "step0_losses_equal": step0_diff <= args.check_tol,
        "peft_a_equal_ours_at_init_without_copy": same_a_at_init,
        "layers_copied": copied,
        "trainable_params": {"ours": _trainable(ours), "peft": _trainable(peft)},
        "trainable_params_equal": _trainable(ours) == _trainable(peft),
        "steps": args.check_steps,
        "losses": losses,
        "max_abs_loss_diff": max(diffs),
        "max_abs_factor_diff_after_training": max_factor_diff,
        "tolerance": args.check_tol,
        "losses_equal_within_tol": max(diffs) <= args.check_tol,
    }


# ----------------------------------------------------------------------------------------------- driver


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    means = [r["time_s"]["mean"] for r in runs]
    peaks = [r["memory"]["peak_mib"] for r in runs]
    return {
        "time_s": {
            "median": statistics.median(means),
            "min": min(means),
            "all": means,
            "median_step_per_rep": [r["time_s"]["median_step"] for r in runs],
            "all_steps": [s for r in runs for s in r["time_s"]["steps"]],
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
        "final_loss": [r["losses"][-1] for r in runs],
        "info": runs[0]["info"],
        "repetitions": runs,
    }


def _ratio(results: dict[str, Any], num: str, den: str, key: str = "time_s") -> float | None:
    if num not in results or den not in results:
        return None
    field = "median" if key == "time_s" else "peak_mib"
    return results[num][key][field] / results[den][key][field]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse_args(argv)
    if args.worker:
        print(json.dumps(_run_worker(args)))
        return 0

    print("correctness check (ours vs PEFT losses) ...", file=sys.stderr, flush=True)
    correctness = _correctness_check(args)
    gc.collect()
    worker_argv = [a for a in argv if a != "--no-write"]
    variants = tuple(v for v in VARIANTS if v in args.variants)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(args.reps):
        order = variants if rep % 2 == 0 else variants[::-1]
        for variant in order:
            print(f"rep {rep + 1}/{args.reps}: running {variant} ...", file=sys.stderr, flush=True)
            r = spawn_worker(__file__, variant, worker_argv)
            runs[variant].append(r)
            print(
                f"  mean {r['time_s']['mean'] * 1e3:.2f} ms/step (median step "
                f"{r['time_s']['median_step'] * 1e3:.2f}), peak +{r['memory']['peak_mib']:.1f} MiB",
                file=sys.stderr,
                flush=True,
            )
    results = {v: _aggregate(runs[v]) for v in variants}
    digests = {v: results[v]["info"]["batch_digest"] for v in variants}
    params = {v: results[v]["info"]["trainable_params"] for v in variants}
    ratios = {
        "time_ours_lora_over_peft": _ratio(results, "lora", "peft"),
        "peak_memory_ours_lora_over_peft": _ratio(results, "lora", "peft", "memory"),
        "time_scalora10_over_ours_lora": _ratio(results, "scalora10", "lora"),
        "time_scalora1_over_ours_lora": _ratio(results, "scalora1", "lora"),
        "time_scalora10_over_peft": _ratio(results, "scalora10", "peft"),
        "time_scalora1_over_peft": _ratio(results, "scalora1", "peft"),
        "peak_memory_scalora10_over_ours_lora": _ratio(results, "scalora10", "lora", "memory"),
        "peak_memory_scalora1_over_ours_lora": _ratio(results, "scalora1", "lora", "memory"),
    }
    overhead = ratios["time_scalora10_over_ours_lora"]
    checks = {
        "scalora10_overhead_le_1_3": None if overhead is None else overhead <= SCALORA10_CRITERION,
        "scalora10_over_ours_lora": overhead,
        "scalora10_criterion": f"amortised step time of ScaLoRA(interval=10) <= {SCALORA10_CRITERION:g} x "
        "plain LoRA's (ours)",
        "batches_identical_across_variants": len(set(digests.values())) == 1,
        "batch_digests": digests,
        "trainable_params_identical_across_variants": len(set(params.values())) == 1,
        "correctness": correctness,
    }
    correct = (
        correctness["step0_losses_equal"]
        and correctness["losses_equal_within_tol"]
        and correctness["trainable_params_equal"]
        and checks["batches_identical_across_variants"]
        and checks["trainable_params_identical_across_variants"]
    )
    info = results[variants[0]]["info"]
    unit = (
        f"r={args.r}, alpha={args.alpha:g}, qkvo+mlp, batch {args.batch_size}, tiny, fp32, cpu, "
        f"{args.threads or 'default'} thread(s)"
    )
    summary = []
    if "lora" in results and "peft" in results:
        summary.append(
            summary_row(
                NAME,
                "LoRA (apply_lora)",
                "PEFT LoRA",
                f"mean time per training step, s ({unit})",
                results["lora"]["time_s"]["median"],
                results["peft"]["time_s"]["median"],
                better="lower",
            )
        )
        summary.append(
            summary_row(
                NAME,
                "LoRA (apply_lora)",
                "PEFT LoRA",
                f"peak RSS increase during steps, MiB ({unit})",
                results["lora"]["memory"]["peak_mib"],
                results["peft"]["memory"]["peak_mib"],
                better="lower",
            )
        )
    for variant, interval in (("scalora10", 10), ("scalora1", 1)):
        if variant in results and "peft" in results:
            summary.append(
                summary_row(
                    NAME,
                    f"LoRA + ScaLoRA (interval {interval})",
                    "PEFT LoRA",
                    f"mean time per training step, s ({unit})",
                    results[variant]["time_s"]["median"],
                    results["peft"]["time_s"]["median"],
                    better="lower",
                )
            )
    payload = {
        "benchmark": NAME,
        "description": "one LoRA training step (forward with labels, backward, [ScaLoRA rescale], AdamW step, "
        "zero_grad) in the same bare torch loop for every variant",
        "config": {
            "model": "tiny (lightning_llm.backbone; PEFT's side loads the same directory by path)",
            "task": "arithmetic (ChatSFTDataModule, shuffle=False)",
            "lora": {
                "r": args.r,
                "alpha": args.alpha,
                "scale": args.alpha / args.r,
                "target_modules": list(_lora_config(args).target_modules),
                "dropout": 0.0,
                "use_rslora": False,
                "init": "A Kaiming-uniform (a=sqrt(5)), B=0 (PEFT default), same seed",
            },
            "batch_size": args.batch_size,
            "max_length": args.max_length,
            "tokens_per_step_mean": info["tokens_per_step_mean"],
            "optimizer": f"torch.optim.AdamW(lr={args.lr:g}, betas=(0.9, 0.999), eps=1e-8, weight_decay=0), "
            "no schedule, no clipping",
            "scalora": "ScaLoRA(interval, rank_every=0).rescale(model, optimizer) before optimizer.step() when "
            "step % interval == 0 (lipschitz=None, fallback='scalar')",
            "dtype": "float32",
            "device": "cpu",
            "use_cache": False,
            "attn_implementation": info["attn_implementation"],
            "steps": args.steps,
            "warmup": args.warmup,
            "reps": args.reps,
            "seed": args.seed,
            "worker_torch_threads": args.threads or "torch default",
            "variants": list(variants),
        },
        "variants": {v: {"description": DESCRIPTIONS[v], **results[v]} for v in variants},
        "ratios": ratios,
        "checks": checks,
        "acceptance": {
            "criterion": checks["scalora10_criterion"],
            "passed": checks["scalora10_overhead_le_1_3"],
        },
        "measurement": MEASUREMENT,
        "versions": package_versions(["torch", "transformers", "peft", "lightning", "psutil"]),
        "machine": machine_info(),
        "date": utc_now(),
        "summary": summary,
    }

    for v in variants:
        r = results[v]
        print(
            f"{v:>9}: mean {r['time_s']['median'] * 1e3:7.2f} ms/step (median over reps; min {r['time_s']['min'] * 1e3:.2f})"
            f"  reps {[round(t * 1e3, 2) for t in r['time_s']['all']]}  peak +{r['memory']['peak_mib']:.1f} MiB"
        )
    for key, value in ratios.items():
        if value is not None:
            print(f"{key}: {value:.3f}")
    print(
        f"correctness: step-0 |diff| {correctness['step0_loss']['abs_diff']:.2e}, max |loss diff| over "
        f"{correctness['steps']} steps {correctness['max_abs_loss_diff']:.2e} (tol {args.check_tol:g}); "
        f"batches identical {checks['batches_identical_across_variants']}; "
        f"trainable params identical {checks['trainable_params_identical_across_variants']} ({params})"
    )
    passed = checks["scalora10_overhead_le_1_3"]
    print(
        f"acceptance ({checks['scalora10_criterion']}): {'n/a' if passed is None else 'PASS' if passed else 'FAIL'}"
    )
    if args.no_write:
        print(json.dumps(payload, indent=2))
    else:
        print(f"wrote {write_result(NAME, payload)}")
    return 0 if correct and passed is not False else 1


if __name__ == "__main__":
    sys.exit(main())
