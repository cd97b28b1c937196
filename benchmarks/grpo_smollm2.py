"""GRPO + LoRA on SmolLM2-135M-Instruct (``configs/grpo_smollm2_1digit.yaml``), with and without Clip_B: the curves.

Runs, through the real CLI and one torch thread each, (1) ``validate`` of the untrained model on the held-out
prompts, (2) ``fit`` of the config, (3) ``fit`` of the config plus ``EntropyDiscriminatorClipping(mode="batch",
mu=1.0)``, each in its own directory under ``--workdir`` (a directory that already holds a finished run is
reused, not overwritten). Then reads their CSV logs and writes per-step sampled task reward, format reward,
entropy and Clip_B's dropped fraction, and the held-out greedy task accuracy before and at each validation, to
``--out``.

    python benchmarks/grpo_smollm2.py --workdir runs/grpo_smollm2_study --out benchmarks/results/grpo_smollm2.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo_smollm2_1digit.yaml"
CLIP_B = """trainer:
  callbacks:
    - class_path: lightning_llm.callbacks.EntropyDiscriminatorClipping
      init_args:
        mode: batch
        mu: 1.0
"""
COLUMNS = {
    "task": "train/rewards/task/mean",
    "format": "train/rewards/format/mean",
    "entropy": "train/entropy",
    "frac_zero_std": "train/frac_reward_zero_std",
    "clip_b_dropped": "train/Clip_B/clipped_frac",
}


def _cli(args: list[str], log: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one CLI run (one torch thread)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start, cpu = time.perf_counter(), _children_cpu()
    with log.open("w") as out:
        subprocess.run(
            [sys.executable, "-m", "lightning_llm.cli", *args], check=True, stdout=out, stderr=out, env=env
        )
    return time.perf_counter() - start, _children_cpu() - cpu


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _metrics(run: Path) -> list[dict[str, str]]:
    files = sorted(run.glob("lightning_logs/version_*/metrics.csv"))
    if not files:
        raise FileNotFoundError(f"no metrics.csv under {run}")
    return list(csv.DictReader(files[-1].open()))


def _series(rows: list[dict[str, str]], column: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[column])) for r in rows if r.get(column)]


def _run(workdir: Path, name: str, extra: list[str], validate: bool = False) -> None:
    run = workdir / name
    if (run / "done").exists():
        return
    run.mkdir(parents=True, exist_ok=True)
    command = ["validate" if validate else "fit", "--config", str(CONFIG), *extra]
    command += ["--trainer.default_root_dir", str(run)]
    if not validate:
        command += ["--model.init_args.save_dir", str(run / "model")]
    wall, cpu = _cli(command, run / "log.txt")
    (run / "done").write_text(json.dumps({"wall_seconds": round(wall), "cpu_seconds": round(cpu)}) + "\n")


def summarise(workdir: Path) -> dict[str, Any]:
    """The JSON record of the three runs in ``workdir``."""
    before = _metrics(workdir / "before")
    out: dict[str, Any] = {
        "config": "configs/grpo_smollm2_1digit.yaml",
        "held_out_task_accuracy_before": float(before[-1]["val/rewards/task/mean"]),
        "held_out_format_before": float(before[-1]["val/rewards/format/mean"]),
        "arms": {},
    }
    for arm in ("plain", "clip_b"):
        rows = _metrics(workdir / arm)
        record = {k: _series(rows, c) for k, c in COLUMNS.items() if any(r.get(c) for r in rows)}
        record["held_out_task_accuracy"] = _series(rows, "val/rewards/task/mean")
        record.update(json.loads((workdir / arm / "done").read_text()))
        out["arms"][arm] = record
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--extended",
        type=Path,
        help="a finished run of the same recipe at more steps (its default_root_dir); its curves are added as "
        "'extended' with the flags it ran with (read from its saved config.yaml)",
    )
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; remove it or choose another --out")
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "clip_b.yaml").write_text(CLIP_B)
    _run(args.workdir, "before", [], validate=True)
    _run(args.workdir, "plain", [])
    _run(args.workdir, "clip_b", ["--config", str(args.workdir / "clip_b.yaml")])
    result = summarise(args.workdir)
    if args.extended:
        rows = _metrics(args.extended)
        saved = sorted(args.extended.glob("lightning_logs/version_*/config.yaml"))[-1].read_text()
        steps = re.search(r"max_steps: (\d+)", saved)
        result["extended"] = {
            "max_steps": int(steps.group(1)) if steps else None,
            "held_out_task_accuracy": _series(rows, "val/rewards/task/mean"),
            "task": _series(rows, COLUMNS["task"]),
        }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
