"""Benchmark coresets: RepCore vs tinyBenchmarks-style IRT (``girth``'s 2PL MML), anchor points and random anchors.

On the offline testbed of :mod:`lightning_llm.evaluation.skills_benchmark` (400 five-skill multiple-choice items,
20 tiny causal LMs of 5 architectures/skill mixtures x 4 checkpoints), each split draws ``--sources`` source
models and keeps the rest as targets. Every method selects ``K`` anchors from the source models and predicts the
targets' full-benchmark accuracy from their anchor results alone:

* **RepCore** (ours) — aligned mean-pooled hidden states, k-means anchors, ridge extrapolation.
* **IRT (girth)** — the peer a researcher would pick: ``girth.twopl_mml`` item parameters (marginal ML 2PL),
  anchors clustered in parameter space, p-IRT extrapolation (tinyBenchmarks, Polo et al. 2024), via
  ``IRTCoreset(backend="girth")``. ``IRT (torch)`` is the same with our gradient-descent MAP fit.
* **Anchor points** (Vivek et al. 2023) — items clustered by correctness across sources; **Random** — uniform
  random anchors; both with the same ridge estimator as RepCore.

Metrics per split and K: mean absolute error of the predicted accuracy over targets, Spearman correlation of
predicted vs true accuracies; median (and mean) over splits. Selection time: wall time of ``fit`` (item
selection plus estimator fit) on the sources, median over splits; girth's IRT fit is done once per split and
reused across K (its time is counted once, at each K, in ``fit_time_s``).

Usage (from the repository root)::

    python benchmarks/repcore_vs_irt.py                 # 8 splits, 10 source models, K in 5 10 20 40
    python benchmarks/repcore_vs_irt.py --splits 4 --no-girth

Writes ``benchmarks/results/repcore_vs_irt.json`` (``--no-write`` to skip).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from _common import machine_info, package_versions, summary_row, utc_now, write_result

from lightning_llm.evaluation import AnchorPoints, IRTCoreset, RandomCoreset, RepCore, spearman
from lightning_llm.evaluation.skills_benchmark import (
    PopulationRecipe,
    load_population,
    population_results,
    skills_benchmark,
)

NAME = "repcore_vs_irt"


def _make(name: str, k: int, seed: int, girth_params):
    if name == "RepCore":
        return RepCore(k, seed=seed)
    if name == "Random":
        return RandomCoreset(k, seed=seed)
    if name == "Anchor points":
        return AnchorPoints(k, seed=seed)
    if name == "IRT (torch)":
        return IRTCoreset(k, seed=seed)
    return IRTCoreset(k, backend="girth", item_parameters=girth_params, seed=seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--splits", type=int, default=8)
    parser.add_argument("--sources", type=int, default=10)
    parser.add_argument("--anchors", type=int, nargs="+", default=[5, 10, 20, 40])
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-girth", action="store_true", help="skip the (slow) girth peer")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    items = skills_benchmark(args.items, seed=0)
    results = population_results(items, load_population())
    setup_s = time.perf_counter() - start
    correct, scores = results.correctness.float(), results.scores.double()
    n_models = len(scores)
    if not 2 <= args.sources < n_models:
        raise SystemExit(f"--sources must be in [2, {n_models - 1}]")

    methods = ["RepCore", "Random", "Anchor points", "IRT (torch)"] + (
        [] if args.no_girth else ["IRT (girth)"]
    )
    raw: dict[str, dict[int, dict[str, list[float]]]] = {
        m: {k: {"mae": [], "spearman": [], "fit_time_s": []} for k in args.anchors} for m in methods
    }
    for split in range(args.splits):
        perm = torch.randperm(n_models, generator=torch.Generator().manual_seed(1000 + split))
        source, target = perm[: args.sources], perm[args.sources :]
        hidden = [results.hidden_states[i] for i in source]
        girth_params, girth_time = None, 0.0
        if not args.no_girth:
            t0 = time.perf_counter()
            fitted = IRTCoreset(1, backend="girth", seed=split).fit(correct[source])
            girth_params, girth_time = (fitted.discrimination, fitted.difficulty), time.perf_counter() - t0
        for k in args.anchors:
            for name in methods:
                method = _make(name, k, split, girth_params)
                t0 = time.perf_counter()
                method.fit(correct[source], hidden)
                elapsed = time.perf_counter() - t0 + (girth_time if name == "IRT (girth)" else 0.0)
                predicted = method.estimate(correct[target])
                row = raw[name][k]
                row["mae"].append((predicted - scores[target]).abs().mean().item())
                row["spearman"].append(spearman(predicted, scores[target]))
                row["fit_time_s"].append(elapsed)
        print(f"split {split + 1}/{args.splits} done", flush=True)

    stats = {
        name: {
            str(k): {
                metric: {"median": statistics.median(v), "mean": statistics.fmean(v), "all": v}
                for metric, v in by_metric.items()
            }
            for k, by_metric in by_k.items()
        }
        for name, by_k in raw.items()
    }
    for k in args.anchors:
        line = ", ".join(
            f"{m} {stats[m][str(k)]['mae']['median']:.4f}/{stats[m][str(k)]['spearman']['median']:.2f}"
            for m in methods
        )
        print(f"K={k}: MAE/Spearman {line}")
    peer = "IRT (torch)" if args.no_girth else "IRT (girth)"
    ref_k = 20 if 20 in args.anchors else args.anchors[len(args.anchors) // 2]
    unit = f"{args.sources} source models, {n_models - args.sources} targets, median of {args.splits} splits"
    summary = []
    for other in (peer, "Random"):
        summary.append(
            summary_row(
                NAME,
                "RepCore",
                other,
                f"MAE @ {ref_k} anchors ({unit})",
                stats["RepCore"][str(ref_k)]["mae"]["median"],
                stats[other][str(ref_k)]["mae"]["median"],
                better="lower",
            )
        )
    summary.append(
        summary_row(
            NAME,
            "RepCore",
            peer,
            f"Spearman @ {ref_k} anchors ({unit})",
            stats["RepCore"][str(ref_k)]["spearman"]["median"],
            stats[peer][str(ref_k)]["spearman"]["median"],
            better="higher",
        )
    )
    summary.append(
        summary_row(
            NAME,
            "RepCore",
            peer,
            f"selection + fit time, s @ {ref_k} anchors",
            stats["RepCore"][str(ref_k)]["fit_time_s"]["median"],
            stats[peer][str(ref_k)]["fit_time_s"]["median"],
            better="lower",
        )
    )
    recipe = PopulationRecipe()
    payload = {
        "benchmark": NAME,
        "description": "Benchmark coresets from 10 source models: RepCore vs IRT (girth 2PL, p-IRT), anchor points "
        "and random anchors; error of the extrapolated accuracy of held-out models",
        "config": {
            "items": args.items,
            "skills": sorted({item.skill for item in items}),
            "population": {"architectures": recipe.architectures, "checkpoints": recipe.checkpoints},
            "models": n_models,
            "sources": args.sources,
            "splits": args.splits,
            "anchors": args.anchors,
            "threads": args.threads,
            "scores": {"min": float(scores.min()), "max": float(scores.max()), "std": float(scores.std())},
            "setup_s": setup_s,
        },
        "results": stats,
        "measurement": {
            "mae": "mean |predicted - true accuracy| over the held-out models of a split",
            "spearman": "rank correlation of predicted vs true accuracies over the held-out models",
            "fit_time_s": "perf_counter around fit() on the source models (girth's IRT fit counted at every K)",
        },
        "versions": package_versions(["torch", "numpy", "girth", "transformers"]),
        "machine": machine_info(),
        "date": utc_now(),
        "summary": summary,
    }
    if args.no_write:
        print(json.dumps(payload["summary"], indent=2))
    else:
        print(f"wrote {write_result(NAME, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
