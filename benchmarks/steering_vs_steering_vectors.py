"""Steering vectors: ``lightning_llm`` (``train_steering_vector``, ``ActivationSteering``) vs ``steering-vectors``.

Three comparisons on the same tiny model (the embedded tiny Llama backbone, fp32, CPU, eval mode) and the same
contrast pairs (synthetic ``(text with the concept, text without)`` pairs, see ``_pairs``):

* **training time** of a diffmean vector at one decoder layer: ours
  ``train_steering_vector(model, tok, pairs, layer, method="diffmean", batch_size=B)`` vs theirs
  ``steering_vectors.train_steering_vector(model, tok, pairs, layers=[layer], batch_size=B)`` (their default
  ``mean_aggregator``, ``read_token_index=-1``, ``layer_type="decoder_block"``);
* **agreement**: cosine and max |difference| between the two vectors. Layer conventions are aligned: both read
  the *output* of decoder block ``layer`` (``model.model.layers[layer]``, 0-based; HF's ``hidden_states[layer + 1]``)
  at the last non-pad token, with the tokenizer's right padding on both sides (theirs adjusts the read index for
  padding; ours also passes position ids from the mask, which under right padding equal the default ones);
* **steered generation**: ``model.generate`` (greedy, fixed length) of a batch of prompts with the *same* vector
  added at the same layer and all positions, ours ``with ActivationSteering(v, layer, multiplier).attach(model)``
  vs theirs ``with SteeringVector({layer: v}).apply(model, multiplier=m)``, and unsteered; the overhead over the
  unsteered call, and a check that ours and theirs generate identical tokens.

Not matched: ours stops the forward pass after the read layer (its hook raises once the layer has run), theirs
runs the whole model; that is a design difference and part of what the training time measures. Both run under
``torch.no_grad`` (theirs calls the model without it; gradients are never used, so it is wrapped here too on
both sides so the comparison is the algorithms, not autograd bookkeeping).

Timing: ``_common.time_repeated`` (median over ``--reps`` calls after ``--warmup``), both libraries
interleaved in one process (repetition blocks alternate which goes first), one torch thread by default for the
reason ``grpo_vs_trl.py`` gives (OpenMP threads spin-wait on a small shared machine).

Usage (from the repository root)::

    python benchmarks/steering_vs_steering_vectors.py                 # 64 pairs, batch 8, layer 1, 21 reps
    python benchmarks/steering_vs_steering_vectors.py --pairs 128 --layer 2 --reps 9

Writes ``benchmarks/results/steering_vs_steering_vectors.json`` (``--no-write`` to skip) and exits 1 if the two
vectors disagree (cosine < 0.9999) or the steered generations differ.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from typing import Any

import torch
from _common import machine_info, package_versions, summary_row, time_repeated, utc_now, write_result

NAME = "steering_vs_steering_vectors"
COSINE_CRITERION = 0.9999

MEASUREMENT = {
    "time": "in one process, per repetition block: _common.time_repeated(fn, reps=1, warmup=0) of ours and "
    "theirs in alternating order (after --warmup untimed calls of each), --reps blocks; reported: the median "
    "over blocks (median), the min, and every block's time (all). perf_counter around the whole call "
    "(tokenization, forwards, aggregation; for generation the whole model.generate with hooks registered and "
    "removed inside the timed call)",
    "agreement": "cosine similarity and max absolute difference of the two diffmean vectors (float32)",
}

_ANIMALS = "cat fox dog bird fish frog owl bear wolf deer goat lamb duck crow mole seal".split()
_OBJECTS = ["water", "river", "stars", "sea", "city"]


def _pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` pairs differing in one slot (``fire`` vs another object), of varying length so padding matters."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        animal = rng.choice(_ANIMALS)
        earlier = "".join(f"{rng.choice(_OBJECTS)}, the " for _ in range(rng.randrange(3)))
        prefix = f"Q: what does the {animal} see?\nA: the {animal} sees the {earlier}"
        out.append((prefix + "fire, the", prefix + f"{rng.choice(_OBJECTS)}, the"))
    return out


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=64, help="contrast pairs")
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per forward, both libraries")
    parser.add_argument("--layer", type=int, default=1, help="0-based decoder layer")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per steered generate call")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--multiplier", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true")
    return parser.parse_args(argv)


def _interleaved(fns: dict[str, Any], reps: int, warmup: int) -> dict[str, dict[str, Any]]:
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            times[name].append(time_repeated(fns[name], reps=1, warmup=0)["median"])
    return {n: {"median": statistics.median(t), "min": min(t), "all": t} for n, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import steering_vectors as sv
    from transformers.utils import logging as hf_logging

    from lightning_llm.backbone import load_backbone
    from lightning_llm.callbacks import ActivationSteering, train_steering_vector

    hf_logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    model, tok = load_backbone("tiny")
    model.eval()
    tok.padding_side = "right"  # the same padding on both sides (theirs reads the default side too)
    pairs = _pairs(args.pairs, args.seed)

    def ours_train() -> torch.Tensor:
        return train_steering_vector(
            model, tok, pairs, args.layer, method="diffmean", batch_size=args.batch_size
        )

    def theirs_train() -> torch.Tensor:
        with torch.no_grad():
            vec = sv.train_steering_vector(model, tok, pairs, layers=[args.layer], batch_size=args.batch_size)
        return vec.layer_activations[args.layer]

    print("training vectors ...", file=sys.stderr, flush=True)
    ours_vec, theirs_vec = ours_train().float(), theirs_train().float()
    cosine = float(torch.nn.functional.cosine_similarity(ours_vec, theirs_vec, dim=0))
    max_diff = float((ours_vec - theirs_vec).abs().max())
    train_times = _interleaved({"ours": ours_train, "theirs": theirs_train}, args.reps, args.warmup)

    prompts = [p[: p.rindex(" the ") + len(" the")] for p, _ in pairs[: args.prompts]]
    tok.padding_side = "left"  # generation pads on the left; training is done by now
    enc = tok(prompts, return_tensors="pt", padding=True)
    gen_kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    shared = ours_vec  # the same vector on both sides: only the hook machinery differs
    their_vector = sv.SteeringVector(layer_activations={args.layer: shared}, layer_type="decoder_block")

    @torch.no_grad()
    def plain_gen() -> torch.Tensor:
        return model.generate(**enc, **gen_kwargs)

    @torch.no_grad()
    def ours_gen() -> torch.Tensor:
        with ActivationSteering(shared, layer=args.layer, multiplier=args.multiplier).attach(model):
            return model.generate(**enc, **gen_kwargs)

    @torch.no_grad()
    def theirs_gen() -> torch.Tensor:
        with their_vector.apply(model, multiplier=args.multiplier):
            return model.generate(**enc, **gen_kwargs)

    print("steered generation ...", file=sys.stderr, flush=True)
    ours_tokens, theirs_tokens, plain_tokens = ours_gen(), theirs_gen(), plain_gen()
    same_tokens = bool(torch.equal(ours_tokens, theirs_tokens))
    steering_changes_output = not bool(torch.equal(ours_tokens, plain_tokens))
    gen_times = _interleaved(
        {"ours": ours_gen, "theirs": theirs_gen, "unsteered": plain_gen}, args.reps, args.warmup
    )
    overhead = {k: gen_times[k]["median"] / gen_times["unsteered"]["median"] for k in ("ours", "theirs")}

    checks = {
        "cosine": cosine,
        "max_abs_diff": max_diff,
        "vectors_agree": cosine >= COSINE_CRITERION,
        "cosine_criterion": f"cosine(ours, theirs) >= {COSINE_CRITERION}",
        "steered_tokens_identical": same_tokens,
        "steering_changes_greedy_output": steering_changes_output,
    }
    unit = (
        f"tiny, fp32, cpu, {args.threads or 'default'} thread(s), layer {args.layer}, {args.pairs} pairs, "
        f"batch {args.batch_size}"
    )
    gen_unit = (
        f"tiny, fp32, cpu, {args.threads or 'default'} thread(s), {args.prompts} prompts x {args.new_tokens} "
        f"new tokens, greedy"
    )
    summary = [
        summary_row(
            NAME,
            "train_steering_vector (diffmean)",
            "steering_vectors.train_steering_vector",
            f"time to train one vector, s ({unit})",
            train_times["ours"]["median"],
            train_times["theirs"]["median"],
            better="lower",
        ),
        summary_row(
            NAME,
            "ActivationSteering",
            "SteeringVector.apply",
            f"steered generate time, s ({gen_unit})",
            gen_times["ours"]["median"],
            gen_times["theirs"]["median"],
            better="lower",
        ),
        summary_row(
            NAME,
            "ActivationSteering",
            "SteeringVector.apply",
            f"steered / unsteered generate time ({gen_unit})",
            overhead["ours"],
            overhead["theirs"],
            better="lower",
        ),
    ]
    payload = {
        "benchmark": NAME,
        "description": "diffmean steering-vector training and steered generation: lightning_llm vs "
        "steering-vectors on the same model, pairs, layer and vector",
        "config": {
            "model": "tiny (lightning_llm.backbone), fp32, eval mode",
            "pairs": args.pairs,
            "pair_example": list(pairs[0]),
            "batch_size": args.batch_size,
            "layer": args.layer,
            "layer_convention": "0-based decoder block index; both read/write the block's output "
            "(HF hidden_states[layer + 1])",
            "read_token": "last non-pad token (right padding on both sides)",
            "generation": {**gen_kwargs, "prompts": args.prompts, "multiplier": args.multiplier},
            "positions": "all (ours positions='all'; theirs min_token_index=0)",
            "reps": args.reps,
            "warmup": args.warmup,
            "torch_threads": args.threads or "torch default",
            "seed": args.seed,
        },
        "train_time_s": train_times,
        "generate_time_s": gen_times,
        "generate_overhead_over_unsteered": overhead,
        "ratios": {
            "train_time_ours_over_theirs": train_times["ours"]["median"] / train_times["theirs"]["median"],
            "generate_time_ours_over_theirs": gen_times["ours"]["median"] / gen_times["theirs"]["median"],
        },
        "checks": checks,
        "measurement": MEASUREMENT,
        "versions": package_versions(["torch", "transformers", "steering-vectors", "lightning"]),
        "machine": machine_info(),
        "date": utc_now(),
        "summary": summary,
    }
    print(
        f"train: ours {train_times['ours']['median'] * 1e3:.1f} ms, theirs {train_times['theirs']['median'] * 1e3:.1f} ms"
        f"; cosine {cosine:.6f}, max |diff| {max_diff:.2e}"
    )
    print(
        f"generate: ours {gen_times['ours']['median'] * 1e3:.1f} ms, theirs {gen_times['theirs']['median'] * 1e3:.1f} ms,"
        f" unsteered {gen_times['unsteered']['median'] * 1e3:.1f} ms; identical tokens {same_tokens}"
    )
    if args.no_write:
        print(json.dumps(payload, indent=2))
    else:
        print(f"wrote {write_result(NAME, payload)}")
    return 0 if checks["vectors_agree"] and same_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
