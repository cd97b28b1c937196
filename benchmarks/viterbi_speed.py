"""Encode speed of the trellis Viterbi on real SmolLM2 matrices: torch reference vs the compiled CPU Viterbi.

``quantize_matrix(W, "proteus", bits=2, L, V=1)`` (incoherence, the 8-candidate MUL-BAL search on 4 proxy tiles,
the tail-biting two-pass Viterbi of every 256-weight tile, channel compensation) on decoder layer
``--layer``'s ``q_proj`` (576 × 576) and ``gate_proj`` (1536 × 576 stored as [1536, 576]) of ``smollm2-135m``,
timed as process CPU seconds with the threads given (run with ``OMP_NUM_THREADS=1``). At ``L = 12`` both
Viterbi backends run and must give the same packed bits; ``L = 16`` runs the compiled one only (the reference
takes ~16x its L = 12 time). The whole model's estimate scales by weight count (106.2M weights in 210 matrices).

    OMP_NUM_THREADS=1 python benchmarks/viterbi_speed.py --out benchmarks/results/viterbi_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from unittest import mock

import torch

from lightning_llm.backbones import load_backbone
from lightning_llm.quantization import quantize, quantize_matrix, trellis

MODEL_WEIGHTS = 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)  # q, o; k, v; gate, up, down


def _encode(w: torch.Tensor, L: int, backend: str) -> tuple[float, torch.Tensor]:
    real = trellis.viterbi

    def forced(*args, **kwargs):
        return real(*args, **{**kwargs, "backend": backend})

    with mock.patch.object(quantize, "viterbi", forced):
        c0 = time.process_time()
        qm = quantize_matrix(w, "proteus", bits=2, L=L, seed=0)
        return time.process_time() - c0, qm.packed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/viterbi_speed.json"))
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    if args.out.exists() and not args.overwrite:
        raise SystemExit(f"{args.out} exists; pass --overwrite")
    model, _ = load_backbone("smollm2-135m")
    trellis._viterbi_cpp.available()  # build (or load) the extension outside the timings
    rows = []
    for name in ("self_attn.q_proj", "mlp.gate_proj"):
        w = model.get_submodule(f"model.layers.{args.layer}.{name}").weight.detach().float()
        row = {"matrix": f"model.layers.{args.layer}.{name}", "shape": list(w.shape), "weights": w.numel()}
        t_ref, bits_ref = _encode(w, 12, "torch")
        t_cpp, bits_cpp = _encode(w, 12, "cpp")
        t16, _ = _encode(w, 16, "cpp")
        row.update(
            cpu_s_L12_torch=t_ref,
            cpu_s_L12_cpp=t_cpp,
            cpu_s_L16_cpp=t16,
            same_bits_L12=bool(torch.equal(bits_ref, bits_cpp)),
            speedup_L12=t_ref / t_cpp,
        )
        print(row, flush=True)
        rows.append(row)
    per_weight = {
        key: sum(r[key] for r in rows) / sum(r["weights"] for r in rows)
        for key in ("cpu_s_L12_torch", "cpu_s_L12_cpp", "cpu_s_L16_cpp")
    }
    result = {
        "model": "smollm2-135m",
        "code": "proteus",
        "bits": 2,
        "V": 1,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "model_weights": MODEL_WEIGHTS,
        "whole_model_estimate_cpu_min": {k: v * MODEL_WEIGHTS / 60 for k, v in per_weight.items()},
        "host": {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "note": "one run per setting on a 2-core machine shared with other jobs (process CPU time)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")


if __name__ == "__main__":
    main()
