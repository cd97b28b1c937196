"""The one harness every benchmark uses: repetitions, interleaving, process isolation, digests, summaries, schema.

A benchmark script declares its sides ("ours", a peer, sometimes variants) and its inputs; this module does
the rest:

* :func:`parser` adds the shared flags (``--reps``, ``--warmup``, ``--threads``, ``--no-write``, the hidden
  ``--worker``); :func:`worker_main` answers a ``--worker SIDE`` call with one JSON line;
* :func:`run_workers` runs every side in a fresh interpreter per repetition, the sides of one repetition back
  to back in alternating order (paired processes), so imports, allocator state and RSS high-water marks never
  leak between sides; :func:`interleave` does the same in one process for callables;
* :class:`StepClock` times training steps and the peak resident memory of the steady-state steps of a worker;
* :func:`digest` fingerprints inputs; :func:`run_workers` fails when the sides did not see identical inputs;
* :func:`stat` summarises repetitions (median, min, max, quartiles); :func:`row` compares two sides, with the
  per-repetition ratio when repetitions are paired; :func:`verdict` says whether ours wins outside the noise;
* :func:`write_result` writes ``results/<name>.json`` in the one schema (``SCHEMA``) ``make_table.py`` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SCHEMA = 2
MAX_RESULT_BYTES = 64 * 1024  # results hold summaries, not every step
# paired ratios all on one side of 1 count only from 5 pairs (2/32 by chance with no difference)
PAIRED_MIN = 5
ROW_KEYS = ("benchmark", "metric", "ours", "peer", "better", "ours_value", "peer_value")
ROW_KEYS += ("ratio", "paired_ratio")
STAT_KEYS = ("median", "min", "max", "q1", "q3", "n", "values", "exact")
_MIB = 2**20

Better = Literal["lower", "higher"]


# ------------------------------------------------------------------------------------------ statistics


def stat(values: Iterable[float], exact: bool = False) -> dict[str, Any]:
    """Median, min, max, quartiles and the values of repeated measurements.

    ``exact`` marks a number that carries no sampling noise (a target, a constant): one value is then enough.
    """
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("no values to summarise")
    q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 else vals * 3
    summary = (statistics.median(vals), min(vals), max(vals), q1, q3, len(vals), vals, exact)
    return dict(zip(STAT_KEYS, summary, strict=True))


def _ratio(a: float, b: float) -> float:
    if b:
        return a / b
    return 1.0 if a == 0 else float("inf")  # 0 / 0 is a tie (e.g. both at zero accuracy)


def row(
    benchmark: str,
    metric: str,
    ours: str,
    peer: str,
    ours_values: Sequence[float],
    peer_values: Sequence[float],
    better: Better,
    *,
    paired: bool = True,
    peer_exact: bool = False,
) -> dict[str, Any]:
    """One "ours vs peer" comparison: both sides' summaries, the ratio of medians and, for paired repetitions
    (repetition ``i`` of both sides ran back to back, or on the same seed), the summary of per-repetition ratios."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', got {better!r}")
    o, p = stat(ours_values), stat(peer_values, exact=peer_exact)
    pairs = paired and o["n"] == p["n"] > 1
    paired_ratio = (
        stat(_ratio(a, b) for a, b in zip(ours_values, peer_values, strict=True)) if pairs else None
    )
    values = (benchmark, metric, ours, peer, better, o, p, _ratio(o["median"], p["median"]), paired_ratio)
    return dict(zip(ROW_KEYS, values, strict=True))


def verdict(r: dict[str, Any]) -> Literal["win", "loss", "tie", "single"]:
    """``win``/``loss`` only outside the noise band, else ``tie``; ``single`` when a side has one noisy run.

    Outside the noise band: the two sides' ranges (min..max over repetitions) do not overlap, or at least
    ``PAIRED_MIN`` paired per-repetition ratios are all on one side of 1.
    """
    o, p = r["ours_value"], r["peer_value"]
    if (o["n"] < 2 and not o["exact"]) or (p["n"] < 2 and not p["exact"]):
        return "single"
    lower = r["better"] == "lower"
    ratios = r["paired_ratio"] if r["paired_ratio"] and r["paired_ratio"]["n"] >= PAIRED_MIN else None
    below = ratios is not None and ratios["max"] < 1  # every paired repetition has ours < peer
    above = ratios is not None and ratios["min"] > 1
    if (o["max"] < p["min"] or below) if lower else (o["min"] > p["max"] or above):
        return "win"
    if (o["min"] > p["max"] or above) if lower else (o["max"] < p["min"] or below):
        return "loss"
    return "tie"


# ---------------------------------------------------------------------------------------------- timing


def interleave(
    fns: dict[str, Callable[[], Any]],
    reps: int,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each callable: ``warmup`` untimed calls each, then ``reps`` rounds that call every
    one once, the order reversed every other round. ``sync`` (e.g. ``torch.cuda.synchronize``) brackets calls."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            if sync is not None:
                sync()
            start = time.perf_counter()
            fns[name]()
            if sync is not None:
                sync()
            times[name].append(time.perf_counter() - start)
    return times


# --------------------------------------------------------------------------------------- memory (RSS)


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS (Linux >= 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """Process RSS high-water mark: ``VmHWM`` on Linux (resettable), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss if sys.platform == "darwin" else max_rss * 1024


class StepClock:
    """Step times and steady-state peak memory of one worker.

    Call :meth:`before_fit` once everything but the steps exists (model, optimizer, data; the memory
    baseline), :meth:`train_start` right before the first step and :meth:`step_end` after each step, with any
    per-step values to keep (``loss=...``). After ``warmup`` steps the kernel's RSS high-water mark is reset,
    so ``peak_mib`` is the worst resident memory of the steady-state steps above the baseline.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.intervals: list[float] = []
        self.values: dict[str, list[float]] = {}
        self.baseline = 0
        self.hwm_reset = False
        self.last = 0.0

    def before_fit(self) -> None:
        gc.collect()
        self.baseline = rss_bytes()

    def train_start(self) -> None:
        self.last = time.perf_counter()

    def step_end(self, **values: float | None) -> None:
        self.intervals.append(time.perf_counter() - self.last)
        for key, value in values.items():
            self.values.setdefault(key, []).append(float("nan") if value is None else float(value))
        if len(self.intervals) == self.warmup:
            self.hwm_reset = reset_peak_rss()
        self.last = time.perf_counter()  # bookkeeping above is not charged to the next step

    @property
    def timed(self) -> list[float]:
        """The step intervals after the warm-up."""
        return self.intervals[self.warmup :]

    def result(self) -> dict[str, Any]:
        """Per-worker summary: median and mean timed step, peak RSS increase, the per-step values' means."""
        timed = self.timed
        if not timed:
            raise RuntimeError(f"no timed steps ({len(self.intervals)} steps, warm-up {self.warmup})")
        return {
            "step_s_median": statistics.median(timed),
            "step_s_mean": statistics.fmean(timed),
            "steps": len(timed),
            "peak_mib": (peak_rss_bytes() - self.baseline) / _MIB,
            "peak_source": "VmHWM reset after warm-up" if self.hwm_reset else "ru_maxrss (process lifetime)",
            "values": {k: v for k, v in self.values.items()},
        }


# ------------------------------------------------------------------------------------ inputs & workers


def digest(*objs: Any) -> str:
    """A short SHA-256 of tensors, arrays, numbers, strings and nested lists/tuples/dicts of them."""
    h = hashlib.sha256()

    def feed(obj: Any) -> None:
        if hasattr(obj, "detach"):  # a torch tensor
            obj = obj.detach().cpu().contiguous()
            h.update(f"{tuple(obj.shape)}{obj.dtype}".encode())
            h.update(obj.view(-1).view(__import__("torch").uint8).numpy().tobytes())
        elif hasattr(obj, "tobytes"):
            h.update(f"{obj.shape}{obj.dtype}".encode() + obj.tobytes())
        elif isinstance(obj, dict):
            for key in sorted(obj):
                feed(key)
                feed(obj[key])
        elif isinstance(obj, (list, tuple)):
            h.update(f"[{len(obj)}".encode())
            for item in obj:
                feed(item)
        else:
            h.update(repr(obj).encode())

    for obj in objs:
        feed(obj)
    return h.hexdigest()[:16]


def parser(doc: str, *, reps: int = 5, warmup: int = 1, sides: Sequence[str] = ()) -> argparse.ArgumentParser:
    """An argument parser with the shared flags; ``sides`` are the values the hidden ``--worker`` accepts."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=reps, help="repetitions (>= 5 for timings)")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps or calls before the timed ones")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--no-write", action="store_true", help="print the result instead of writing the JSON")
    p.add_argument(
        "--tag", default="", help="write results/<name>-<tag>.json (e.g. another model) beside the default"
    )
    if sides:
        p.add_argument("--worker", choices=list(sides), help=argparse.SUPPRESS)
    return p


def set_threads(threads: int) -> None:
    """One torch thread by default: on a small shared machine OpenMP threads that compete with other jobs for
    the cores spin-wait on each other and single steps take several times longer at random."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def worker_main(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict[str, Any]]) -> int:
    """Run one side in this (fresh) process and print its result as the last stdout line."""
    set_threads(args.threads)
    print(json.dumps(run(args)))
    return 0


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The parent's command line as a worker's: without ``--no-write``."""
    return [a for a in argv if a != "--no-write"]


def spawn(
    script: str, side: str, argv: Sequence[str], env: dict[str, str] | None = None, python: str | None = None
) -> dict[str, Any]:
    """``python script *argv --worker side`` in a fresh interpreter; the JSON of its last stdout line."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true", **(env or {})}
    command = [python or sys.executable, script, *argv, "--worker", side]
    proc = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} worker failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_workers(
    script: str,
    sides: Sequence[str],
    argv: Sequence[str],
    reps: int,
    *,
    env: dict[str, str] | None = None,
    python: dict[str, str] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Every side in a fresh process per repetition, paired: repetition ``i`` runs all sides back to back, the
    order reversed every other repetition. ``python`` maps a side to another interpreter (another venv).

    Workers that return an ``"inputs"`` digest must all agree: the sides saw identical inputs, or this raises.
    """
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for rep in range(reps):
        for side in sides if rep % 2 == 0 else sides[::-1]:
            print(f"rep {rep + 1}/{reps}: {side} ...", file=sys.stderr, flush=True)
            runs[side].append(spawn(script, side, argv, env, (python or {}).get(side)))
    seen = {r["inputs"] for rs in runs.values() for r in rs if "inputs" in r}
    if len(seen) > 1:
        raise RuntimeError(f"the sides saw different inputs (digests {sorted(seen)})")
    return runs


def column(runs: list[dict[str, Any]], key: str) -> list[float]:
    """One number per repetition: ``key`` of every worker result (dots reach into nested dicts)."""
    out = []
    for r in runs:
        for part in key.split("."):
            r = r[part]
        out.append(float(r))
    return out


# ------------------------------------------------------------------------------------------ provenance


def machine_info() -> dict[str, Any]:
    """CPU model, usable cores, OS, Python, 1-minute load and the GPU, if torch sees one."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {
        "cpu_model": cpu,
        "cpu_cores": cores,
        "os": platform.platform(),
        "python": platform.python_version(),
    }
    info.update(load_avg_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None, gpu=None)
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Installed distribution versions (``None`` when missing), from metadata without importing."""
    versions: dict[str, str | None] = {}
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = None
            versions[name] = importlib.metadata.version(name)
    return versions


# ---------------------------------------------------------------------------------------------- results


def _check_stat(s: Any, where: str) -> None:
    if not isinstance(s, dict) or set(STAT_KEYS) - set(s):
        raise ValueError(f"{where} is not a stat(...) summary")


def validate(payload: dict[str, Any]) -> None:
    """Raise ValueError unless ``payload`` follows the result schema (``SCHEMA``)."""
    if payload.get("schema") != SCHEMA:
        raise ValueError(f"schema must be {SCHEMA}")
    rows = payload.get("summary")
    if not isinstance(rows, list) or not rows:
        raise ValueError("payload needs a non-empty 'summary' list of row(...) dicts")
    for r in rows:
        missing = set(ROW_KEYS) - set(r)
        if missing:
            raise ValueError(f"summary row {r.get('metric')!r} lacks {sorted(missing)}")
        _check_stat(r["ours_value"], "ours_value")
        _check_stat(r["peer_value"], "peer_value")
        if r["paired_ratio"] is not None:
            _check_stat(r["paired_ratio"], "paired_ratio")


def result(
    name: str,
    doc: str,
    summary: list[dict[str, Any]],
    *,
    config: dict[str, Any],
    checks: dict[str, Any] | None = None,
    passed: bool = True,
    details: dict[str, Any] | None = None,
    packages: Iterable[str] = ("torch", "transformers", "lightning"),
) -> dict[str, Any]:
    """The result payload: summary rows, config, checks, small details, provenance. ``doc`` (the script's
    docstring) says what is compared, what is matched and what is not."""
    return {
        "schema": SCHEMA,
        "benchmark": name,
        "description": doc.strip(),
        "summary": summary,
        "passed": bool(passed),
        "checks": checks or {},
        "config": config,
        "details": details or {},
        "versions": package_versions(packages),
        "machine": machine_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_result(payload: dict[str, Any], results_dir: Path = RESULTS_DIR, tag: str = "") -> Path:
    """Validate ``payload`` and write ``results_dir/<benchmark>[-<tag>].json``; returns the path."""
    validate(payload)
    text = json.dumps(payload, indent=1) + "\n"
    if len(text) > MAX_RESULT_BYTES:
        raise ValueError(
            f"result is {len(text)} bytes (> {MAX_RESULT_BYTES}): keep summaries, not every step"
        )
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{payload['benchmark']}{f'-{tag}' if tag else ''}.json"
    path.write_text(text)
    return path


def describe(r: dict[str, Any]) -> str:
    """One console line for a summary row."""
    o, p = r["ours_value"], r["peer_value"]
    return (
        f"{r['ours']} {o['median']:.4g} [{o['min']:.4g}, {o['max']:.4g}] vs {r['peer']} {p['median']:.4g} "
        f"[{p['min']:.4g}, {p['max']:.4g}]: ratio {r['ratio']:.3g} ({r['better']} is better) -> {verdict(r)}"
    )


def finish(payload: dict[str, Any], args: argparse.Namespace) -> int:
    """Print the rows and the checks, write the result (``--tag``) or print it (``--no-write``); exit status 1
    when a check failed."""
    for r in payload["summary"]:
        print(f"{r['metric']}: {describe(r)}")
    print(f"checks: {json.dumps(payload['checks'], default=str)[:2000]}")
    if args.no_write:
        validate(payload)
        print(json.dumps(payload, indent=1)[:20000])
    else:
        print(f"wrote {write_result(payload, tag=args.tag)}")
    return 0 if payload["passed"] else 1
