"""PCFG parsing and scoring: ``lightning_llm.datamodules.PCFG`` vs NLTK (``nltk.PCFG``, ``ViterbiParser``).

NLTK is what a researcher reaches for to parse with a PCFG in Python. On the same grammar (the layered random
grammar of ``configs/pcfg.yaml``, converted rule by rule to ``nltk.PCFG``) and the same sampled sentences:

* **Viterbi parsing** — ours ``PCFG.viterbi(sentences)`` (batched log-space CKY with back-pointers) vs
  ``nltk.ViterbiParser(grammar).parse(words)`` per sentence; the best-parse log-probabilities must agree (checked
  to 1e-9 relative) and the time to parse the whole set is compared.
* **Sentence probability** — ours ``PCFG.log_prob`` (inside algorithm, sums over *all* parses) vs the closest NLTK
  tool, ``InsideChartParser(beam_size=0)`` with all its parses summed (``parse_all``); reported with agreement.
  NLTK has no direct inside probability, so this is what reproducing one costs there. Its parse count grows
  exponentially with length (432 parses at 12 words here), so this set is limited to ``--inside-max-words``.
* **Exact next-token distributions** (the grammar-KL target) have no NLTK counterpart: ours is timed alone and
  reported in the JSON, not in the comparison table.

Both run in one process on the CPU, interleaved repetitions, median over ``--reps``; one torch thread by default.

Usage (from the repository root)::

    python benchmarks/pcfg_vs_nltk.py                  # 64 sentences, 5 reps
    python benchmarks/pcfg_vs_nltk.py --sentences 256 --reps 3

Writes ``benchmarks/results/pcfg_vs_nltk.json`` (``--no-write`` to skip); exits 1 if the parses' or the
sentence probabilities disagree.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch
from _common import machine_info, package_versions, summary_row, time_repeated, utc_now, write_result

from lightning_llm.datamodules.pcfg import PCFG

NAME = "pcfg_vs_nltk"

MEASUREMENT = {
    "time": "perf_counter around parsing / scoring the whole sentence set, ours and NLTK alternating in one "
    "process, --reps blocks after one untimed warm-up call each; median (and min, all) over blocks",
    "agreement": "max relative difference of the best-parse log-probability (Viterbi) and of the sentence "
    "log-probability (inside vs the sum over NLTK's exhaustive chart parses)",
}


def _to_nltk(grammar: PCFG):
    """The same grammar as ``nltk.PCFG`` (NLTK takes the first rule's left-hand side as the start symbol)."""
    import nltk

    start = grammar.nonterminals[grammar.start]
    rules = sorted(grammar.rules(), key=lambda rule: rule[0] != start)  # stable: start symbol's rules first
    lines = [f"{lhs} -> {' '.join(rhs) if len(rhs) == 2 else repr(rhs[0])} [{p!r}]" for lhs, rhs, p in rules]
    return nltk.PCFG.fromstring(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument(
        "--inside-sentences", type=int, default=16, help="sentences for the inside comparison"
    )
    parser.add_argument("--inside-max-words", type=int, default=10, help="length cap of the inside set")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    import nltk
    from nltk.parse.pchart import InsideChartParser

    if args.threads:
        torch.set_num_threads(args.threads)
    grammar = PCFG.random(seed=0)  # the configs/pcfg.yaml grammar
    sentences = grammar.sample(args.sentences, max_length=32, seed=args.seed + 1)
    words = [[grammar.terminals[w] for w in s] for s in sentences]
    theirs_grammar = _to_nltk(grammar)
    viterbi = nltk.ViterbiParser(theirs_grammar)

    def ours_viterbi():
        return [logp for logp, _ in grammar.viterbi(sentences)]

    def theirs_viterbi():
        return [math.log(next(iter(viterbi.parse(w))).prob()) for w in words]

    # NLTK enumerates every parse (exponentially many in the length): keep its set to short sentences.
    inside_sentences = [s for s in sentences if len(s) <= args.inside_max_words][: args.inside_sentences]
    inside_words = [[grammar.terminals[w] for w in s] for s in inside_sentences]
    chart = InsideChartParser(theirs_grammar, beam_size=0)

    def ours_inside():
        return grammar.log_prob(inside_sentences).tolist()

    def theirs_inside():
        return [math.log(sum(tree.prob() for tree in chart.parse_all(w))) for w in inside_words]

    times: dict[str, dict[str, list[float]]] = {k: {"ours": [], "theirs": []} for k in ("viterbi", "inside")}
    for fn in (ours_viterbi, theirs_viterbi, ours_inside, theirs_inside):
        fn()  # warm-up
    for rep in range(args.reps):
        order = [("ours", "theirs"), ("theirs", "ours")][rep % 2]
        for task, fns in (
            ("viterbi", (ours_viterbi, theirs_viterbi)),
            ("inside", (ours_inside, theirs_inside)),
        ):
            for who in order:
                fn = fns[0] if who == "ours" else fns[1]
                times[task][who] += time_repeated(fn, reps=1, warmup=0)["all"]
    stats = {
        task: {who: {"median": statistics.median(t), "min": min(t), "all": t} for who, t in by.items()}
        for task, by in times.items()
    }
    next_token = time_repeated(
        lambda: grammar.next_token_logprobs(sentences, max_length=32), reps=args.reps, warmup=1
    )

    ours_v, theirs_v = ours_viterbi(), theirs_viterbi()
    ours_i, theirs_i = ours_inside(), theirs_inside()
    rel = lambda a, b: max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))  # noqa: E731
    checks = {
        "viterbi_max_rel_diff": rel(ours_v, theirs_v),
        "inside_max_rel_diff": rel(ours_i, theirs_i),
    }
    checks["agree"] = checks["viterbi_max_rel_diff"] < 1e-9 and checks["inside_max_rel_diff"] < 1e-9
    unit = f"{args.sentences} sentences, mean {statistics.mean(map(len, sentences)):.1f} words, 1 CPU thread"
    summary = [
        summary_row(
            NAME,
            "PCFG.viterbi (batched)",
            "nltk.ViterbiParser",
            f"time to parse, s ({unit})",
            stats["viterbi"]["ours"]["median"],
            stats["viterbi"]["theirs"]["median"],
            better="lower",
        ),
        summary_row(
            NAME,
            "PCFG.log_prob (inside)",
            "nltk InsideChartParser, sum over all parses",
            f"time to score, s ({len(inside_sentences)} sentences of <= {args.inside_max_words} words)",
            stats["inside"]["ours"]["median"],
            stats["inside"]["theirs"]["median"],
            better="lower",
        ),
    ]
    payload = {
        "benchmark": NAME,
        "description": "Viterbi parsing and sentence probabilities of a PCFG: lightning_llm vs NLTK, same grammar "
        "and sentences",
        "config": {
            "grammar": "PCFG.random(seed=0): 9 non-terminals, 12 terminals, 5 levels (configs/pcfg.yaml)",
            "rules": len(grammar.rules()),
            "sentences": args.sentences,
            "inside_sentences": len(inside_sentences),
            "inside_max_words": args.inside_max_words,
            "mean_length": statistics.mean(map(len, sentences)),
            "reps": args.reps,
            "threads": args.threads,
        },
        "time_s": stats,
        "next_token_logprobs_time_s": {**next_token, "note": "no NLTK counterpart; max_length=32"},
        "ratios": {task: stats[task]["ours"]["median"] / stats[task]["theirs"]["median"] for task in stats},
        "checks": checks,
        "measurement": MEASUREMENT,
        "versions": package_versions(["torch", "nltk", "lightning"]),
        "machine": machine_info(),
        "date": utc_now(),
        "summary": summary,
    }
    for task in stats:
        print(
            f"{task}: ours {stats[task]['ours']['median']:.4f} s, nltk {stats[task]['theirs']['median']:.4f} s"
        )
    print(f"checks {checks}; next-token tables {next_token['median']:.3f} s")
    if args.no_write:
        print(json.dumps(payload, indent=2))
    else:
        print(f"wrote {write_result(NAME, payload)}")
    return 0 if checks["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
