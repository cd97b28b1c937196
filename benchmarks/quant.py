"""2-bit trellis quantisation (Proteus, QTIP codes) vs round-to-nearest and bitsandbytes NF4, side by side.

Three measurements in one process, same data and model for every method:

1. **i.i.d. N(0, 1)** (``--gauss-rows`` x 1024, seed 0, no incoherence: the matrix is already Gaussian): MSE and
   encoding time of ``quantize_matrix`` at 2 bits for RTN-2 (MSE-best uniform grid per row), QTIP 1MAD,
   QTIP 3INST and Proteus MUL-BAL (L = ``--L``, V = 1, tail-biting), and of bitsandbytes NF4 (4 bits, absmax per
   64). References: 2-bit Lloyd-Max 0.1175, distortion-rate bound 0.0625.
2. **Perplexity of a trained tiny model**: ``lightning_llm.evaluation.quantization_study.train_arithmetic_model``
   (``"tiny"`` Llama, 800 steps of two-digit ``+ - *`` arithmetic) and ``compare_quantizers`` over every
   method of ``study.METHODS``: held-out response-token perplexity (200 conversations), the encoding wall time
   (one run: deterministic, minutes at L = 16), and the relative weight error ``Σ‖Ŵ−W‖² / Σ‖W‖²`` over the 28
   decoder linears (``Ŵ`` read back through each layer's own forward on the identity).
3. **Dequant-matmul** ``y = x Ŵᵀ`` for a 1024 x 1024 layer, batch ``--batches``: our ``TrellisLinear``
   (``lightning_llm.kernels.trellis_matmul``: on CPU its PyTorch reference decodes the weight from the packed
   bits on every call, then one matmul; the Triton kernel is CUDA-only), bitsandbytes ``Linear4bit`` NF4 (its
   fastest CPU path: the packed AVX512-bf16 kernel where the CPU has it, else dequantise + matmul) and fp32
   ``nn.Linear``; median over ``--reps`` after a warm-up; also ours with ``set_trellis_backend(..., "compiled")``
   (the same decode through ``torch.compile``; must equal the eager reference bit for bit). The layer is encoded at ``--matmul-L`` (the decode
   cost does not depend on L; encoding at 16 would take ~8 CPU-minutes). Correctness: ours must equal
   ``x @ dequantize(...)ᵀ``.

Writes ``benchmarks/results/quant.json``; exits 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    machine_info,
    package_versions,
    summary_row,
    time_repeated,
    utc_now,
    write_result,
)

NAME = "quant"
LLOYD_MAX_2BIT, BOUND_2BIT = 0.1175, 0.0625


def _gaussian(rows: int, L: int) -> dict:
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    from lightning_llm.quantization import dequantize, quantize_matrix

    W = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(0))
    out = {}
    for code in ("rtn", "qtip-1mad", "qtip-3inst", "proteus"):
        start = time.process_time()
        qm = quantize_matrix(W, code=code, bits=2, L=L, incoherence=False)
        cpu = time.process_time() - start
        out[code] = {"mse": float((dequantize(qm) - W).pow(2).mean()), "cpu_s": cpu, "bits_per_weight": 2.0}
        print(f"N(0,1) {code:>10}: MSE {out[code]['mse']:.4f} ({cpu:.1f} CPU-s)", flush=True)
    start = time.process_time()
    q, state = quantize_4bit(W, quant_type="nf4", blocksize=64)
    cpu = time.process_time() - start
    out["nf4"] = {
        "mse": float((dequantize_4bit(q, state) - W).pow(2).mean()),
        "cpu_s": cpu,
        "bits_per_weight": 4 + 32 / 64,
    }
    return out


@torch.no_grad()
def _weight_error(original: torch.nn.Module, quantized: torch.nn.Module) -> float:
    """``Σ‖Ŵ−W‖² / Σ‖W‖²`` over the decoder linears; ``Ŵ`` = the quantised layer applied to the identity."""
    err = norm = 0.0
    for name, mod in original.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
            continue
        layer = quantized.get_submodule(name)
        eye = torch.eye(mod.in_features)
        w_hat = layer(eye).t() - (0 if mod.bias is None else mod.bias.unsqueeze(1))
        err += float((w_hat - mod.weight).pow(2).sum())
        norm += float(mod.weight.pow(2).sum())
    return err / norm


def _model(steps: int, L: int, seed: int) -> dict:
    from lightning_llm.evaluation.quantization_study import (
        METHODS,
        compare_quantizers,
        train_arithmetic_model,
    )

    start = time.perf_counter()
    model, data = train_arithmetic_model(steps, seed=seed)
    train_s = time.perf_counter() - start
    held_out = list(data.val_dataloader())
    first = next(iter(data.train_dataloader()))
    calibration = {k: first[k] for k in ("input_ids", "attention_mask")}
    results = compare_quantizers(
        model, held_out, methods=METHODS, L=L, calibration=calibration, log=lambda s: print(s, flush=True)
    )
    out = {"train_seconds": train_s, "steps": steps, "L": L, "methods": {}}
    for method, r in results.items():
        out["methods"][method] = {
            "perplexity": r["perplexity"],
            "kl_to_fp32": r.get("kl_to_fp32"),
            "quantize_seconds": r["seconds"],
            "relative_weight_error": _weight_error(model, r["model"]) if method != "fp32" else 0.0,
            "distillation": getattr(r["model"], "trellis_quantization", {}).get("distillation"),
        }
    return out


def _matmul(L: int, batches: list[int], reps: int) -> dict:
    from lightning_llm.quantization import TrellisLinear, dequantize, quantize_model_nf4, set_trellis_backend

    torch.manual_seed(0)
    dense = torch.nn.Linear(1024, 1024, bias=False).eval()
    start = time.perf_counter()
    ours = TrellisLinear.from_linear(dense, code="proteus", L=L).eval()
    encode_s = time.perf_counter() - start
    nf4 = quantize_model_nf4(torch.nn.Sequential(copy.deepcopy(dense)), skip=(), cpu_bf16_kernel=True)[
        0
    ].eval()
    compiled = set_trellis_backend(copy.deepcopy(ours), "compiled")
    w_hat = dequantize(ours.quantized_matrix())
    out = {"encode_seconds_at_L": encode_s, "L": L, "batches": {}}
    correct = True
    with torch.no_grad():
        for b in batches:
            x = torch.randn(b, 1024)
            ok = torch.allclose(ours(x), x @ w_hat.t(), rtol=1e-4, atol=1e-4)
            ok_compiled = torch.equal(compiled(x), ours(x))
            correct &= ok and ok_compiled
            row = {"ours_matches_reference": ok, "compiled_equals_eager": ok_compiled}
            for label, layer in (("ours", ours), ("ours_compiled", compiled), ("nf4", nf4), ("fp32", dense)):
                row[label] = time_repeated(lambda layer=layer, x=x: layer(x), reps=reps, warmup=2)
            out["batches"][str(b)] = row
            print(
                f"matmul batch {b:>4}: ours {row['ours']['median'] * 1e3:.2f} ms (compiled "
                f"{row['ours_compiled']['median'] * 1e3:.2f} ms), NF4 "
                f"{row['nf4']['median'] * 1e3:.2f} ms, fp32 {row['fp32']['median'] * 1e3:.2f} ms",
                flush=True,
            )
    out["correct"] = bool(correct)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--L", type=int, default=16, help="trellis state bits for parts 1 and 2")
    p.add_argument("--steps", type=int, default=800, help="training steps of the tiny model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gauss-rows", type=int, default=64, help="rows of the 1024-wide N(0,1) matrix")
    p.add_argument("--matmul-L", type=int, default=12)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--parts", nargs="+", default=["gaussian", "model", "matmul"])
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--merge", action="store_true", help="keep the parts not run from results/quant.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results: dict = {}
    if (
        args.merge
    ):  # keep the other parts of the last run (e.g. re-time the matmul without re-encoding at L=16)
        from _common import RESULTS_DIR

        previous = json.loads((RESULTS_DIR / f"{NAME}.json").read_text())
        results = {k: v for k, v in previous["results"].items() if k not in args.parts}
        results_config = previous.get("config", {})
    if "gaussian" in args.parts:
        results["gaussian"] = _gaussian(args.gauss_rows, args.L)
    if "model" in args.parts:
        results["model"] = _model(args.steps, args.L, args.seed)
    if "matmul" in args.parts:
        results["matmul"] = _matmul(args.matmul_L, args.batches, args.reps)

    summary = []
    if "gaussian" in results:
        g = results["gaussian"]
        summary.append(
            summary_row(NAME, "Proteus 2-bit", "RTN 2-bit", "MSE on i.i.d. N(0,1)", g["proteus"]["mse"], g["rtn"]["mse"], "lower")
        )  # fmt: skip
        summary.append(
            summary_row(NAME, "Proteus 2-bit", "QTIP 1MAD 2-bit", "MSE on i.i.d. N(0,1)", g["proteus"]["mse"], g["qtip-1mad"]["mse"], "lower")
        )  # fmt: skip
    if "model" in results:
        m = results["model"]["methods"]
        for ours in ("proteus", "proteus+distill"):
            for peer, label in (
                ("rtn", "RTN 2-bit"),
                ("qtip-1mad", "QTIP 1MAD 2-bit"),
                ("nf4", "bitsandbytes NF4 (4-bit)"),
            ):
                summary.append(
                    summary_row(NAME, f"{'Proteus' if ours == 'proteus' else 'Proteus + distillation'} 2-bit", label,
                                "held-out perplexity, tiny model", m[ours]["perplexity"], m[peer]["perplexity"], "lower")
                )  # fmt: skip
    if "matmul" in results:
        for b, row in results["matmul"]["batches"].items():
            summary.append(
                summary_row(NAME, "trellis_matmul (Proteus, CPU reference)", "bitsandbytes NF4 Linear4bit",
                            f"time per 1024x1024 matmul, batch {b}, s", row["ours"]["median"], row["nf4"]["median"], "lower")
            )  # fmt: skip
            if "ours_compiled" in row:
                summary.append(
                    summary_row(NAME, "trellis_matmul (Proteus, backend 'compiled')", "bitsandbytes NF4 Linear4bit",
                                f"time per 1024x1024 matmul, batch {b}, s", row["ours_compiled"]["median"], row["nf4"]["median"], "lower")
                )  # fmt: skip
    payload = {
        "benchmark": NAME,
        "description": __doc__.split("\n\n")[0],
        "date": utc_now(),
        "machine": machine_info(),
        "versions": package_versions(["torch", "transformers", "bitsandbytes", "lightning", "lightning-llm"]),
        "config": vars(args) | ({"merged_from": results_config} if args.merge else {}),
        "references": {"lloyd_max_2bit_mse": LLOYD_MAX_2BIT, "distortion_rate_bound_2bit": BOUND_2BIT},
        "results": results,
        "summary": summary,
        "checks": {"matmul_correct": results.get("matmul", {}).get("correct", True)},
    }
    if not args.no_write:
        print(f"wrote {write_result(NAME, payload)}")
    return 0 if payload["checks"]["matmul_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
