"""Render every ``benchmarks/results/*.json`` summary into the README's benchmark table.

Each value cell is the median over repetitions (or seeds) with its range ``[min–max]`` and count; the ratio
cell is ours / peer of the medians with the range of the paired per-repetition ratios. The last column is the
verdict of :func:`_harness.verdict`: ✓ only when ours wins outside the noise band (the two ranges do not
overlap, or every paired ratio is on the better side of 1), "tie" inside it, "peer" when the peer wins
outside it, and "single run" when a side was measured once (no spread, so no claim).

Rewrites only the block between ``<!-- bench:start -->`` and ``<!-- bench:end -->`` in the repository's
``README.md``. Without the file or the markers it prints the table and exits 1 instead of guessing where
the table belongs::

    python benchmarks/make_table.py [--results-dir DIR] [--readme PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from _harness import RESULTS_DIR, validate, verdict

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
DEFAULT_README = Path(__file__).resolve().parent.parent / "README.md"
HEADER = (
    "Benchmark",
    "Metric",
    "Ours",
    "Peer",
    "Ours value",
    "Peer value",
    "Ours / peer",
    "Better",
    "Verdict",
)
VERDICT = {"win": "✓", "loss": "peer", "tie": "tie", "single": "single run"}


def fmt(value: float) -> str:
    """Three significant digits without scientific notation for everyday magnitudes."""
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return f"{value:.2e}"


def fmt_stat(s: dict[str, Any]) -> str:
    """``median [min–max] (n=N)``; a single or exact value alone."""
    if s["n"] < 2 or s["min"] == s["max"]:
        return fmt(s["median"]) + ("" if s["exact"] or s["n"] < 2 else f" (n={s['n']})")
    return f"{fmt(s['median'])} [{fmt(s['min'])}–{fmt(s['max'])}] (n={s['n']})"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def load_rows(results_dir: Path) -> list[dict[str, Any]]:
    """All summary rows of all benchmark result files, sorted by file name; raises on a file off the schema.

    A file without a ``schema`` key is a study's results (``experiments/``, ``benchmarks/grpo_smollm2.py``):
    no ours-vs-peer rows, presented in the README's method lines instead, and skipped here."""
    rows: list[dict[str, Any]] = []
    for path in sorted(results_dir.glob("*.json")):
        payload = json.loads(path.read_text())
        if isinstance(payload, dict) and "schema" not in payload:
            continue
        try:
            validate(payload)
        except ValueError as err:
            raise ValueError(f"{path.name}: {err}") from err
        rows.extend(payload["summary"])
    return rows


def render_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of summary rows with spreads and the noise-aware verdict."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    for r in rows:
        ratio = fmt(r["ratio"])
        if r["paired_ratio"] is not None:
            ratio += f" [{fmt(r['paired_ratio']['min'])}–{fmt(r['paired_ratio']['max'])}]"
        cells = (
            r["benchmark"],
            r["metric"],
            r["ours"],
            r["peer"],
            fmt_stat(r["ours_value"]),
            fmt_stat(r["peer_value"]),
            ratio,
            r["better"],
            VERDICT[verdict(r)],
        )
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def replace_block(text: str, table: str) -> str:
    """``text`` with the content between the markers replaced by ``table``; ValueError without markers."""
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), flags=re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"no '{START}' ... '{END}' block")
    return pattern.sub(lambda _: f"{START}\n{table}\n{END}", text, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--readme", type=Path, default=DEFAULT_README)
    args = parser.parse_args(argv)

    table = render_table(load_rows(args.results_dir))
    if not args.readme.is_file():
        print(table)
        print(f"error: {args.readme} does not exist; not creating it (table printed above)", file=sys.stderr)
        return 1
    try:
        updated = replace_block(args.readme.read_text(), table)
    except ValueError as err:
        print(table)
        print(f"error: {args.readme}: {err}; add the markers where the table belongs", file=sys.stderr)
        return 1
    args.readme.write_text(updated)
    print(f"updated {args.readme} ({table.count(chr(10)) - 1} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
