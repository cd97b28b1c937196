"""Steering vectors: ``lightning_llm`` (``train_steering_vector``, ``ActivationSteering``) vs ``steering-vectors``.

Same model (``--model``, default the embedded tiny Llama; fp32, CPU, eval mode), same contrast pairs
(synthetic ``(text with the concept, text without)`` pairs of varying length, see ``_pairs``), one process:

* **training time** of a diffmean vector at one decoder layer: ours ``train_steering_vector(model, tok, pairs,
  layer, method="diffmean", batch_size=B)`` vs theirs ``steering_vectors.train_steering_vector(model, tok,
  pairs, layers=[layer], batch_size=B)`` (mean aggregator, ``read_token_index=-1``, decoder blocks). Both read
  the output of block ``layer`` (HF ``hidden_states[layer + 1]``) at the last non-pad token, right padding on
  both. Ours stops the forward after the read layer, theirs runs the whole model (a design difference that is
  part of what is timed); both under ``torch.no_grad``. The vectors must agree (cosine >= 0.9999).
* **steered generation**: greedy ``model.generate`` (fixed length) of a batch of prompts with the *same* vector
  added at the same layer and all positions, ours ``ActivationSteering(v, layer, multiplier).attach(model)`` vs
  theirs ``SteeringVector({layer: v}).apply(model, multiplier=m)``, and unsteered; the steered tokens must be
  identical. Also the overhead over the unsteered call (paired per round).

Concepts: ``--concept fire`` (default) is the synthetic pair set above on the tiny model. A real concept of
:mod:`lightning_llm.evaluation.steering_concepts` (``ocean``, ``food``, ``music``; e.g. ``--model smollm2-135m --concept
ocean --layer 15``) takes that study's contrast pairs (``contrast_pairs(concept, pairs, seed)``), steers its
neutral chat prompts (``NEUTRAL_PROMPTS``) and also compares the *effect*: each library's own trained vector
applied by that library, the concept rate of the answers (the study's keyword detector) and their tokens.
A run merges its rows into the results file beside the other settings' rows (``--fresh``: drop those), each
setting's config and checks under ``details["settings"]``; passed only if every setting passed.

Timing: :func:`_harness.interleave` (``--reps`` rounds, order alternating, one torch thread).
``steering-vectors`` pins transformers < 5 but runs on 5.x: install it with ``--no-deps`` (benchmarks/README.md).

    python benchmarks/steering_vs_steering_vectors.py [--pairs 64] [--layer 1] [--reps 21] [--no-write]
    python benchmarks/steering_vs_steering_vectors.py --model smollm2-135m --concept ocean --layer 15 --reps 5
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import torch
from _harness import RESULTS_DIR, digest, finish, interleave, parser, result, row, set_threads

NAME = "steering_vs_steering_vectors"
COSINE_CRITERION = 0.9999
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


def _unit(config: dict[str, Any]) -> str:
    """The setting a run measured (the key of its rows and of ``details["settings"]``)."""
    concept = config.get("concept", "fire")
    return f"{config['model']}, concept {concept}, layer {config['layer']}"


def _merge(payload: dict[str, Any], path: Path) -> dict[str, Any]:
    """``payload`` with the other settings' rows already in ``path`` kept (this setting's replaced), and every
    setting's config and checks under ``details["settings"][unit]``; passed only if all settings passed."""
    keys = ("passed", "checks", "config", "versions", "machine", "date")
    mine = {k: payload[k] for k in keys} | {"metrics": [r["metric"] for r in payload["summary"]]}
    settings: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    if path.is_file():
        old = json.loads(path.read_text())
        old_mine = {k: old[k] for k in keys} | {"metrics": [r["metric"] for r in old["summary"]]}
        settings = old["details"].get("settings") or {_unit(old["config"]): old_mine}
        settings.pop(_unit(payload["config"]), None)
        metrics = {r["metric"] for r in payload["summary"]}
        rows = [r for r in old["summary"] if r["metric"] not in metrics]
    settings[_unit(payload["config"])] = mine
    return payload | {
        "summary": rows + payload["summary"],
        "passed": all(s["passed"] for s in settings.values()),
        "details": {**payload["details"], "settings": settings},
    }


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, reps=21)
    p.add_argument("--model", default="tiny", help="backbone name or directory (load_backbone)")
    p.add_argument("--pairs", type=int, default=64, help="contrast pairs")
    p.add_argument("--batch-size", type=int, default=8, help="pairs per forward, both libraries")
    p.add_argument("--layer", type=int, default=1, help="0-based decoder layer")
    p.add_argument("--prompts", type=int, default=16, help="prompts per steered generate call")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--multiplier", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--concept",
        default="fire",
        help="fire (synthetic, tiny) or a concept of lightning_llm.evaluation.steering_concepts",
    )
    p.add_argument("--fresh", action="store_true", help="drop the other settings' rows from the results file")
    args = p.parse_args(argv)
    set_threads(args.threads)
    import steering_vectors as sv
    from transformers.utils import logging as hf_logging

    from lightning_llm.backbones import load_backbone
    from lightning_llm.callbacks import ActivationSteering, train_steering_vector

    hf_logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    model, tok = load_backbone(args.model)
    model.eval()
    tok.padding_side = "right"  # the same padding on both sides
    real = args.concept != "fire"
    if real:
        from lightning_llm.evaluation import steering_concepts as study

        if args.concept not in study.CONCEPTS:
            p.error(f"--concept must be fire or one of {sorted(study.CONCEPTS)}, got {args.concept!r}")
        pairs = study.contrast_pairs(args.concept, args.pairs, args.seed)
    else:
        pairs = _pairs(args.pairs, args.seed)

    def ours_train() -> torch.Tensor:
        return train_steering_vector(
            model, tok, pairs, args.layer, method="diffmean", batch_size=args.batch_size
        )

    @torch.no_grad()
    def theirs_train() -> torch.Tensor:
        vec = sv.train_steering_vector(model, tok, pairs, layers=[args.layer], batch_size=args.batch_size)
        return vec.layer_activations[args.layer]

    ours_vec, theirs_vec = ours_train().float(), theirs_train().float()
    cosine = float(torch.nn.functional.cosine_similarity(ours_vec, theirs_vec, dim=0))
    train = interleave({"ours": ours_train, "theirs": theirs_train}, args.reps, args.warmup)

    if real:
        prompts = study.chat_prompts(tok, study.NEUTRAL_PROMPTS[: args.prompts])
    else:
        prompts = [q[: q.rindex(" the ") + len(" the")] for q, _ in pairs[: args.prompts]]
    tok.padding_side = "left"  # generation pads on the left
    enc = tok(prompts, return_tensors="pt", padding=True)
    gen_kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    their_vector = sv.SteeringVector(layer_activations={args.layer: ours_vec}, layer_type="decoder_block")

    @torch.no_grad()
    def plain() -> torch.Tensor:
        return model.generate(**enc, **gen_kwargs)

    @torch.no_grad()
    def ours_gen() -> torch.Tensor:
        with ActivationSteering(ours_vec, layer=args.layer, multiplier=args.multiplier).attach(model):
            return model.generate(**enc, **gen_kwargs)

    @torch.no_grad()
    def theirs_gen() -> torch.Tensor:
        with their_vector.apply(model, multiplier=args.multiplier):
            return model.generate(**enc, **gen_kwargs)

    ours_tokens, theirs_tokens = ours_gen(), theirs_gen()
    checks = {
        "cosine": cosine,
        "max_abs_diff": float((ours_vec - theirs_vec).abs().max()),
        "vectors_agree": cosine >= COSINE_CRITERION,
        "steered_tokens_identical": bool(torch.equal(ours_tokens, theirs_tokens)),
        "steering_changes_greedy_output": not bool(torch.equal(ours_tokens, plain())),
    }
    if real:  # the effect of each library's own vector, applied by that library
        detector = study.concept_detector(args.concept)
        own = sv.SteeringVector(layer_activations={args.layer: theirs_vec}, layer_type="decoder_block")
        with torch.no_grad(), own.apply(model, multiplier=args.multiplier):
            theirs_own = model.generate(**enc, **gen_kwargs)
        width = enc["input_ids"].shape[1]

        def rate(ids: torch.Tensor) -> float:
            texts = tok.batch_decode(ids[:, width:], skip_special_tokens=True)
            return sum(detector(texts)) / len(texts)

        checks |= {
            "concept_rate_unsteered": rate(plain()),
            "concept_rate_ours": rate(ours_tokens),
            "concept_rate_theirs_own_vector": rate(theirs_own),
            "own_vectors_same_tokens": bool(torch.equal(ours_tokens, theirs_own)),
        }
    gen = interleave({"ours": ours_gen, "theirs": theirs_gen, "unsteered": plain}, args.reps, args.warmup)
    overhead = {k: [a / b for a, b in zip(gen[k], gen["unsteered"], strict=True)] for k in ("ours", "theirs")}
    setting = f"{args.model}, fp32, cpu, {args.threads or 'default'} thread(s)"
    concept = f", concept {args.concept}" if real else ""
    unit = f"{setting}, layer {args.layer}{concept}, {args.pairs} pairs, batch {args.batch_size}"
    gen_unit = f"{setting}{concept}, {args.prompts} prompts x {args.new_tokens} new tokens, greedy"
    # fmt: off
    summary = [
        row(NAME, f"time to train one vector, s ({unit})", "train_steering_vector (diffmean)",
            "steering_vectors.train_steering_vector", train["ours"], train["theirs"], "lower"),
        row(NAME, f"steered generate time, s ({gen_unit})", "ActivationSteering", "SteeringVector.apply",
            gen["ours"], gen["theirs"], "lower"),
        row(NAME, f"steered / unsteered generate time ({gen_unit})", "ActivationSteering",
            "SteeringVector.apply", overhead["ours"], overhead["theirs"], "lower"),
    ]
    # fmt: on
    payload = result(
        NAME,
        __doc__,
        summary,
        config={
            **vars(args),
            "no_write": None,
            "fresh": None,
            "pairs_digest": digest(pairs),
            "prompts_digest": digest(enc["input_ids"], enc["attention_mask"]),
        },
        checks=checks,
        passed=checks["vectors_agree"] and checks["steered_tokens_identical"],
        packages=("torch", "transformers", "steering-vectors", "lightning"),
    )
    if not args.no_write and not args.fresh:
        payload = _merge(payload, RESULTS_DIR / f"{NAME}{f'-{args.tag}' if args.tag else ''}.json")
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
