"""PCFG parsing and scoring: ``lightning_llm.metrics.PCFG`` vs NLTK (``nltk.PCFG``, ``ViterbiParser``).

NLTK is what a researcher reaches for to parse with a PCFG in Python. Same grammar (the layered random grammar
of ``configs/pcfg.yaml``, converted rule by rule to ``nltk.PCFG``), same sampled sentences (digest in config):

* **Viterbi parsing**: ours ``PCFG.viterbi(sentences)`` (batched log-space CKY with back-pointers) vs
  ``nltk.ViterbiParser(grammar).parse(words)`` per sentence; best-parse log-probabilities must agree to 1e-9.
* **Sentence probability**: ours ``PCFG.log_prob`` (inside algorithm, all parses) vs NLTK's closest tool,
  ``InsideChartParser(beam_size=0)`` with every parse summed; must agree to 1e-9. Its parse count grows
  exponentially with length, so this set is limited to ``--inside-max-words``.
* Exact next-token distributions (the grammar-KL target) have no NLTK counterpart: timed alone (details).

One process, ours and NLTK interleaved (order alternating), ``--reps`` rounds after a warm-up, one thread.

    python benchmarks/pcfg_vs_nltk.py [--sentences 64] [--reps 5] [--no-write]
"""

from __future__ import annotations

import math
import statistics
import sys

from _harness import digest, finish, interleave, parser, result, row, set_threads, stat

from lightning_llm.text.pcfg import PCFG

NAME = "pcfg_vs_nltk"


def _to_nltk(grammar: PCFG):
    """The same grammar as ``nltk.PCFG`` (NLTK takes the first rule's left-hand side as the start symbol)."""
    import nltk

    start = grammar.nonterminals[grammar.start]
    rules = sorted(grammar.rules(), key=lambda rule: rule[0] != start)  # stable: start symbol's rules first
    lines = [f"{lhs} -> {' '.join(rhs) if len(rhs) == 2 else repr(rhs[0])} [{p!r}]" for lhs, rhs, p in rules]
    return nltk.PCFG.fromstring(lines)


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--sentences", type=int, default=64)
    p.add_argument("--inside-sentences", type=int, default=16, help="sentences for the inside comparison")
    p.add_argument("--inside-max-words", type=int, default=10, help="length cap of the inside set")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import nltk
    from nltk.parse.pchart import InsideChartParser

    set_threads(args.threads)
    grammar = PCFG.random(seed=0)  # the configs/pcfg.yaml grammar
    sentences = grammar.sample(args.sentences, max_length=32, seed=args.seed + 1)
    words = [[grammar.terminals[w] for w in s] for s in sentences]
    theirs = _to_nltk(grammar)
    viterbi = nltk.ViterbiParser(theirs)
    short = [s for s in sentences if len(s) <= args.inside_max_words][: args.inside_sentences]
    short_words = [[grammar.terminals[w] for w in s] for s in short]
    chart = InsideChartParser(theirs, beam_size=0)
    fns = {
        "ours viterbi": lambda: [logp for logp, _ in grammar.viterbi(sentences)],
        "nltk viterbi": lambda: [math.log(next(iter(viterbi.parse(w))).prob()) for w in words],
        "ours inside": lambda: grammar.log_prob(short).tolist(),
        "nltk inside": lambda: [math.log(sum(t.prob() for t in chart.parse_all(w))) for w in short_words],
    }
    times = interleave(fns, args.reps, args.warmup)
    next_token = interleave(
        {"next_token_logprobs": lambda: grammar.next_token_logprobs(sentences, max_length=32)}, args.reps
    )
    checks = {
        "viterbi_max_rel_diff": _max_rel(fns["ours viterbi"](), fns["nltk viterbi"]()),
        "inside_max_rel_diff": _max_rel(fns["ours inside"](), fns["nltk inside"]()),
    }
    agree = checks["viterbi_max_rel_diff"] < 1e-9 and checks["inside_max_rel_diff"] < 1e-9
    unit = f"{args.sentences} sentences, mean {statistics.mean(map(len, sentences)):.1f} words, 1 CPU thread"
    # fmt: off
    summary = [
        row(NAME, f"time to parse, s ({unit})", "PCFG.viterbi (batched)", "nltk.ViterbiParser",
            times["ours viterbi"], times["nltk viterbi"], "lower"),
        row(NAME, f"time to score, s ({len(short)} sentences of <= {args.inside_max_words} words)",
            "PCFG.log_prob (inside)", "nltk InsideChartParser, sum over all parses", times["ours inside"],
            times["nltk inside"], "lower"),
    ]
    # fmt: on
    payload = result(
        NAME,
        __doc__,
        summary,
        config={
            "grammar": "PCFG.random(seed=0): 9 non-terminals, 12 terminals, 5 levels (configs/pcfg.yaml)",
            "rules": len(grammar.rules()),
            "sentences": args.sentences,
            "inside_sentences": len(short),
            "sentence_digest": digest(sentences),
            "reps": args.reps,
            "threads": args.threads,
        },
        checks={**checks, "agree": agree},
        passed=agree,
        details={"next_token_logprobs_s": stat(next_token["next_token_logprobs"])},
        packages=("torch", "nltk", "lightning"),
    )
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
