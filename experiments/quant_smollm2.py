"""2-bit quantisation of a whole real model: held-out perplexity and KL to fp32 on shipped English passages.

Every ``nn.Linear`` of the model except the (tied) ``lm_head`` is quantised with each method; embeddings and
norms stay fp32. Methods: ``"fp32"``, ``"nf4"`` (bitsandbytes NF4, 4 bits + an fp32 absmax per 64: the 4-bit
reference point), ``"rtn"`` (round-to-nearest 2-bit, per-row MSE-best step, no rotation), ``"qtip-1mad"``,
``"qtip-3inst"``, ``"proteus"`` (2-bit trellis codes at ``L`` after random-Hadamard incoherence, channel
compensation; :func:`lightning_llm.quantization.quantize_model`) and ``"proteus+distill"`` (the Proteus model,
then :func:`~lightning_llm.quantization.distill_quantized` of its affine statistics and scales towards the fp32
model on the calibration passages; the bits do not change).

Text: :data:`~lightning_llm.quantization.heldout.PASSAGES`, original English prose passages written for this
study. The first ``calib_passages`` are the distillation's calibration text; the rest are the held-out text, cut
into windows of ``seq_len`` tokens and scored by :func:`~lightning_llm.quantization.heldout.score` against the
fp32 model's log-probabilities (kept in a float32 memory map on disk). Scoring runs the quantised layers as
dense fp32 matrices holding the dequantised weights (:func:`~lightning_llm.quantization.heldout.densify`).

Encode times are process CPU seconds (``time.process_time``) with the threads torch was given; run with
``OMP_NUM_THREADS=1`` for one-thread figures. ``--quantized-dir`` keeps each encoded model
(:func:`~lightning_llm.quantization.save_quantized`, with its encode times) so that a rerun reuses it.

Run: ``OMP_NUM_THREADS=1 python experiments/quant_smollm2.py --out benchmarks/results/quant_smollm2.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _results import refuse_existing, write_results
from torch import Tensor, nn

from lightning_llm.backbones import load_backbone
from lightning_llm.quantization import (
    TrellisLinear,
    dequantize,
    distill_quantized,
    load_quantized,
    quantize_matrix,
    save_quantized,
)
from lightning_llm.quantization.heldout import densify, encode_model, held_out_windows, load_passages, score

METHODS = ("fp32", "nf4", "rtn", "qtip-1mad", "qtip-3inst", "proteus", "proteus+distill")

TRELLIS = ("qtip-1mad", "qtip-3inst", "proteus")


@torch.no_grad()
def _teacher_log_probs(model: nn.Module, windows: Tensor, path: Path, batch: int) -> np.memmap:
    n, t = windows.shape
    vocab = model.get_output_embeddings().weight.shape[0]
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, t - 1, vocab))
    for i in range(0, n, batch):
        ids = windows[i : i + batch]
        mm[i : i + ids.shape[0]] = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1).numpy()
    mm.flush()
    return mm


def _weight_error(q: nn.Module, ref: nn.Module) -> dict[str, float]:
    """Relative Frobenius error ``‖Ŵ − W‖ / ‖W‖`` over all quantised layers together."""
    num, den = 0.0, 0.0
    ref_mods = dict(ref.named_modules())
    for name, mod in q.named_modules():
        if isinstance(mod, TrellisLinear):
            w = ref_mods[name].weight.detach().float()
            num += float((dequantize(mod.quantized_matrix()) - w).pow(2).sum())
            den += float(w.pow(2).sum())
    return {"relative_weight_error": math.sqrt(num / den)}


def _l16_subset(model: nn.Module, layer: int, L_low: int, L_high: int, seed: int) -> dict[str, Any]:
    """Proteus on the 7 linear layers of decoder layer ``layer`` at ``L_low`` and ``L_high``: CPU s, error."""
    rows = []
    prefix = f"model.layers.{layer}."
    names = [n for n, m in model.named_modules() if n.startswith(prefix) and isinstance(m, nn.Linear)]
    for name in names:
        w = model.get_submodule(name).weight.detach().float()
        row: dict[str, Any] = {"name": name, "shape": list(w.shape)}
        for L in (L_low, L_high):
            c0 = time.process_time()
            qm = quantize_matrix(w, "proteus", bits=2, L=L, seed=seed)
            row[f"cpu_s_L{L}"] = time.process_time() - c0
            row[f"relative_error_L{L}"] = float((dequantize(qm) - w).norm() / w.norm())
        rows.append(row)
    n_weights = sum(r["shape"][0] * r["shape"][1] for r in rows)
    total = {L: sum(r[f"cpu_s_L{L}"] for r in rows) for L in (L_low, L_high)}
    return {
        "layer": layer,
        "matrices": rows,
        "weights": n_weights,
        "cpu_s": {f"L{k}": v for k, v in total.items()},
    }


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "per_seed": values,
        "median": statistics.median(values),
        "spread": max(values) - min(values),
    }


def run(
    model_name: str,
    L: int,
    seeds: Sequence[int],
    methods: Sequence[str],
    seq_len: int,
    batch: int,
    calib_passages: int,
    calib_len: int,
    distill_steps: int,
    distill_lr: float,
    l16_layer: int | None,
    quantized_dir: Path | None,
    progress: Any = None,
    max_windows: int | None = None,
) -> dict[str, Any]:
    """The study; ``progress(result)`` (if given) is called with the partial result after every method."""
    torch.manual_seed(0)
    fp32, tokenizer = load_backbone(model_name)
    fp32 = fp32.float().eval()
    passages = load_passages()
    calib_text, held_text = passages[:calib_passages], passages[calib_passages:]
    windows = held_out_windows(tokenizer, held_text, seq_len)
    all_windows = windows.shape[0]
    if max_windows is not None:
        windows = windows[:max_windows]
    calib = held_out_windows(tokenizer, calib_text, calib_len)
    result: dict[str, Any] = {
        "model": model_name,
        "settings": {
            "bits": 2,
            "L": L,
            "V": 1,
            "tile": 256,
            "seq_len": seq_len,
            "batch": batch,
            "held_out_passages": len(held_text),
            "held_out_windows": all_windows,
            "scored_windows": windows.shape[0],
            "calibration_passages": len(calib_text),
            "calibration_windows": calib.shape[0],
            "calibration_len": calib_len,
            "calibration_batches": 1,
            "distill_steps": distill_steps,
            "distill_lr": distill_lr,
            "distill_tune": ["affine", "scales"],
            "quantised": "every nn.Linear of the 30 decoder layers (q, k, v, o, gate, up, down); lm_head "
            "(tied to the embedding), embeddings and norms stay fp32",
            "scoring": "dense fp32 matmul with the dequantised weights",
            "torch_threads": torch.get_num_threads(),
        },
        "seeds": list(seeds),
        "base_weights": "SmolLM2-135M-Instruct as converted here: the source weights were Q4_1 GGUF, "
        "dequantised to fp32, so 'fp32' is itself a 4-bit model and NF4 re-quantises a 4-bit grid",
        "held_out_tokens": int(windows.numel()),
        "scored_tokens": int(windows.shape[0] * (windows.shape[1] - 1)),
        "host": {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "methods": {},
    }
    with tempfile.TemporaryDirectory(prefix="quant_smollm2_") as tmp:
        teacher_lp = _teacher_log_probs(fp32, windows, Path(tmp) / "teacher.npy", batch)
        per: dict[str, dict[str, list]] = {m: {} for m in methods}

        def record(method: str, key: str, value: Any) -> None:
            per[method].setdefault(key, []).append(value)

        for seed in seeds:
            proteus_q = None
            for method in methods:
                c0 = time.process_time()
                if method == "fp32":
                    res = score(fp32, windows, teacher_lp, batch)
                    res["kl_to_fp32"] = 0.0
                    for k, v in res.items():
                        record(method, k, v)
                    continue
                if method == "proteus+distill":
                    if proteus_q is None:
                        proteus_q, _ = _encode_cached(fp32, "proteus", L, seed, quantized_dir)
                    q = copy.deepcopy(proteus_q)
                    d0 = time.process_time()
                    hist = distill_quantized(q, fp32, calib, steps=distill_steps, lr=distill_lr)
                    record(method, "distill_cpu_s", time.process_time() - d0)
                    record(method, "calibration_kl_before", hist[0])
                    record(method, "calibration_kl_after", hist[-1])
                    record(method, **_as_kw(_weight_error(q, fp32)))
                else:
                    q, times = _encode_cached(fp32, method, L, seed, quantized_dir)
                    record(method, "encode_cpu_s", times["cpu_s"])
                    record(method, "encode_wall_s", times["wall_s"])
                    if method in TRELLIS or method == "rtn":
                        record(method, **_as_kw(_weight_error(q, fp32)))
                    if method == "proteus":
                        proteus_q = q
                res = score(densify(copy.deepcopy(q)) if method != "nf4" else q, windows, teacher_lp, batch)
                for k, v in res.items():
                    record(method, k, v)
                record(method, "study_cpu_s", time.process_time() - c0)
                del q
                print(f"seed {seed} {method}: {res}", flush=True)
                result["methods"] = _summarise(per)
                if progress is not None:
                    progress(result)
        result["methods"] = _summarise(per)
        del teacher_lp
    if l16_layer is not None:
        if progress is not None:
            progress(result)
        result["l16_subset"] = _l16_subset(fp32, l16_layer, L, 16, seeds[0])
    return result


def _summarise(per: dict[str, dict[str, list]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for method, keys in per.items():
        if keys:
            out[method] = {k: _summary([float(v) for v in values]) for k, values in keys.items()}
    return out


def _as_kw(d: dict[str, float]) -> dict[str, Any]:
    ((k, v),) = d.items()
    return {"key": k, "value": v}


def _encode_cached(
    fp32: nn.Module, method: str, L: int, seed: int, quantized_dir: Path | None
) -> tuple[nn.Module, dict[str, float]]:
    """:func:`encode_model`, or the model saved under ``quantized_dir`` by an earlier run (with its times)."""
    if quantized_dir is None or method in ("nf4", "rtn"):
        return encode_model(fp32, method, L, seed)
    path = quantized_dir / f"{method}_L{L}_seed{seed}"
    if (path / "times.json").exists():
        return load_quantized(path), json.loads((path / "times.json").read_text())
    q, times = encode_model(fp32, method, L, seed)
    save_quantized(q, path)
    (path / "times.json").write_text(json.dumps(times))
    return q, times


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quant_smollm2.json"))
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--L", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--calib-passages", type=int, default=4)
    parser.add_argument("--calib-len", type=int, default=256)
    parser.add_argument("--distill-steps", type=int, default=10)
    parser.add_argument("--distill-lr", type=float, default=1e-2)
    parser.add_argument(
        "--max-windows", type=int, default=None, help="score only the first N held-out windows (a budget cut)"
    )
    parser.add_argument(
        "--l16-layer", type=int, default=None, help="also encode this layer's 7 matrices at L=16"
    )
    parser.add_argument("--quantized-dir", type=Path, default=None, help="cache of encoded trellis models")
    parser.add_argument("--encode-only", action="store_true", help="only fill --quantized-dir, write nothing")
    args = parser.parse_args(argv)
    if args.encode_only:
        if args.quantized_dir is None:
            raise SystemExit("--encode-only needs --quantized-dir")
        fp32, _ = load_backbone(args.model)
        for seed in args.seeds:
            for method in [m for m in args.methods if m in TRELLIS]:
                _, times = _encode_cached(fp32.float(), method, args.L, seed, args.quantized_dir)
                print(f"seed {seed} {method} L={args.L}: {times}", flush=True)
        return
    refuse_existing(args.out, args.overwrite)
    c0, w0 = time.process_time(), time.perf_counter()

    def write(result: dict[str, Any], complete: bool = False) -> None:
        result = {**result, "complete": complete, "cpu_s": time.process_time() - c0}
        result["wall_s"] = time.perf_counter() - w0
        write_results(args.out, result)

    result = run(
        args.model,
        args.L,
        args.seeds,
        args.methods,
        args.seq_len,
        args.batch,
        args.calib_passages,
        args.calib_len,
        args.distill_steps,
        args.distill_lr,
        args.l16_layer,
        args.quantized_dir,
        progress=write,
        max_windows=args.max_windows,
    )
    write(result, complete=True)


if __name__ == "__main__":
    main()
