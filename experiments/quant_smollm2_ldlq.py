"""SmolLM2-135M, every decoder linear at 2 bits with Proteus: data-free rounding vs layer-sequential BlockLDLQ.

One Hadamard seed, no distillation, the trellis at ``--L`` (8 by default, to fit a few CPU-minutes). Calibration:
the study's first 4 passages as windows of 256 tokens (one batch) for the Hessians; held-out perplexity on the
first ``--max-windows`` windows of 512 of the other passages, scored as ``experiments/quant_smollm2.py`` scores
(``lightning_llm.quantization.heldout.score``: dense fp32 matmul with the dequantised weights). Records encode
and scoring CPU seconds (one thread) and the per-layer relative proxy errors of LDLQ. An existing ``--out`` is
never replaced.

    python experiments/quant_smollm2_ldlq.py --out benchmarks/results/quant_smollm2_ldlq.json
"""

from __future__ import annotations

import argparse
import copy
import platform
import time
from pathlib import Path

import torch
from _results import refuse_existing, write_results

from lightning_llm.backbones import load_backbone
from lightning_llm.quantization import DEFAULT_DAMP, quantize_model
from lightning_llm.quantization.heldout import densify, held_out_windows, load_passages, score


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--L", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-windows", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quant_smollm2_ldlq.json"))
    args = parser.parse_args(argv)
    refuse_existing(args.out, hint="not replacing it")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    fp32, tokenizer = load_backbone(args.model)
    fp32 = fp32.float().eval()
    passages = load_passages()
    calib = held_out_windows(tokenizer, passages[:4], 256)
    windows = held_out_windows(tokenizer, passages[4:], 512)
    all_windows, windows = windows.shape[0], windows[: args.max_windows]
    result = {
        "model": args.model,
        "settings": {
            "bits": 2,
            "L": args.L,
            "V": 1,
            "tile": 256,
            "code": "proteus",
            "hadamard_seed": args.seed,
            "seq_len": 512,
            "held_out_windows": all_windows,
            "scored_windows": windows.shape[0],
            "calibration": f"passages 0-3 as {calib.shape[0]} x 256 tokens, one batch",
            "damp": DEFAULT_DAMP,
            "distillation": "none",
            "torch_threads": 1,
            "scoring": "dense fp32 matmul with the dequantised weights (quantization.heldout.score)",
            "quantised": "every nn.Linear of the 30 decoder layers; lm_head, embeddings, norms fp32",
        },
        "base_weights": "SmolLM2-135M-Instruct converted from the Q4_1 GGUF, dequantised to fp32",
        "host": {"machine": platform.machine(), "torch": torch.__version__},
        "methods": {},
    }
    c0 = time.process_time()
    result["methods"]["fp32"] = {**score(fp32, windows, None, 2), "score_cpu_s": time.process_time() - c0}
    for rounding in ("data-free", "ldlq"):
        q = copy.deepcopy(fp32)
        c0 = time.process_time()
        quantize_model(
            q,
            "proteus",
            bits=2,
            L=args.L,
            seed=args.seed,
            calibration=calib if rounding == "ldlq" else None,
            rounding=rounding,
            distill_steps=0,
        )
        encode = time.process_time() - c0
        proxy = q.trellis_quantization.get("proxy", {})
        densify(q)
        c0 = time.process_time()
        record = {
            **score(q, windows, None, 2),
            "encode_cpu_s": encode,
            "score_cpu_s": time.process_time() - c0,
        }
        if proxy:
            rel = sorted(v["proxy_relative"] for v in proxy.values())
            record["proxy_relative_median"], record["proxy_relative_max"] = rel[len(rel) // 2], rel[-1]
        result["methods"][f"proteus-{rounding}"] = record
        print(rounding, record, flush=True)
    result["budget_cpu_s"] = sum(
        r.get("encode_cpu_s", 0) + r["score_cpu_s"] for r in result["methods"].values()
    )
    write_results(args.out, result, indent=1)


if __name__ == "__main__":
    main()
