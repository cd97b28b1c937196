"""Forward+backward time and peak memory: ``fused_linear_logprobs`` vs the naive full-logits computation.

Both methods compute per-token target log-probs and entropies from ``hidden @ Wᵀ`` and backpropagate a
loss with random weights on both outputs into ``hidden`` and ``W``:

* naive — full ``[tokens, vocab]`` logits, ``log_softmax``, gather, ``-Σ p log p``, autograd;
* ours  — :func:`lightning_llm.kernels.fused_linear_logprobs` (Triton kernels on CUDA, the chunked PyTorch
  reference on CPU).

Each method runs in a fresh subprocess, so one method's allocator state and high-water mark cannot leak
into the other's. Usage (from the repository root)::

    python benchmarks/fused_logprobs.py                      # 4096 tokens, vocab 32000, hidden 256
    python benchmarks/fused_logprobs.py --tokens 8192 --vocab 151936 --hidden 1024 --device cuda

Writes ``benchmarks/results/fused_logprobs.json`` (``--no-write`` to skip) and exits 1 if our peak memory
exceeds 25% of the naive one (the acceptance criterion of the op).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from functools import partial
from typing import Any

from _common import (
    machine_info,
    package_versions,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    spawn_worker,
    summary_row,
    time_repeated,
    utc_now,
    write_result,
)

NAME = "fused_logprobs"
MEMORY_CRITERION = 0.25  # ours' peak memory must be at most this fraction of naive's
METHODS = ("naive", "ours")
_MIB = 2**20

MEASUREMENT = {
    "time": "wall-clock seconds of one forward+backward (hidden and W both require grad, grads reset to None "
    "before each call), `reps` timed calls after `warmup` untimed ones; CUDA is synchronised around each call",
    "memory_cpu": "each method in its own fresh subprocess. After creating the inputs and one 2-token call "
    "(absorbs one-time imports/initialisation), baseline = current RSS (psutil). Then the warm-up calls, then "
    "the kernel's RSS high-water mark is reset (/proc/self/clear_refs = 5) and the timed calls run; "
    "peak_mib = VmHWM - baseline: the worst resident memory of a steady-state forward+backward, including "
    ".grad tensors and anything the allocator kept from earlier calls (falls back to ru_maxrss where VmHWM "
    "cannot be reset)",
    "memory_cuda": "after inputs and a 2-token call: baseline = torch.cuda.memory_allocated(), peak stats "
    "reset; peak_mib = max_memory_allocated() over warm-up and timed calls - baseline",
}


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="auto: fp32 on CPU, bf16 on CUDA",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="ours' chunk size (default: the op's rule)"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--no-write", action="store_true", help="print the result instead of writing the JSON"
    )
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)  # internal: run one method
    return parser.parse_args(argv)


def _resolve_device_dtype(args: argparse.Namespace) -> tuple[str, str]:
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = ("bfloat16" if device == "cuda" else "float32") if args.dtype == "auto" else args.dtype
    return device, dtype


def _naive(hidden: Any, weight: Any, targets: Any, temperature: float) -> tuple[Any, Any]:
    """The usual approach: materialise all logits, upcast to fp32 (as HF/TRL do), full log_softmax."""
    import torch

    log_p = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _ours(
    hidden: Any, weight: Any, targets: Any, temperature: float, *, chunk_size: int | None
) -> tuple[Any, Any]:
    from lightning_llm.kernels import fused_linear_logprobs

    return fused_linear_logprobs(hidden, weight, targets, chunk_size=chunk_size, temperature=temperature)


def _run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Set up inputs, then time and memory-profile one method in this (fresh) process."""
    import torch

    device, dtype_name = _resolve_device_dtype(args)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden**0.5).to(device, dtype)
    weight.requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    g_lp, g_ent = (torch.randn(args.tokens, generator=gen).to(device) for _ in range(2))
    method = _naive if args.worker == "naive" else partial(_ours, chunk_size=args.chunk_size)
    outputs: dict[str, Any] = {}

    def step(n_tokens: int = args.tokens) -> None:
        hidden.grad = weight.grad = None
        logprobs, entropy = method(hidden[:n_tokens], weight, targets[:n_tokens], args.temperature)
        ((logprobs * g_lp[:n_tokens]).sum() + (entropy * g_ent[:n_tokens]).sum()).backward()
        outputs["logprobs_sum"] = logprobs.sum().item()
        outputs["entropy_sum"] = entropy.sum().item()

    # One-time costs (imports, e.g. custom ops pull in torch._dynamo on first call; library init) belong to
    # the baseline, not to the method's working memory: trigger them on a 2-token call first.
    step(2)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    if cuda:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        baseline = rss_bytes()
    for _ in range(args.warmup):
        step()
    # Peak of the timed calls only, relative to the pre-warm-up baseline: anything the warm-up left
    # resident (cached blocks, .grad tensors) still counts against the method.
    hwm_reset = False if cuda else reset_peak_rss()
    timing = time_repeated(step, reps=args.reps, warmup=0, sync=sync)
    timing["warmup"] = args.warmup
    if cuda:
        memory = {
            "peak_mib": (torch.cuda.max_memory_allocated() - baseline) / _MIB,
            "baseline_mib": baseline / _MIB,
        }
    else:
        peak = peak_rss_bytes()
        memory = {
            "peak_mib": (peak - baseline) / _MIB,
            "baseline_rss_mib": baseline / _MIB,
            "peak_rss_mib": peak / _MIB,
            "peak_source": "VmHWM reset after warm-up"
            if hwm_reset
            else "ru_maxrss over the process lifetime",
        }
    checks = {
        **outputs,
        "grad_hidden_norm": hidden.grad.float().norm().item(),
        "grad_weight_norm": weight.grad.float().norm().item(),
    }
    return {"time_s": timing, "memory": memory, "checks": checks}


def _agreement(naive: dict[str, float], ours: dict[str, float], dtype: str) -> dict[str, Any]:
    """Relative differences of the sanity checksums; a fast-but-wrong "ours" must not pass silently."""
    tol = 1e-3 if dtype == "float32" else 3e-2
    rel = {k: abs(ours[k] - naive[k]) / max(abs(naive[k]), 1e-12) for k in naive}
    return {"relative_difference": rel, "tolerance": tol, "passed": all(v <= tol for v in rel.values())}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse_args(argv)
    if args.worker:
        print(json.dumps(_run_worker(args)))
        return 0

    import torch

    from lightning_llm.kernels import use_triton

    # the package re-exports the function under the module's name, hence import_module
    flp = importlib.import_module("lightning_llm.kernels.fused_linear_logprobs")
    device, dtype = _resolve_device_dtype(args)
    probe = torch.empty(0, device=device)
    backend = "triton" if use_triton(probe) else "torch reference"
    weight_meta = torch.empty(args.vocab, 1, dtype=getattr(torch, dtype), device="meta")
    chunk = flp._resolve_chunk_size(args.chunk_size or 0, args.tokens, weight_meta)
    results = {}
    for method in METHODS:
        print(f"running {method} ...", file=sys.stderr, flush=True)
        results[method] = spawn_worker(__file__, method, [a for a in argv if a != "--no-write"])

    naive, ours = results["naive"], results["ours"]
    time_ratio = ours["time_s"]["median"] / naive["time_s"]["median"]
    memory_ratio = ours["memory"]["peak_mib"] / naive["memory"]["peak_mib"]
    agreement = _agreement(naive["checks"], ours["checks"], dtype)
    passed = memory_ratio <= MEMORY_CRITERION
    unit = f"{args.tokens} tok x {args.vocab} vocab x {args.hidden} hidden, {dtype}, {device}"
    payload = {
        "benchmark": NAME,
        "description": "forward+backward of per-token target log-prob + full-vocabulary entropy from an LM head",
        "config": {
            "tokens": args.tokens,
            "vocab": args.vocab,
            "hidden": args.hidden,
            "dtype": dtype,
            "device": device,
            "temperature": args.temperature,
            "chunk_size": chunk,
            "ours_backend": backend,
            "reps": args.reps,
            "warmup": args.warmup,
        },
        "methods": {
            "naive": {"description": "full logits, log_softmax in fp32, gather, -sum p log p", **naive},
            "ours": {"description": f"lightning_llm.kernels.fused_linear_logprobs ({backend})", **ours},
        },
        "ratios": {"time_ours_over_naive": time_ratio, "peak_memory_ours_over_naive": memory_ratio},
        "acceptance": {
            "criterion": f"peak memory ours <= {MEMORY_CRITERION:.0%} of naive",
            "passed": passed,
        },
        "agreement": agreement,
        "measurement": {"time": MEASUREMENT["time"], "memory": MEASUREMENT[f"memory_{device}"]},
        "versions": package_versions(["torch", "triton", "lightning", "numpy", "psutil"]),
        "machine": machine_info(),
        "date": utc_now(),
        "summary": [
            summary_row(
                NAME,
                f"fused_linear_logprobs ({backend})",
                "naive full logits",
                f"fwd+bwd median time, s ({unit})",
                ours["time_s"]["median"],
                naive["time_s"]["median"],
                better="lower",
            ),
            summary_row(
                NAME,
                f"fused_linear_logprobs ({backend})",
                "naive full logits",
                f"fwd+bwd peak memory, MiB ({unit})",
                ours["memory"]["peak_mib"],
                naive["memory"]["peak_mib"],
                better="lower",
            ),
        ],
    }

    for method in METHODS:
        r = results[method]
        print(
            f"{method:>5}: median {r['time_s']['median'] * 1e3:8.1f} ms  min {r['time_s']['min'] * 1e3:8.1f} ms  "
            f"peak {r['memory']['peak_mib']:8.1f} MiB"
        )
    print(f"time ratio ours/naive {time_ratio:.2f}, peak memory ratio ours/naive {memory_ratio:.3f}")
    print(
        f"checksums agree: {agreement['passed']} (max rel diff {max(agreement['relative_difference'].values()):.2e})"
    )
    print(f"acceptance ({payload['acceptance']['criterion']}): {'PASS' if passed else 'FAIL'}")
    if args.no_write:
        print(json.dumps(payload, indent=2))
    else:
        print(f"wrote {write_result(NAME, payload)}")
    return 0 if passed and agreement["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
