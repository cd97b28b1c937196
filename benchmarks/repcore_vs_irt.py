"""Benchmark coresets: RepCore vs tinyBenchmarks-style IRT (``girth``'s 2PL MML), anchor points and random anchors.

On the offline testbed of :mod:`lightning_llm.evaluation.skills_benchmark` (400 five-skill multiple-choice items,
20 tiny causal LMs of 5 architectures/skill mixtures x 4 checkpoints), each split (seed ``1000 + split``) draws
``--sources`` source models and keeps the rest as targets. Every method selects ``K`` anchors from the sources
and predicts the targets' full-benchmark accuracy from their anchor results alone:

* **RepCore** (ours): aligned mean-pooled hidden states, k-means anchors, ridge extrapolation;
* **IRT (girth)**, the peer a researcher would pick: ``girth.twopl_mml`` item parameters, anchors clustered in
  parameter space, p-IRT extrapolation (tinyBenchmarks), via ``IRTCoreset(backend="girth")``; ``IRT (torch)``
  is the same with our gradient-descent MAP fit;
* **Anchor points** (items clustered by correctness across sources) and **Random**, with RepCore's estimator.

Per split and K: mean absolute error of the predicted accuracies, their Spearman correlation with the truth,
and the wall time of ``fit`` (selection + estimator; girth's IRT fit, done once per split, is counted at every
K). Splits pair the methods (same sources and targets).

    python benchmarks/repcore_vs_irt.py [--splits 5] [--anchors 5 10 20 40] [--no-girth] [--no-write]
"""

from __future__ import annotations

import sys
import time

import torch
from _harness import finish, parser, result, row, set_threads, stat

from lightning_llm.evaluation import AnchorPoints, IRTCoreset, RandomCoreset, RepCore, spearman
from lightning_llm.evaluation.skills_benchmark import load_population, population_results, skills_benchmark

NAME = "repcore_vs_irt"
METHODS = {
    "RepCore": lambda k, seed, _: RepCore(k, seed=seed),
    "Random": lambda k, seed, _: RandomCoreset(k, seed=seed),
    "Anchor points": lambda k, seed, _: AnchorPoints(k, seed=seed),
    "IRT (torch)": lambda k, seed, _: IRTCoreset(k, seed=seed),
    "IRT (girth)": lambda k, seed, params: IRTCoreset(k, backend="girth", item_parameters=params, seed=seed),
}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--splits", type=int, default=5)
    p.add_argument("--sources", type=int, default=10)
    p.add_argument("--anchors", type=int, nargs="+", default=[5, 10, 20, 40])
    p.add_argument("--items", type=int, default=400)
    p.add_argument("--no-girth", action="store_true", help="skip the (slow) girth peer")
    args = p.parse_args(argv)
    set_threads(args.threads)

    items = skills_benchmark(args.items, seed=0)
    results = population_results(items, load_population())
    correct, scores = results.correctness.float(), results.scores.double()
    n_models = len(scores)
    if not 2 <= args.sources < n_models:
        raise SystemExit(f"--sources must be in [2, {n_models - 1}]")
    methods = [m for m in METHODS if not (args.no_girth and m == "IRT (girth)")]
    raw = {m: {k: {"mae": [], "spearman": [], "fit_s": []} for k in args.anchors} for m in methods}
    for split in range(args.splits):
        perm = torch.randperm(n_models, generator=torch.Generator().manual_seed(1000 + split))
        source, target = perm[: args.sources], perm[args.sources :]
        hidden = [results.hidden_states[i] for i in source]
        girth_params, girth_s = None, 0.0
        if not args.no_girth:
            start = time.perf_counter()
            fitted = IRTCoreset(1, backend="girth", seed=split).fit(correct[source])
            girth_params, girth_s = (fitted.discrimination, fitted.difficulty), time.perf_counter() - start
        for k in args.anchors:
            for name in methods:
                method = METHODS[name](k, split, girth_params)
                start = time.perf_counter()
                method.fit(correct[source], hidden)
                elapsed = time.perf_counter() - start + (girth_s if name == "IRT (girth)" else 0.0)
                predicted = method.estimate(correct[target])
                raw[name][k]["mae"].append((predicted - scores[target]).abs().mean().item())
                raw[name][k]["spearman"].append(spearman(predicted, scores[target]))
                raw[name][k]["fit_s"].append(elapsed)
        print(f"split {split + 1}/{args.splits} done", file=sys.stderr, flush=True)

    peer = "IRT (torch)" if args.no_girth else "IRT (girth)"
    k = 20 if 20 in args.anchors else args.anchors[len(args.anchors) // 2]
    unit = f"{args.sources} source models, {n_models - args.sources} targets, {args.splits} splits"
    ours = raw["RepCore"][k]
    summary = [
        *(
            row(
                NAME,
                f"MAE @ {k} anchors ({unit})",
                "RepCore",
                other,
                ours["mae"],
                raw[other][k]["mae"],
                "lower",
            )
            for other in (peer, "Random")
        ),
        row(
            NAME,
            f"Spearman @ {k} anchors ({unit})",
            "RepCore",
            peer,
            ours["spearman"],
            raw[peer][k]["spearman"],
            "higher",
        ),
        row(
            NAME,
            f"selection + fit time, s @ {k} anchors",
            "RepCore",
            peer,
            ours["fit_s"],
            raw[peer][k]["fit_s"],
            "lower",
        ),
    ]
    details = {
        m: {str(kk): {metric: stat(v) for metric, v in by.items()} for kk, by in by_k.items()}
        for m, by_k in raw.items()
    }
    payload = result(
        NAME,
        __doc__,
        summary,
        config={**vars(args), "no_write": None, "models": n_models},
        details=details,
        packages=("torch", "numpy", "girth", "transformers"),
    )
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
