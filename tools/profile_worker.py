"""cProfile one side of a worker-based benchmark (``benchmarks/*.py`` that run sides in ``--worker`` processes).

Runs ``benchmarks/<script> <args> --worker SIDE`` inside this process under :mod:`cProfile` and prints the top
entries by cumulative and by own time (the worker's JSON result line is printed first)::

    python tools/profile_worker.py benchmarks/grpo_vs_trl.py ours --steps 5 --reps 1
    python tools/profile_worker.py benchmarks/lora_vs_peft.py peft --top 40
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import pstats
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("script", type=Path, help="a benchmark script with --worker sides")
    p.add_argument("side", help="the side to profile (one of the script's --worker choices)")
    p.add_argument("--top", type=int, default=30, help="entries per table")
    args, rest = p.parse_known_args(argv)
    sys.path.insert(0, str(args.script.resolve().parent))  # the benchmark imports _harness from its folder
    spec = importlib.util.spec_from_file_location(args.script.stem, args.script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    profiler = cProfile.Profile()
    code = profiler.runcall(module.main, [*rest, "--worker", args.side])
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    return code


if __name__ == "__main__":
    sys.exit(main())
