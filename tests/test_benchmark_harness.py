"""``benchmarks/_harness.py`` and ``benchmarks/make_table.py``: summaries, the noise-aware verdict, the result
schema, the README block, and one trivial two-sided benchmark run end to end through worker processes."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    """(``_harness``, ``make_table``) imported the way the scripts see each other: from their directory."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    for name in ("_harness", "make_table"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module("_harness"), importlib.import_module("make_table")


def test_stat_and_row(bench):
    h, _ = bench
    s = h.stat([3.0, 1.0, 2.0, 4.0, 5.0])
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["n"]) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    r = h.row("b", "m", "o", "p", [1.0, 2.0], [2.0, 4.0], "lower")
    assert r["ratio"] == 1.5 / 3.0 and r["paired_ratio"]["values"] == [0.5, 0.5]
    assert h.row("b", "m", "o", "p", [1.0, 2.0], [2.0], "lower")["paired_ratio"] is None
    assert h.row("b", "m", "o", "p", [0.0], [0.0], "higher")["ratio"] == 1.0  # 0 / 0 is a tie
    with pytest.raises(ValueError, match="better"):
        h.row("b", "m", "o", "p", [1.0], [2.0], "smaller")


@pytest.mark.parametrize(
    ("ours", "peer", "better", "expected"),
    [
        ([1.0, 1.1, 1.2], [2.0, 2.1, 2.2], "lower", "win"),  # ranges apart
        ([1.0, 1.5, 2.1], [2.0, 2.1, 2.2], "lower", "tie"),  # better median, inside the spread: no win
        ([2.41, 2.40, 2.42], [2.41, 2.42, 2.40], "lower", "tie"),  # "1 ✓" for 2.41 vs 2.41 is gone
        ([2.0, 2.1, 2.2], [1.0, 1.1, 1.2], "lower", "loss"),
        ([0.9, 0.95, 1.0], [0.5, 0.6, 0.7], "higher", "win"),
        ([0.5, 0.6, 0.7], [0.9, 0.95, 1.0], "higher", "loss"),
        ([0.0682], [0.0685], "lower", "single"),  # one run each: no spread, no claim
        # overlapping ranges, but 5 paired repetitions all favour ours
        ([1.0, 2.0, 3.0, 4.0, 5.0], [1.1, 2.1, 3.1, 4.1, 5.1], "lower", "win"),
        # the same with 3 pairs is not enough
        ([1.0, 2.0, 3.0], [1.1, 2.1, 3.1], "lower", "tie"),
    ],
)
def test_verdict_marks_a_win_only_outside_the_noise(bench, ours, peer, better, expected):
    h, _ = bench
    assert h.verdict(h.row("b", "m", "o", "p", ours, peer, better)) == expected


def test_verdict_against_an_exact_target(bench):
    h, _ = bench
    assert h.verdict(h.row("b", "m", "o", "p", [0.6, 0.7], [2.0], "lower", peer_exact=True)) == "win"
    assert h.verdict(h.row("b", "m", "o", "p", [0.6, 2.5], [2.0], "lower", peer_exact=True)) == "tie"


def _payload(h, rows=None):
    rows = rows or [
        h.row("demo", "time, s", "ours", "peer", [0.5, 0.6, 0.55], [2.0, 2.2, 2.1], "lower"),
        h.row("demo", "throughput, tok/s", "ours|v2", "peer", [900.0, 1100.0], [1000.0, 1050.0], "higher"),
    ]
    return h.result("demo", "A demo.", rows, config={"x": 1})


def test_write_result_validates_schema_and_size(bench, tmp_path):
    h, _ = bench
    path = h.write_result(_payload(h), results_dir=tmp_path)
    assert json.loads(path.read_text())["schema"] == h.SCHEMA
    with pytest.raises(ValueError, match="summary"):
        h.write_result({**_payload(h), "summary": []}, results_dir=tmp_path)
    broken = _payload(h)
    del broken["summary"][0]["paired_ratio"]
    with pytest.raises(ValueError, match="lacks"):
        h.write_result(broken, results_dir=tmp_path)
    big = _payload(h)
    big["details"] = {"every_step": list(range(20000))}
    with pytest.raises(ValueError, match="summaries"):
        h.write_result(big, results_dir=tmp_path)


def test_render_and_rewrite_readme(bench, tmp_path):
    h, make_table = bench
    h.write_result(_payload(h), results_dir=tmp_path / "results")
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\nintro\n\n<!-- bench:start -->\nstale\n<!-- bench:end -->\n\noutro\n")
    args = ["--results-dir", str(tmp_path / "results"), "--readme", str(readme)]
    assert make_table.main(args) == 0
    text = readme.read_text()
    assert text.startswith("# Title\n\nintro\n\n<!-- bench:start -->\n| Benchmark |")
    assert text.endswith("<!-- bench:end -->\n\noutro\n")
    lines = text.split("<!-- bench:start -->\n")[1].split("\n<!-- bench:end -->")[0].splitlines()
    assert len(lines) == 4  # header, separator, two rows
    assert lines[2] == (
        "| demo | time, s | ours | peer | 0.55 [0.5–0.6] (n=3) | 2.1 [2–2.2] (n=3) | 0.262 [0.25–0.273] | lower | ✓ |"
    )
    assert lines[3] == (
        "| demo | throughput, tok/s | ours\\|v2 | peer | 1000 [900–1100] (n=2) | 1025 [1000–1050] (n=2) "
        "| 0.976 [0.9–1.05] | higher | tie |"
    )
    make_table.main(args)  # idempotent
    assert readme.read_text() == text
    # A study's results file (no schema) is not a benchmark: skipped; a wrong schema still fails.
    (tmp_path / "results" / "study.json").write_text(json.dumps({"study": "x", "runs": []}))
    make_table.main(args)
    assert readme.read_text() == text
    (tmp_path / "results" / "old.json").write_text(json.dumps({"schema": 1, "summary": []}))
    with pytest.raises(ValueError, match=r"old\.json: schema must be"):
        make_table.main(args)


def test_missing_readme_or_markers_fails_without_writing(bench, tmp_path, capsys):
    h, make_table = bench
    h.write_result(_payload(h), results_dir=tmp_path / "results")
    missing = tmp_path / "README.md"
    assert make_table.main(["--results-dir", str(tmp_path / "results"), "--readme", str(missing)]) == 1
    assert not missing.exists()
    out = capsys.readouterr()
    assert "| Benchmark |" in out.out and "does not exist" in out.err
    missing.write_text("# no markers here\n")
    assert make_table.main(["--results-dir", str(tmp_path / "results"), "--readme", str(missing)]) == 1
    assert missing.read_text() == "# no markers here\n"
    assert "bench:start" in capsys.readouterr().err


def test_step_clock_times_steps_after_the_warmup(bench):
    h, _ = bench
    clock = h.StepClock(warmup=2)
    clock.before_fit()
    clock.train_start()
    for step in range(5):
        clock.step_end(loss=float(step))
    out = clock.result()
    assert len(clock.intervals) == 5 and out["steps"] == 3 and out["values"]["loss"] == [0, 1, 2, 3, 4]
    assert out["step_s_median"] >= 0 and out["peak_mib"] >= 0


TRIVIAL = '''
"""A trivial two-sided benchmark: sum a list in Python (ours) vs with a loop (peer)."""
import sys
import time

from _harness import column, digest, finish, parser, result, row, run_workers, worker_argv, worker_main

SIDES = ("ours", "peer")


def _worker(args):
    data = list(range(args.n)) if args.worker != "skew" else list(range(args.n + 1))
    start = time.perf_counter()
    total = sum(data) if args.worker == "ours" else sum(x for x in data)
    return {"time_s": time.perf_counter() - start, "total": total, "inputs": digest(data)}


def main(argv):
    p = parser(__doc__, sides=(*SIDES, "skew"))
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--results-dir")
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args, _worker)
    runs = run_workers(__file__, SIDES if args.n > 0 else ("ours", "skew"), worker_argv(argv), args.reps)
    summary = [row("trivial", "time, s", "sum", "generator sum", column(runs["ours"], "time_s"),
                   column(runs["peer"], "time_s"), "lower")]
    same = {r["total"] for rs in runs.values() for r in rs}
    payload = result("trivial", __doc__, summary, config=vars(args), checks={"same_total": len(same) == 1},
                     passed=len(same) == 1, packages=())
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


def test_trivial_two_sided_benchmark_end_to_end(bench, tmp_path, monkeypatch, capsys):
    """Paired worker processes, digests, summaries and the table, on a benchmark that runs in a second."""
    h, make_table = bench
    script = tmp_path / "trivial.py"
    script.write_text(textwrap.dedent(TRIVIAL))
    monkeypatch.setenv("PYTHONPATH", str(BENCH_DIR))
    monkeypatch.syspath_prepend(str(tmp_path))
    trivial = importlib.import_module("trivial")
    monkeypatch.setattr(h, "RESULTS_DIR", tmp_path / "results")
    assert trivial.main(["--reps", "5", "--threads", "0", "--no-write"]) == 0  # --threads 0: no torch
    out = capsys.readouterr().out
    assert '"same_total": true' in out and "time, s: sum" in out
    runs = h.run_workers(str(script), ("ours", "peer"), ["--n", "100", "--threads", "0"], reps=5)
    assert [len(runs[s]) for s in ("ours", "peer")] == [5, 5]
    payload = h.result(
        "trivial",
        "doc",
        [
            h.row(
                "trivial",
                "t",
                "a",
                "b",
                h.column(runs["ours"], "time_s"),
                h.column(runs["peer"], "time_s"),
                "lower",
            )
        ],
        config={},
    )
    h.write_result(payload, results_dir=tmp_path / "results")
    assert "| trivial | t | a | b |" in make_table.render_table(make_table.load_rows(tmp_path / "results"))
    with pytest.raises(RuntimeError, match="different inputs"):
        h.run_workers(str(script), ("ours", "skew"), ["--n", "100", "--threads", "0"], reps=1)


def test_grpo_vs_trl_settings_share_one_results_file(bench, tmp_path, monkeypatch):
    """A run of one setting replaces that setting's rows and keeps the other settings' rows and provenance."""
    h, make_table = bench
    monkeypatch.delitem(sys.modules, "grpo_vs_trl", raising=False)
    grpo = importlib.import_module("grpo_vs_trl")
    base = {"model": "tiny", "prompts": 4, "group_size": 8, "max_new_tokens": 32, "min_new_tokens": 0}
    lora = {**base, "model": "smollm2-135m", "prompts": 2, "lora_r": 16, "min_new_tokens": 16}
    assert grpo._unit(base) == "4 prompts x 8, 32 new tokens, tiny, fp32, cpu"  # the tiny rows' names
    assert grpo._unit(lora) == "2 prompts x 8, 32 new tokens (min 16), smollm2-135m + LoRA r=16, fp32, cpu"

    def payload(config: dict, value: float, passed: bool = True) -> dict:
        rows = [h.row("grpo_vs_trl", f"t ({grpo._unit(config)})", "a", "b", [value] * 5, [1.0] * 5, "lower")]
        return h.result("grpo_vs_trl", "doc", rows, config=config, passed=passed)

    path = tmp_path / "grpo_vs_trl.json"
    assert grpo._merge(payload(base, 0.5), path)["details"]["settings"].keys() == {grpo._unit(base)}
    h.write_result(payload(base, 0.5), results_dir=tmp_path)  # a file from before settings were recorded
    merged = grpo._merge(payload(lora, 2.0, passed=False), path)
    h.write_result(merged, results_dir=tmp_path)
    assert [r["metric"] for r in merged["summary"]] == [f"t ({grpo._unit(c)})" for c in (base, lora)]
    assert merged["details"]["settings"].keys() == {grpo._unit(base), grpo._unit(lora)}
    assert merged["passed"] is False and merged["config"] == lora
    again = grpo._merge(payload(lora, 0.25), path)  # the same setting again: its row replaced, not added
    assert [r["ours_value"]["median"] for r in again["summary"]] == [0.5, 0.25]
    assert again["passed"] is True and len(again["details"]["settings"]) == 2
    assert len(make_table.render_table(again["summary"]).splitlines()) == 4
