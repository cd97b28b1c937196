"""Benchmark the RTS simulation: wall time of a full 2,000-tick match of two scripted agents on one CPU core.

The issue's bar is "a full 2-agent match of 2,000 ticks runs in under 2 seconds on one CPU core". The process
pins itself to one core (``sched_setaffinity``) and one thread, then times, ``--reps`` times after a warm-up:

* ``turtle vs balanced``, seed 0 — both armies alive to the end, so all 2,000 ticks are played (checked);
* ``turtle vs balanced`` with ``no_fog`` (vision is then free) and with replay frames every 20 ticks (the
  cost of recording);
* the tiny LLM agent's decision latency (prompt, grammar-constrained decoding of two intents), over a
  300-tick match against the turtle — reported, not part of the bar.

There is no peer library to run side by side (OpenRA-RL needs the OpenRA engine, mirts-bench is not
packaged), so the summary row compares against the issue's 2-second target.

Usage (from the repository root)::

    python benchmarks/rts_speed.py [--reps 5] [--no-llm] [--no-write]

Writes ``benchmarks/results/rts_speed.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _common import machine_info, package_versions, summary_row, time_repeated, utc_now, write_result

from lightning_llm.envs.rts import BalancedAgent, LLMAgent, Rules, TurtleAgent, play_match, rules_preset

NAME = "rts_speed"
TARGET_S = 2.0


def _match(rules: Rules, frame_every: int) -> int:
    result = play_match([TurtleAgent(), BalancedAgent()], rules, seed=0, frame_every=frame_every)
    return result.ticks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-llm", action="store_true", help="skip the LLM agent latency")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)

    rules = Rules()
    ticks = _match(rules, 0)
    if ticks != rules.max_ticks:
        raise RuntimeError(
            f"the benchmark match ended at tick {ticks}, not {rules.max_ticks}: not a full match"
        )
    settings = {
        "turtle vs balanced, 2000 ticks": (rules, 0),
        "same, no fog of war": (rules_preset("no_fog"), 0),
        "same, replay frames every 20 ticks": (rules, 20),
    }
    cases = {}
    for label, (case_rules, frames) in settings.items():
        timing = time_repeated(lambda r=case_rules, f=frames: _match(r, f), reps=args.reps)
        timing["ticks"] = _match(case_rules, frames)  # no fog changes the game: it may end earlier
        timing["ticks_per_s"] = timing["ticks"] / timing["median"]
        cases[label] = timing
        print(
            f"{label:>38}: {timing['ticks']} ticks, median {timing['median']:.3f} s ({timing['ticks_per_s']:.0f}/s)"
        )

    llm: dict[str, float] | None = None
    if not args.no_llm:
        agent = LLMAgent("tiny")
        latencies: list[float] = []
        act = agent.act

        def timed(obs):
            start = time.perf_counter()
            reply = act(obs)
            latencies.append(time.perf_counter() - start)
            return reply

        agent.act = timed  # type: ignore[method-assign]
        play_match([agent, TurtleAgent()], Rules(max_ticks=300), seed=0, frame_every=0)
        llm = {"decisions": len(latencies), "median_decision_s": statistics.median(latencies)}
        print(
            f"tiny LLM agent: median {llm['median_decision_s'] * 1000:.0f} ms per decision ({len(latencies)})"
        )

    main_case = cases["turtle vs balanced, 2000 ticks"]
    payload = {
        "benchmark": NAME,
        "date": utc_now(),
        "machine": machine_info(),
        "versions": package_versions(["lightning-llm", "numpy", "torch", "transformers"]),
        "config": {"reps": args.reps, "ticks": rules.max_ticks, "cores": 1, "target_s": TARGET_S},
        "cases": cases,
        "llm_agent": llm,
        "summary": [
            summary_row(
                "RTS match speed (1 core)",
                "lightning_llm.envs.rts",
                "issue target (2 s)",
                "s per 2000-tick match",
                main_case["median"],
                TARGET_S,
                "lower",
            )
        ],
    }
    if not args.no_write:
        print(f"wrote {write_result(NAME, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
