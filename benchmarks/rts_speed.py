"""The RTS simulation's speed: wall time of a full 2,000-tick match of two scripted agents on one CPU core.

The issue's bar: "a full 2-agent match of 2,000 ticks runs in under 2 seconds on one CPU core". The process
pins itself to one core and one torch thread, then times ``--reps`` matches (after a warm-up) of
``turtle vs balanced`` at seed 0 (both armies alive to the end, so all 2,000 ticks are played: checked), the
same without fog of war (vision is then free) and with replay frames every 20 ticks (the cost of recording),
interleaved. The tiny LLM agent's decision latency over a 300-tick match against the turtle is reported too
(``--no-llm`` skips it). There is no peer to run side by side (OpenRA-RL needs the OpenRA engine, mirts-bench
is not packaged), so the summary row compares with the 2-second target.

    python benchmarks/rts_speed.py [--reps 5] [--no-llm] [--no-write]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from _harness import finish, interleave, parser, result, row, set_threads, stat

from lightning_llm.envs.rts import BalancedAgent, LLMAgent, Rules, TurtleAgent, play_match, rules_preset

NAME = "rts_speed"
TARGET_S = 2.0


def _match(rules: Rules, frame_every: int) -> int:
    return play_match([TurtleAgent(), BalancedAgent()], rules, seed=0, frame_every=frame_every).ticks


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--no-llm", action="store_true", help="skip the LLM agent latency")
    args = p.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    set_threads(1)

    rules = Rules()
    settings = {
        "full match": (rules, 0),
        "no fog of war": (rules_preset("no_fog"), 0),
        "replay frames every 20 ticks": (rules, 20),
    }
    ticks = {label: _match(r, f) for label, (r, f) in settings.items()}  # no fog may end earlier
    times = interleave(
        {label: (lambda r=r, f=f: _match(r, f)) for label, (r, f) in settings.items()},
        args.reps,
        args.warmup,
    )
    details = {label: {"ticks": ticks[label], "s": stat(t)} for label, t in times.items()}
    if not args.no_llm:
        agent, latencies = LLMAgent("tiny"), []
        act = agent.act

        def timed(obs):
            start = time.perf_counter()
            reply = act(obs)
            latencies.append(time.perf_counter() - start)
            return reply

        agent.act = timed  # type: ignore[method-assign]
        play_match([agent, TurtleAgent()], Rules(max_ticks=300), seed=0, frame_every=0)
        details["llm_agent"] = {"decisions": len(latencies), "median_s": statistics.median(latencies)}
    # fmt: off
    summary = [
        row("RTS match speed (1 core)", f"s per {rules.max_ticks}-tick match", "lightning_llm.envs.rts",
            f"issue target ({TARGET_S:g} s)", times["full match"], [TARGET_S], "lower", peer_exact=True),
    ]
    # fmt: on
    full = ticks["full match"] == rules.max_ticks
    payload = result(
        NAME,
        __doc__,
        summary,
        config={"reps": args.reps, "ticks": rules.max_ticks, "cores": 1, "target_s": TARGET_S},
        checks={"full_match_played": full},
        passed=full,
        details=details,
        packages=("lightning-llm", "numpy", "torch", "transformers"),
    )
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
