"""2-bit trellis quantisation (Proteus, QTIP codes) vs round-to-nearest and bitsandbytes NF4, side by side.

Three parts, the same data and model for every method:

1. **i.i.d. N(0, 1)** (``--gauss-rows`` x 1024 per seed in ``--gauss-seeds``, no incoherence): MSE and encoding
   CPU time of ``quantize_matrix`` at 2 bits for RTN-2 (MSE-best uniform grid per row), QTIP 1MAD, QTIP 3INST and
   Proteus MUL-BAL (L = ``--L``, V = 1, tail-biting), and bitsandbytes NF4 (4 bits, absmax per 64). References:
   2-bit Lloyd-Max 0.1175, distortion-rate bound 0.0625. Paired by seed.
2. **Perplexity of a trained tiny model** (``--parts model``): ``evaluation.quantizers.train_arithmetic_model`` (800
   steps of two-digit ``+ - *``) and ``compare_quantizers`` over ``study.METHODS``: held-out response-token
   perplexity (200 conversations), KL to fp32, encoding time and relative weight error over the 28 decoder
   linears. Encoding at L = 16 takes ~20 CPU-minutes, so this part runs once (one seed: no spread, so its
   rows are "single run"); ``--keep-model`` carries the last run's numbers over (``details.model``).
3. **Dequant-matmul** ``y = x Ŵᵀ`` of a 1024 x 1024 layer per batch in ``--batches``: our ``TrellisLinear``
   (``kernels.trellis_matmul``: on CPU the PyTorch reference decodes the packed bits on every call, then one
   matmul; Triton is CUDA-only), the same with ``set_trellis_backend(..., "compiled")`` (must equal the eager
   reference bit for bit), bitsandbytes ``Linear4bit`` NF4 (its fastest CPU path) and fp32 ``nn.Linear``,
   interleaved, ``--reps`` rounds. Encoded at ``--matmul-L`` (decode cost does not depend on L). Ours must equal
   ``x @ dequantize(...)ᵀ``.

    python benchmarks/quant.py --keep-model              # Gaussian (3 seeds) + matmul, model numbers carried over
    python benchmarks/quant.py --parts gaussian model matmul   # everything (~25 min on 2 cores)
"""

from __future__ import annotations

import copy
import json
import sys
import time
from typing import Any

import torch
from _harness import RESULTS_DIR, finish, interleave, parser, result, row, set_threads, stat

NAME = "quant"
CODES = ("rtn", "qtip-1mad", "qtip-3inst", "proteus")
REFERENCES = {"lloyd_max_2bit_mse": 0.1175, "distortion_rate_bound_2bit": 0.0625}


def _gaussian(rows: int, L: int, seed: int) -> dict[str, dict[str, float]]:
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    from lightning_llm.quantization import dequantize, quantize_matrix

    W = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(seed))
    out = {}
    for code in CODES:
        start = time.process_time()
        qm = quantize_matrix(W, code=code, bits=2, L=L, incoherence=False)
        out[code] = {"mse": float((dequantize(qm) - W).pow(2).mean()), "cpu_s": time.process_time() - start}
        print(f"N(0,1) seed {seed} {code:>10}: MSE {out[code]['mse']:.4f}", file=sys.stderr, flush=True)
    start = time.process_time()
    q, state = quantize_4bit(W, quant_type="nf4", blocksize=64)
    out["nf4"] = {
        "mse": float((dequantize_4bit(q, state) - W).pow(2).mean()),
        "cpu_s": time.process_time() - start,
    }
    return out


@torch.no_grad()
def _weight_error(original: torch.nn.Module, quantized: torch.nn.Module) -> float:
    """``Σ‖Ŵ−W‖² / Σ‖W‖²`` over the decoder linears; ``Ŵ`` = the quantised layer applied to the identity."""
    err = norm = 0.0
    for name, mod in original.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            w_hat = quantized.get_submodule(name)(torch.eye(mod.in_features)).t()
            w_hat = w_hat - (0 if mod.bias is None else mod.bias.unsqueeze(1))
            err += float((w_hat - mod.weight).pow(2).sum())
            norm += float(mod.weight.pow(2).sum())
    return err / norm


def _model(steps: int, L: int, seed: int) -> dict[str, Any]:
    from lightning_llm.evaluation.quantizers import METHODS, compare_quantizers, train_arithmetic_model

    model, data = train_arithmetic_model(steps, seed=seed)
    first = next(iter(data.train_dataloader()))
    results = compare_quantizers(
        model,
        list(data.val_dataloader()),
        methods=METHODS,
        L=L,
        calibration={k: first[k] for k in ("input_ids", "attention_mask")},
        log=lambda s: print(s, file=sys.stderr),
    )
    return {
        "steps": steps,
        "L": L,
        "seed": seed,
        "methods": {
            m: {
                "perplexity": r["perplexity"],
                "kl_to_fp32": r.get("kl_to_fp32"),
                "quantize_seconds": r["seconds"],
                "relative_weight_error": _weight_error(model, r["model"]) if m != "fp32" else 0.0,
            }
            for m, r in results.items()
        },
    }


def _matmul(L: int, batches: list[int], reps: int) -> tuple[dict[str, Any], bool]:
    from lightning_llm.quantization import TrellisLinear, dequantize, quantize_model_nf4, set_trellis_backend

    torch.manual_seed(0)
    dense = torch.nn.Linear(1024, 1024, bias=False).eval()
    ours = TrellisLinear.from_linear(dense, code="proteus", L=L).eval()
    nf4 = quantize_model_nf4(torch.nn.Sequential(copy.deepcopy(dense)), skip=(), cpu_bf16_kernel=True)[
        0
    ].eval()
    compiled = set_trellis_backend(copy.deepcopy(ours), "compiled")
    w_hat = dequantize(ours.quantized_matrix())
    out, correct = {}, True
    with torch.no_grad():
        for b in batches:
            x = torch.randn(b, 1024)
            correct &= torch.allclose(ours(x), x @ w_hat.t(), rtol=1e-4, atol=1e-4)
            correct &= torch.equal(compiled(x), ours(x))
            layers = {"ours": ours, "ours_compiled": compiled, "nf4": nf4, "fp32": dense}
            out[str(b)] = interleave({k: (lambda m=m, x=x: m(x)) for k, m in layers.items()}, reps, warmup=2)
    return out, bool(correct)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, reps=21)
    p.add_argument("--L", type=int, default=16, help="trellis state bits for parts 1 and 2")
    p.add_argument("--steps", type=int, default=800, help="training steps of the tiny model")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model")
    p.add_argument("--gauss-seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--gauss-rows", type=int, default=64, help="rows of the 1024-wide N(0,1) matrix")
    p.add_argument("--matmul-L", type=int, default=12)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument(
        "--parts", nargs="+", choices=("gaussian", "model", "matmul"), default=["gaussian", "matmul"]
    )
    p.add_argument(
        "--keep-model", action="store_true", help="carry details.model over from results/quant.json"
    )
    args = p.parse_args(argv)
    set_threads(args.threads)
    details: dict[str, Any] = {"references": REFERENCES}
    summary, checks = [], {}
    if "gaussian" in args.parts:
        g = [_gaussian(args.gauss_rows, args.L, seed) for seed in args.gauss_seeds]
        details["gaussian"] = {c: {k: stat(s[c][k] for s in g) for k in ("mse", "cpu_s")} for c in g[0]}
        for peer, label in (("rtn", "RTN 2-bit"), ("qtip-1mad", "QTIP 1MAD 2-bit")):
            summary.append(
                row(
                    NAME,
                    f"MSE on i.i.d. N(0,1), {args.gauss_rows}x1024, L={args.L}, {len(g)} seeds",
                    "Proteus 2-bit",
                    label,
                    [s["proteus"]["mse"] for s in g],
                    [s[peer]["mse"] for s in g],
                    "lower",
                )
            )
    if "model" in args.parts:
        details["model"] = _model(args.steps, args.L, args.seed)
    elif args.keep_model:
        details["model"] = json.loads((RESULTS_DIR / f"{NAME}.json").read_text())["details"]["model"]
    if "model" in details:
        m = details["model"]["methods"]
        for ours, label in (
            ("proteus", "Proteus 2-bit"),
            ("proteus+distill", "Proteus + distillation 2-bit"),
        ):
            for peer, peer_label in (
                ("rtn", "RTN 2-bit"),
                ("qtip-1mad", "QTIP 1MAD 2-bit"),
                ("nf4", "bitsandbytes NF4 (4-bit)"),
            ):
                summary.append(
                    row(
                        NAME,
                        f"held-out perplexity, tiny model, L={details['model']['L']}, one run",
                        label,
                        peer_label,
                        [m[ours]["perplexity"]],
                        [m[peer]["perplexity"]],
                        "lower",
                    )
                )
    if "matmul" in args.parts:
        times, checks["matmul_correct"] = _matmul(args.matmul_L, args.batches, args.reps)
        details["matmul"] = {b: {k: stat(v) for k, v in t.items()} for b, t in times.items()}
        for b, t in times.items():
            metric = f"time per 1024x1024 matmul, batch {b}, s"
            # fmt: off
            summary += [
                row(NAME, metric, "trellis_matmul (Proteus, CPU reference)", "bitsandbytes NF4 Linear4bit",
                    t["ours"], t["nf4"], "lower"),
                row(NAME, metric, "trellis_matmul (Proteus, backend 'compiled')",
                    "bitsandbytes NF4 Linear4bit", t["ours_compiled"], t["nf4"], "lower"),
            ]
            # fmt: on
    payload = result(
        NAME,
        __doc__,
        summary,
        config={**vars(args), "no_write": None},
        checks=checks,
        passed=checks.get("matmul_correct", True),
        details=details,
        packages=("torch", "transformers", "bitsandbytes", "lightning", "lightning-llm"),
    )
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
