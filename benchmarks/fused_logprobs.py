"""Forward+backward time and peak memory: ``fused_linear_logprobs`` vs the naive full-logits computation.

Both compute per-token target log-probs and entropies from ``hidden @ Wᵀ`` and backpropagate a loss with random
weights on both outputs into ``hidden`` and ``W``: naive = full ``[tokens, vocab]`` logits, ``log_softmax`` in
fp32, gather, ``-Σ p log p``, autograd; ours = :func:`lightning_llm.kernels.fused_linear_logprobs` (Triton
kernels on CUDA, the chunked PyTorch reference on CPU). Same seeded inputs on both sides (digest checked).

Each repetition runs each method in a fresh process (paired, order alternating): inputs, one 2-token call
(one-time imports and initialisation), the memory baseline (RSS on CPU, ``memory_allocated`` on CUDA), the
warm-up calls, a reset of the high-water mark, then the timed call(s). Peak memory = high-water mark of the
timed calls above the baseline, counting ``.grad`` tensors and whatever the warm-up left resident. Exits 1 when
our peak memory is above 25% of the naive one (the op's acceptance criterion) or the checksums disagree.

    python benchmarks/fused_logprobs.py                      # 4096 tokens, vocab 32000, hidden 256
    python benchmarks/fused_logprobs.py --tokens 8192 --vocab 151936 --hidden 1024 --device cuda
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from _harness import (
    column,
    digest,
    finish,
    parser,
    peak_rss_bytes,
    reset_peak_rss,
    result,
    row,
    rss_bytes,
    run_workers,
    worker_argv,
    worker_main,
)

NAME = "fused_logprobs"
SIDES = ("ours", "naive")
MEMORY_CRITERION = 0.25  # ours' peak memory must be at most this fraction of naive's
_MIB = 2**20


def _device_dtype(args: argparse.Namespace) -> tuple[str, str]:
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = ("bfloat16" if device == "cuda" else "float32") if args.dtype == "auto" else args.dtype
    return device, dtype


def _naive(hidden: Any, weight: Any, targets: Any, temperature: float) -> tuple[Any, Any]:
    """The usual approach: materialise all logits, upcast to fp32 (as HF/TRL do), full log_softmax."""
    import torch

    log_p = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lightning_llm.kernels import fused_linear_logprobs

    device, dtype = _device_dtype(args)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device, getattr(torch, dtype))
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden**0.5).to(device, hidden.dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    g_lp, g_ent = (torch.randn(args.tokens, generator=gen).to(device) for _ in range(2))
    inputs = digest(hidden, weight, targets, g_lp, g_ent)
    hidden.requires_grad_()
    weight.requires_grad_()
    if args.worker == "naive":
        method = _naive
    else:

        def method(h, w, t, temperature):
            return fused_linear_logprobs(h, w, t, chunk_size=args.chunk_size, temperature=temperature)

    out: dict[str, float] = {}

    def step(n: int = args.tokens) -> None:
        hidden.grad = weight.grad = None
        logprobs, entropy = method(hidden[:n], weight, targets[:n], args.temperature)
        ((logprobs * g_lp[:n]).sum() + (entropy * g_ent[:n]).sum()).backward()
        out.update(logprobs_sum=logprobs.sum().item(), entropy_sum=entropy.sum().item())

    step(2)  # one-time imports / initialisation belong to the baseline
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        sync()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        baseline = rss_bytes()
    for _ in range(args.warmup):
        step()
    hwm_reset = False if cuda else reset_peak_rss()
    times = []
    for _ in range(args.calls):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
    return {
        "time_s": min(times),
        "peak_mib": (peak - baseline) / _MIB,
        "hwm_reset": hwm_reset,
        "inputs": inputs,
        "checks": {
            **out,
            "grad_hidden_norm": hidden.grad.float().norm().item(),
            "grad_weight_norm": weight.grad.float().norm().item(),
        },
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser(__doc__, sides=SIDES)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk-size", type=int, default=None, help="ours' chunk size (default: the op's rule)")
    p.add_argument("--calls", type=int, default=1, help="timed calls per process (the fastest is kept)")
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args, _worker)

    device, dtype = _device_dtype(args)
    runs = run_workers(__file__, SIDES, worker_argv(argv), args.reps)
    ours, naive = runs["ours"], runs["naive"]
    tol = 1e-3 if dtype == "float32" else 3e-2
    rel = {
        k: max(
            abs(o["checks"][k] - n["checks"][k]) / max(abs(n["checks"][k]), 1e-12)
            for o, n in zip(ours, naive, strict=True)
        )
        for k in naive[0]["checks"]
    }
    memory_ratio = max(column(ours, "peak_mib")) / min(column(naive, "peak_mib"))
    checks = {
        "checksum_relative_difference": rel,
        "checksums_agree": all(v <= tol for v in rel.values()),
        "worst_peak_memory_ratio": memory_ratio,
        "memory_criterion_passed": memory_ratio <= MEMORY_CRITERION,
    }
    label = "fused_linear_logprobs (" + ("Triton" if device == "cuda" else "torch reference") + ")"
    unit = f"{args.tokens} tok x {args.vocab} vocab x {args.hidden} hidden, {dtype}, {device}"
    # fmt: off
    summary = [
        row(NAME, f"fwd+bwd time, s ({unit})", label, "naive full logits", column(ours, "time_s"),
            column(naive, "time_s"), "lower"),
        row(NAME, f"fwd+bwd peak memory, MiB ({unit})", label, "naive full logits", column(ours, "peak_mib"),
            column(naive, "peak_mib"), "lower"),
    ]
    # fmt: on
    payload = result(
        NAME,
        __doc__,
        summary,
        config={**vars(args), "worker": None, "no_write": None, "device": device, "dtype": dtype},
        checks=checks,
        passed=checks["checksums_agree"] and checks["memory_criterion_passed"],
        packages=("torch", "triton", "lightning", "numpy", "psutil"),
    )
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
