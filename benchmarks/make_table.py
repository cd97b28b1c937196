"""Render every ``benchmarks/results/*.json`` summary into the README's benchmark table.

Rewrites only the block between ``<!-- bench:start -->`` and ``<!-- bench:end -->`` in the repository's
``README.md``. Without the file or the markers it prints the table and exits 1 instead of guessing where
the table belongs (the README is owned by whoever writes it)::

    python benchmarks/make_table.py [--results-dir DIR] [--readme PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, SUMMARY_KEYS

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
DEFAULT_README = Path(__file__).resolve().parent.parent / "README.md"
_HEADER = ("Benchmark", "Metric", "Ours", "Peer", "Ours value", "Peer value", "Ours / peer", "Better")


def _fmt(value: float) -> str:
    """Three significant digits without scientific notation for everyday magnitudes."""
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return f"{value:.2e}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def load_rows(results_dir: Path) -> list[dict[str, Any]]:
    """All summary rows of all result files, sorted by file name; raises on a malformed row."""
    rows: list[dict[str, Any]] = []
    for path in sorted(results_dir.glob("*.json")):
        for row in json.loads(path.read_text()).get("summary", []):
            missing = set(SUMMARY_KEYS) - set(row)
            if missing:
                raise ValueError(f"{path.name}: summary row lacks {sorted(missing)}")
            rows.append(row)
    return rows


def render_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of summary rows; the ratio cell gets ✓ when ours wins in the row's direction."""
    lines = ["| " + " | ".join(_HEADER) + " |", "|" + "|".join("---" for _ in _HEADER) + "|"]
    for row in rows:
        wins = row["ratio"] < 1 if row["better"] == "lower" else row["ratio"] > 1
        cells = (
            row["benchmark"],
            row["metric"],
            row["ours"],
            row["peer"],
            _fmt(row["ours_value"]),
            _fmt(row["peer_value"]),
            f"{_fmt(row['ratio'])}{' ✓' if wins else ''}",
            row["better"],
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
