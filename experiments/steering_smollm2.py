"""CRH steering on a real backbone: diffmean vectors for real concepts, their effect, and the cylinder geometry.

Per concept (``ocean``, ``food``, ``music``) and seed:

- **Contrast pairs.** ``--pairs`` pairs are drawn (seeded, :mod:`lightning_llm.evaluation.steering_concepts`)
  from fixed sentence templates with one slot
  (``"I keep thinking about {}."``); the positive fills it with one of the concept's phrases (``"the sea and
  its waves"``), the negative with one of a shared list of concept-free phrases (``"the train timetable"``),
  the same template on both sides. So the seeds differ only in which pairs are drawn.
- **Vector.** :func:`~lightning_llm.callbacks.train_steering_vector` (``diffmean``) at decoder layer
  ``--layer`` (0-based, the layer's output; 15 of SmolLM2's 30 is the middle).
- **Effect.** :class:`~lightning_llm.callbacks.ActivationSteering` adds ``m · v`` at every position (prompt and
  generated tokens) while the model greedily answers ``--prompts`` fixed, concept-neutral chat prompts
  (``--new-tokens`` tokens). Per multiplier ``m``: the *concept rate*, the fraction of answers in which the
  concept's keyword detector (:class:`~lightning_llm.evaluation.RegexConceptDetector`, word list in
  ``CONCEPTS``) fires, and *fluency*, the perplexity of the steered answers' tokens (up to the first
  end-of-turn) under the **unsteered** model given the prompt, pooled over tokens.

Per concept, once (no seed: the samples are fixed), the CRH geometry of real activations
(:class:`~lightning_llm.evaluation.CylindricalAnalysis`): for each of the ``--crh-prompts`` neutral prompts
``q``, ``d_q = h_ℓ(q ⊕ y⁺_q) − h_ℓ(q ⊕ y⁻_q)`` at the last token, with ``y±_q`` an assistant reply from a
per-sample template whose slot holds a concept phrase or a concept-free one. Reported: the axis norm, θ_q,
the normal-plane energy (k = 2) beside the same statistic for Gaussian differences of the same shape, the
cross-validated plane recoverability, the sector predictability from the prompt's own last-token state (ridge,
5 folds), and the cosine between the axis and the template-trained vector. Then a per-sample sweep: every
prompt is steered with its own penalty vector ``v_q(L, p)`` (``p = 1``: the axis, ``p = 0``: its own
difference direction) for ``L`` in ``--lengths`` × ``‖a‖``; a sample succeeds at ``L`` when its one greedy
answer hits the detector, its steerability is the first such ``L``. CRH predicts steerability rising with
``sin θ_q``; :func:`~lightning_llm.evaluation.steerability_correlation` gives the Spearman correlation per
concept and pooled over concepts (never-steered samples dropped, and set to twice the largest steerability
found). ``--merge`` combines runs of single concepts made in parallel processes.

Run: ``python experiments/steering_smollm2.py --out benchmarks/results/steering_smollm2.json``, or (as for the
committed file) one process per concept, ``--concepts ocean --out /tmp/ocean.json`` etc., then ``--merge
/tmp/ocean.json /tmp/food.json /tmp/music.json --out benchmarks/results/steering_smollm2.json``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _results import read_parts, refuse_existing, write_results

from lightning_llm.backbones import load_backbone
from lightning_llm.callbacks import train_steering_vector
from lightning_llm.evaluation import CylindricalAnalysis
from lightning_llm.evaluation.steering import sector_predictability, steerability, steerability_correlation
from lightning_llm.evaluation.steering_concepts import (
    CONCEPTS,
    NEUTRAL_PROMPTS,
    chat_prompts,
    concept_detector,
    contrast_pairs,
    crh_differences,
    steer_and_score,
)

DEFAULT_OUT = Path("benchmarks/results/steering_smollm2.json")


def _spread(values: Sequence[float]) -> dict[str, Any]:
    return {
        "per_seed": list(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def _effect(model: Any, tokenizer: Any, args: argparse.Namespace, concept: str, chats: list[str]) -> dict:
    detector = concept_detector(concept)
    per_seed: dict[float, dict[str, list[float]]] = {m: {"rate": [], "ppl": []} for m in args.multipliers}
    examples: dict[str, list[str]] = {}
    norms, cosines = [], []
    vectors = []
    cache: dict[float, dict[str, Any]] = {}
    for seed in args.seeds:
        pairs = contrast_pairs(concept, args.pairs, seed)
        tokenizer.padding_side = "right"
        vector = train_steering_vector(model, tokenizer, pairs, args.layer, method="diffmean")
        vectors.append(vector)
        norms.append(float(vector.norm()))
        for m in args.multipliers:
            if m == 0 and 0.0 in cache:  # unsteered: the same for every seed
                out = cache[0.0]
            else:
                out = steer_and_score(model, tokenizer, chats, vector, args.layer, m, args.new_tokens)
                if m == 0:
                    cache[0.0] = out
            rate = sum(detector(out["texts"])) / len(chats)
            ppl = math.exp(out["nll_sum"] / max(out["tokens"], 1))
            per_seed[m]["rate"].append(rate)
            per_seed[m]["ppl"].append(ppl)
            if seed == args.seeds[0]:
                examples[f"{m:g}"] = out["texts"][:2]
            print(f"{concept:>6} seed {seed} m={m:g}: rate {rate:.3f} ppl {ppl:.2f}", flush=True)
    for i in range(len(vectors)):
        for j in range(i + 1, len(vectors)):
            cosines.append(float(torch.nn.functional.cosine_similarity(vectors[i], vectors[j], dim=0)))
    rows = [
        {"multiplier": m, "concept_rate": _spread(v["rate"]), "perplexity": _spread(v["ppl"])}
        for m, v in per_seed.items()
    ]
    medians = [r["concept_rate"]["median"] for r in rows]
    return {
        "vector_norm": _spread(norms),
        "vector_cosine_between_seeds": cosines,
        "rows": rows,
        "rate_monotone_in_multiplier": all(b >= a for a, b in itertools.pairwise(medians)),
        "examples_first_seed": examples,
        "vector": vectors[0],
    }


def _geometry(
    model: Any, tokenizer: Any, args: argparse.Namespace, concept: str, chats: list[str], vector: torch.Tensor
) -> dict[str, Any]:
    detector = concept_detector(concept)
    d, pre = crh_differences(model, tokenizer, concept, chats, args.layer)
    crh = CylindricalAnalysis(d)
    gaussian = CylindricalAnalysis(torch.randn(d.shape, generator=torch.Generator().manual_seed(0)) + 1.0)
    theta = torch.rad2deg(crh.theta)
    axis_norm = float(crh.axis.norm())
    lengths = [c * axis_norm for c in args.lengths]
    success = {}
    for p in args.penalties:
        grid = torch.empty(len(chats), len(lengths), dtype=torch.float64)
        for k, length in enumerate(lengths):
            rows = crh.penalty_vectors(length, p).float()
            out = steer_and_score(model, tokenizer, chats, rows, args.layer, 1.0, args.new_tokens)
            grid[:, k] = torch.tensor(detector(out["texts"]), dtype=torch.float64)
        success[p] = grid
        print(f"{concept:>6} sweep p={p:g}: rate per L {grid.mean(0).tolist()}", flush=True)
    geometry = {
        "samples": crh.num_samples,
        "axis_norm": axis_norm,
        "axis_cosine_to_pair_vector": float(
            torch.nn.functional.cosine_similarity(crh.axis.float(), vector.float(), dim=0)
        ),
        "theta_deg": {
            "median": float(theta.median()),
            "min": float(theta.min()),
            "max": float(theta.max()),
            "per_sample": [round(float(t), 3) for t in theta],
        },
        "sin_theta": crh.sin_theta.tolist(),
        "normal_energy_k2": crh.normal_variance_explained(2),
        "normal_energy_k2_gaussian_same_shape": gaussian.normal_variance_explained(2),
        "plane_recoverability_k2": crh.plane_recoverability(2, folds=5),
        "plane_recoverability_k2_gaussian": gaussian.plane_recoverability(2, folds=5),
        "sector_predictability": sector_predictability(pre, crh.plane_coordinates(2), alpha=10.0, folds=5),
        "sweep_lengths_in_axis_norms": list(args.lengths),
        "sweep": {},
    }
    for p, grid in success.items():
        st = steerability(grid, lengths)
        geometry["sweep"][f"p={p:g}"] = {
            "rate_per_length": grid.mean(0).tolist(),
            "steerability_in_axis_norms": [s / axis_norm for s in st.per_sample.tolist()],
            "spearman_exclude": steerability_correlation(st.per_sample, crh.sin_theta, crh.cos_theta),
            "spearman_cap": steerability_correlation(
                st.per_sample, crh.sin_theta, crh.cos_theta, never="cap"
            ),
        }
    return geometry


def _pooled(concepts: dict[str, Any], penalties: Sequence[float]) -> dict[str, Any]:
    """Steerability vs sin θ over the samples of all concepts together (from the per-concept records)."""
    sin = torch.tensor([x for c in concepts.values() for x in c["crh"]["sin_theta"]], dtype=torch.float64)
    cos = (1 - sin**2).clamp_min(0).sqrt()
    out = {}
    for p in penalties:
        key = f"p={p:g}"
        steer = torch.tensor(
            [
                math.inf if x is None else x
                for c in concepts.values()
                for x in c["crh"]["sweep"][key]["steerability_in_axis_norms"]
            ],
            dtype=torch.float64,
        )
        out[key] = {
            "spearman_exclude": steerability_correlation(steer, sin, cos),
            "spearman_cap": steerability_correlation(steer, sin, cos, never="cap"),
        }
    return out


def merge(paths: Sequence[Path]) -> dict[str, Any]:
    """One result from runs of the same settings on disjoint concepts (e.g. run in parallel processes): their
    concepts together, the pooled correlation recomputed over all of them, CPU seconds summed."""
    parts = read_parts(paths)
    first = parts[0]
    keys = [k for k in first["settings"] if k != "concepts"]
    concepts: dict[str, Any] = {}
    for part in parts:
        if any(part["settings"][k] != first["settings"][k] for k in keys):
            raise SystemExit("the runs to merge differ in settings other than the concepts")
        if set(part["concepts"]) & set(concepts):
            raise SystemExit("the runs to merge share a concept")
        concepts.update(part["concepts"])
    return first | {
        "settings": first["settings"] | {"concepts": list(concepts)},
        "detector_words": {c: CONCEPTS[c][1] for c in concepts},
        "concepts": concepts,
        "pooled_steerability_vs_sin_theta": _pooled(concepts, first["settings"]["penalties"]),
        "total_cpu_seconds": round(sum(p["total_cpu_seconds"] for p in parts), 1),
        "total_wall_seconds": max(p["total_wall_seconds"] for p in parts),
        "processes": len(parts),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole study as a JSON-ready dict."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    torch.manual_seed(0)
    model, tokenizer = load_backbone(args.model)
    model.eval()
    steer_chats = chat_prompts(tokenizer, NEUTRAL_PROMPTS[: args.prompts])
    crh_chats = chat_prompts(tokenizer, NEUTRAL_PROMPTS[: args.crh_prompts])
    concepts: dict[str, Any] = {}
    for concept in args.concepts:
        start, cpu = time.perf_counter(), time.process_time()
        effect = _effect(model, tokenizer, args, concept, steer_chats)
        vector = effect.pop("vector")
        geometry = _geometry(model, tokenizer, args, concept, crh_chats, vector)
        concepts[concept] = {
            "effect": effect,
            "crh": geometry,
            "seconds": round(time.perf_counter() - start, 1),
            "cpu_seconds": round(time.process_time() - cpu, 1),
        }
    pooled = _pooled(concepts, args.penalties)
    settings = {
        k: getattr(args, k)
        for k in (
            "model",
            "concepts",
            "seeds",
            "layer",
            "pairs",
            "prompts",
            "crh_prompts",
            "multipliers",
            "new_tokens",
            "lengths",
            "penalties",
        )
    }
    return {
        "study": "CRH steering on a real backbone (experiments/steering_smollm2.py)",
        "settings": settings,
        "how_pairs_were_made": (
            "per seed, `pairs` draws of (template, concept phrase, neutral phrase) from PAIR_TEMPLATES, "
            "CONCEPTS[concept][0] and NEUTRAL_PHRASES; the positive and negative share the template"
        ),
        "multiplier_definition": "ActivationSteering adds multiplier * v (v the raw diffmean vector) at every position",
        "fluency_definition": "perplexity of the steered answers' tokens under the unsteered model given the prompt",
        "detector_words": {c: CONCEPTS[c][1] for c in args.concepts},
        "concepts": concepts,
        "pooled_steerability_vs_sin_theta": pooled,
        "total_cpu_seconds": round(time.process_time() - cpu0, 1),
        "total_wall_seconds": round(time.perf_counter() - wall0, 1),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "host": {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--concepts", nargs="+", choices=list(CONCEPTS), default=list(CONCEPTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="contrast-pair draws")
    parser.add_argument("--layer", type=int, default=15, help="0-based decoder layer")
    parser.add_argument("--pairs", type=int, default=32, help="contrast pairs per vector")
    parser.add_argument("--prompts", type=int, default=16, help="steering prompts (first of NEUTRAL_PROMPTS)")
    parser.add_argument("--crh-prompts", type=int, default=16, help="CRH samples (first of NEUTRAL_PROMPTS)")
    parser.add_argument("--multipliers", type=float, nargs="+", default=[0.0, 2.0, 4.0, 8.0])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument(
        "--lengths", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0], help="L / ‖a‖ of the sweep"
    )
    parser.add_argument("--penalties", type=float, nargs="+", default=[1.0, 0.0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument(
        "--merge", type=Path, nargs="+", help="write --out from these results (same settings, other concepts)"
    )
    args = parser.parse_args(argv)
    if not 2 <= args.crh_prompts <= len(NEUTRAL_PROMPTS) or not 1 <= args.prompts <= len(NEUTRAL_PROMPTS):
        parser.error(f"--prompts and --crh-prompts must be in [1 or 2, {len(NEUTRAL_PROMPTS)}]")
    refuse_existing(args.out, args.overwrite)
    torch.set_num_threads(args.threads)
    result = merge(args.merge) if args.merge else run(args)
    write_results(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
