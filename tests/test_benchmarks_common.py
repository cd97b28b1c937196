"""``benchmarks/make_table.py`` rendering and README block rewriting, on temporary files only."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    """(``_common``, ``make_table``) imported the way the scripts see each other: from their directory."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    for name in ("_common", "make_table"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module("_common"), importlib.import_module("make_table")


def _write_results(common, results_dir: Path) -> None:
    rows = [
        common.summary_row("demo", "ours", "peer", "time, s", 0.5, 2.0, better="lower"),
        common.summary_row("demo", "ours|v2", "peer", "throughput, tok/s", 900.0, 1000.0, better="higher"),
    ]
    common.write_result("demo", {"benchmark": "demo", "summary": rows}, results_dir=results_dir)


def test_summary_row_and_write_result_validate(bench, tmp_path):
    common, _ = bench
    row = common.summary_row("b", "o", "p", "m", 1.0, 4.0, better="lower")
    assert row["ratio"] == 0.25 and set(row) == set(common.SUMMARY_KEYS)
    with pytest.raises(ValueError, match="better"):
        common.summary_row("b", "o", "p", "m", 1.0, 4.0, better="smaller")
    with pytest.raises(ValueError, match="summary"):
        common.write_result("x", {"summary": []}, results_dir=tmp_path)
    path = common.write_result("x", {"summary": [row]}, results_dir=tmp_path)
    assert json.loads(path.read_text())["summary"] == [row]


def test_render_and_rewrite_readme(bench, tmp_path):
    common, make_table = bench
    _write_results(common, tmp_path / "results")
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\nintro\n\n<!-- bench:start -->\nstale\n<!-- bench:end -->\n\noutro\n")

    assert make_table.main(["--results-dir", str(tmp_path / "results"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# Title\n\nintro\n\n<!-- bench:start -->\n| Benchmark |")
    assert text.endswith("<!-- bench:end -->\n\noutro\n")
    assert "stale" not in text
    lines = text.split("<!-- bench:start -->\n")[1].split("\n<!-- bench:end -->")[0].splitlines()
    assert len(lines) == 4  # header, separator, two rows
    assert lines[2] == "| demo | time, s | ours | peer | 0.5 | 2 | 0.25 ✓ | lower |"
    assert lines[3] == "| demo | throughput, tok/s | ours\\|v2 | peer | 900 | 1000 | 0.9 | higher |"

    # idempotent: a second run reproduces the same file
    make_table.main(["--results-dir", str(tmp_path / "results"), "--readme", str(readme)])
    assert readme.read_text() == text


def test_missing_readme_or_markers_fails_without_writing(bench, tmp_path, capsys):
    common, make_table = bench
    _write_results(common, tmp_path / "results")
    missing = tmp_path / "README.md"
    assert make_table.main(["--results-dir", str(tmp_path / "results"), "--readme", str(missing)]) == 1
    assert not missing.exists()
    out = capsys.readouterr()
    assert "| Benchmark |" in out.out and "does not exist" in out.err

    missing.write_text("# no markers here\n")
    assert make_table.main(["--results-dir", str(tmp_path / "results"), "--readme", str(missing)]) == 1
    assert missing.read_text() == "# no markers here\n"
    assert "bench:start" in capsys.readouterr().err


def test_step_recorder_times_steps_after_the_warmup(bench):
    common, _ = bench

    class Losses(common.StepRecorder):
        def __init__(self, warmup: int) -> None:
            super().__init__(warmup)
            self.recorded: list[int] = []
            self.warmed = 0

        def _record(self) -> None:
            self.recorded.append(len(self.intervals))

        def _warmup_end(self) -> None:
            self.warmed += 1

    recorder = Losses(warmup=2)
    recorder.before_fit()
    recorder.train_start()
    for _ in range(5):
        recorder.step_end()
    assert len(recorder.intervals) == 5 and len(recorder.timed) == 3
    assert recorder.recorded == [1, 2, 3, 4, 5] and recorder.warmed == 1
    memory = recorder.memory()
    assert memory["peak_rss_mib"] >= memory["baseline_rss_mib"] > 0


def test_summary_row_zero_over_zero_is_a_tie(bench):
    common, _ = bench
    assert common.summary_row("demo", "ours", "peer", "accuracy", 0.0, 0.0, better="higher")["ratio"] == 1.0
    assert common.summary_row("demo", "ours", "peer", "accuracy", 0.5, 0.0, better="higher")[
        "ratio"
    ] == float("inf")
