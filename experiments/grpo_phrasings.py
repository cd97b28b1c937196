"""The README main job (``configs/grpo_smollm2.yaml``) before and after training, over several seeds.

Runs through the real CLI, one torch thread each: ``validate`` of the untrained model once (greedy, so it does
not depend on the seed), then ``fit`` once per seed (``--seed_everything``: the rollouts' sampling; the data
are the config's). Reads the CSV logs and writes, for the held-out items in the two held-out wordings
(``val/phrasing/...``: strict and lenient, with the worked exchange and with the answer format alone) and for
the held-out items in the training wordings (``val/rewards/task/mean``, strict), the counts before and at each
validation, their Wilson 95% intervals, and whether the final interval lies wholly above the one before (a
gain) on every seed; plus wall time, CPU time and peak RSS of each run. A run directory that holds a finished
run is reused; an existing ``--out`` is never replaced.

    python experiments/grpo_phrasings.py --seeds 0 1 2 --workdir runs/grpo_phrasings \
        --out benchmarks/results/grpo_smollm2_phrasings.json --readme README.md
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from lightning_llm.metrics import wilson_interval

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo_smollm2.yaml"
CONDITIONS = {
    f"held-out wordings, {scoring}, {prompt}": f"val/phrasing/{scoring}/{prompt}"
    for prompt in ("exchange", "plain")
    for scoring in ("strict", "lenient")
}
CONDITIONS["training wordings, strict, exchange"] = "val/rewards/task/mean"


def _run(command: list[str], run: Path) -> dict[str, Any]:
    """One CLI run into ``run`` (skipped when ``run/done`` records a finished one): its wall/CPU/peak RSS."""
    done = run / "done"
    if done.exists():
        return json.loads(done.read_text())
    run.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    with (run / "log.txt").open("w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "lightning_llm.cli", *command, "--trainer.default_root_dir", str(run)],
            stdout=log, stderr=log, env=env,
        )  # fmt: skip
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed; see {run / 'log.txt'}")
    record = {
        "wall_seconds": round(time.perf_counter() - start, 1),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024),  # kilobytes on Linux
    }
    done.write_text(json.dumps(record) + "\n")
    return record


def _validations(run: Path) -> list[dict[str, str]]:
    files = sorted(run.glob("lightning_logs/version_*/metrics.csv"))
    if not files:
        raise FileNotFoundError(f"no metrics.csv under {run}")
    return [r for r in csv.DictReader(files[-1].open()) if r.get("val/rewards/task/mean")]


def _counts(row: dict[str, str], sizes: dict[str, int]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, column in CONDITIONS.items():
        n = sizes["held_out" if column.startswith("val/phrasing") else "val"]
        k = round(float(row[column]) * n)
        out[name] = {"k": k, "n": n, "accuracy": k / n, "wilson95": list(wilson_interval(k, n))}
    return out


def summarise(workdir: Path, seeds: list[int], config: dict[str, Any]) -> dict[str, Any]:
    callback = next(
        cb["init_args"]
        for cb in config["trainer"]["callbacks"]
        if cb["class_path"].endswith("PhrasingAccuracy")
    )
    sizes = {
        "held_out": callback["num_examples"] * len(callback["phrasings"]),
        "val": config["data"]["init_args"]["num_val"],
    }
    before = _counts(_validations(workdir / "before")[-1], sizes)
    runs = {}
    for seed in seeds:
        rows = _validations(workdir / f"seed{seed}")
        runs[seed] = {
            "steps": [int(r["step"]) + 1 for r in rows],
            "validations": [_counts(r, sizes) for r in rows],
            **json.loads((workdir / f"seed{seed}" / "done").read_text()),
        }
    conditions = {}
    for name in CONDITIONS:
        final = [runs[s]["validations"][-1][name] for s in seeds]
        accuracies = sorted(f["accuracy"] for f in final)
        conditions[name] = {
            "before": before[name],
            "after_per_seed": dict(zip(map(str, seeds), final, strict=True)),
            "after_median": accuracies[len(accuracies) // 2],
            "after_range": [accuracies[0], accuracies[-1]],
            "gain_on_every_seed": all(f["wilson95"][0] > before[name]["wilson95"][1] for f in final),
        }
    return {
        "config": str(CONFIG.relative_to(ROOT)),
        "seeds": seeds,
        "budget": {
            "max_steps": config["trainer"]["max_steps"],
            "prompts_per_step": config["data"]["init_args"]["batch_size"],
            "group_size": config["model"]["init_args"]["group_size"],
            "max_new_tokens": config["model"]["init_args"]["max_new_tokens"],
        },
        "sizes": sizes,
        "before_run": json.loads((workdir / "before" / "done").read_text()),
        "conditions": conditions,
        "runs": {str(s): runs[s] for s in seeds},
    }


def readme_table(result: dict[str, Any]) -> str:
    """The README's main-job table: every condition before and after (per seed), Wilson 95% intervals."""
    seeds = result["seeds"]
    head = "| items asked in, scored, prompt | before | " + " | ".join(f"after, seed {s}" for s in seeds)
    lines = [head + " | gain |", "|" + " --- |" * (3 + len(seeds))]

    def cell(c: dict[str, Any]) -> str:
        low, high = c["wilson95"]
        return f"{c['accuracy']:.2f} [{low:.2f}–{high:.2f}] ({c['k']}/{c['n']})"

    for name, c in result["conditions"].items():
        after = " | ".join(cell(c["after_per_seed"][str(s)]) for s in seeds)
        gain = "**yes**" if c["gain_on_every_seed"] else "no (intervals overlap)"
        lines.append(f"| {name} | {cell(c['before'])} | {after} | {gain} |")
    return "\n".join(lines)


def replace_block(text: str, block: str, marker: str = "main-job") -> str:
    """``text`` with what stands between ``<!-- marker:start -->`` and ``<!-- marker:end -->`` replaced."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"need exactly one {start} and one {end}")
    before, rest = text.split(start)
    return f"{before}{start}\n{block}\n{end}{rest.split(end)[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument(
        "--readme", type=Path, help="rewrite the table between <!-- main-job:start/end --> in this file"
    )
    args = parser.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; remove it or choose another --out")
    config = yaml.safe_load(args.config.read_text())
    _run(["validate", "--config", str(args.config)], args.workdir / "before")
    for seed in args.seeds:
        run = args.workdir / f"seed{seed}"
        _run(
            ["fit", "--config", str(args.config), "--seed_everything", str(seed),
             "--model.init_args.save_dir", str(run / "model")],
            run,
        )  # fmt: skip
    result = summarise(args.workdir, args.seeds, config)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.readme:
        args.readme.write_text(replace_block(args.readme.read_text(), readme_table(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
