"""Helpers shared by every benchmark script: provenance, timing, result files and the summary schema.

Each benchmark writes ``benchmarks/results/<name>.json`` via :func:`write_result`. Whatever else it holds,
the payload has a ``summary`` list of :class:`SummaryRow` (built with :func:`summary_row`), which
``make_table.py`` turns into the README table, so every benchmark is compared "ours vs peer" the same way.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, TypedDict

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class SummaryRow(TypedDict):
    """One "ours vs peer" comparison; ``ratio = ours_value / peer_value``, ``better`` says which way wins."""

    benchmark: str
    ours: str
    peer: str
    metric: str
    ours_value: float
    peer_value: float
    ratio: float
    better: Literal["lower", "higher"]


SUMMARY_KEYS = tuple(SummaryRow.__annotations__)


def summary_row(
    benchmark: str,
    ours: str,
    peer: str,
    metric: str,
    ours_value: float,
    peer_value: float,
    better: Literal["lower", "higher"],
) -> SummaryRow:
    """Build a :class:`SummaryRow`, computing the ratio so no script gets its direction wrong."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', got {better!r}")
    if peer_value:
        ratio = ours_value / peer_value
    else:  # 0 / 0 is a tie (e.g. both at zero accuracy), not an infinite win
        ratio = 1.0 if ours_value == 0 else float("inf")
    return SummaryRow(
        benchmark=benchmark,
        ours=ours,
        peer=peer,
        metric=metric,
        ours_value=float(ours_value),
        peer_value=float(peer_value),
        ratio=ratio,
        better=better,
    )


def _cpu_model() -> str:
    """CPU model name; ``platform.processor()`` is often empty or just the arch on Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """Where the numbers came from: CPU model, usable cores, OS, Python, load, and the GPU if torch sees one."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_cores": usable,
        "os": platform.platform(),
        "python": platform.python_version(),
        "gpu": None,
        # other jobs on a shared machine skew timings; the load at measurement time says how much to trust them
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Installed distribution versions (``None`` when missing), read from metadata without importing."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def time_repeated(
    fn: Callable[[], Any], reps: int = 5, warmup: int = 1, sync: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Seconds per call of ``fn``: ``{"median", "min", "all"}`` over ``reps`` timed calls after ``warmup``.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before starting and after each call so asynchronous
    device work is inside the measured interval.
    """
    if reps < 1:
        raise ValueError("reps must be >= 1")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return {"median": statistics.median(times), "min": min(times), "all": times}


def utc_now() -> str:
    """ISO-8601 UTC timestamp, second precision, for the ``date`` field of a result."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_result(name: str, payload: dict[str, Any], results_dir: Path = RESULTS_DIR) -> Path:
    """Write ``payload`` to ``results_dir/<name>.json`` after checking its ``summary`` rows; returns the path."""
    rows = payload.get("summary")
    if not isinstance(rows, list) or not rows:
        raise ValueError("payload needs a non-empty 'summary' list of summary_row(...) rows")
    for row in rows:
        missing = set(SUMMARY_KEYS) - set(row)
        if missing:
            raise ValueError(f"summary row {row} lacks {sorted(missing)}")
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


# ------------------------------------------------------------- process memory (CPU peak RSS)


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
    """Process RSS high-water mark: ``VmHWM`` on Linux (resettable), else ``ru_maxrss`` (KiB Linux, B macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss if sys.platform == "darwin" else max_rss * 1024


_MIB = 2**20


class StepRecorder:
    """Step-end timestamps and the memory baseline / high-water reset of one benchmark worker.

    Call :meth:`before_fit` once everything but the steps exists (model, optimizer, data), :meth:`train_start`
    right before the first step and :meth:`step_end` after each step. After ``warmup`` steps the kernel's RSS
    high-water mark is reset, so :meth:`memory` reports the worst resident memory of steady-state steps over
    the baseline. Subclasses record what else their steps produce (losses, completion lengths).
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.intervals: list[float] = []
        self.threads: list[int] = []
        self.last = 0.0
        self.baseline = 0
        self.rss_at_reset = 0
        self.hwm_reset = False

    def before_fit(self) -> None:
        import gc

        gc.collect()
        self.baseline = rss_bytes()

    def train_start(self) -> None:
        self.last = time.perf_counter()

    def step_end(self) -> None:
        import torch

        now = time.perf_counter()
        self.intervals.append(now - self.last)
        self.threads.append(torch.get_num_threads())
        self._record()
        if len(self.intervals) == self.warmup:
            self.rss_at_reset = rss_bytes()
            self.hwm_reset = reset_peak_rss()
            self._warmup_end()
        self.last = time.perf_counter()  # bookkeeping above is not charged to the next step

    def _record(self) -> None:
        """Per-step extras of a subclass (called inside :meth:`step_end`, not timed)."""

    def _warmup_end(self) -> None:
        """Called once, right after the high-water reset (e.g. to start a profiler)."""

    @property
    def timed(self) -> list[float]:
        """The step intervals after the warm-up."""
        return self.intervals[self.warmup :]

    def memory(self) -> dict[str, Any]:
        """Peak RSS increase over the baseline and the numbers it comes from, in MiB."""
        peak = peak_rss_bytes()
        return {
            "peak_mib": (peak - self.baseline) / _MIB,
            "baseline_rss_mib": self.baseline / _MIB,
            "rss_after_warmup_mib": self.rss_at_reset / _MIB,
            "step_mib": (peak - self.rss_at_reset) / _MIB,
            "peak_rss_mib": peak / _MIB,
            "peak_source": "VmHWM reset after warm-up"
            if self.hwm_reset
            else "ru_maxrss over the process lifetime",
        }


def spawn_worker(
    script: str, name: str, argv: list[str], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``python script *argv --worker name`` in a fresh interpreter and return the JSON of its last line.

    Each measured variant runs in its own process so imports, allocator state and RSS high-water marks
    cannot leak between them. ``env`` adds to the inherited environment (tokenizer threads are always off).
    """
    proc = subprocess.run(
        [sys.executable, script, *argv, "--worker", name],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} worker failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
