"""``benchmarks/quant.py`` runs end to end on small settings (its Gaussian and matmul parts; no file written)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def test_quant_benchmark_small(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    monkeypatch.delitem(sys.modules, "quant", raising=False)
    quant = importlib.import_module("quant")
    args = [
        "--parts",
        "gaussian",
        "matmul",
        "--L",
        "6",
        "--gauss-rows",
        "2",
        "--gauss-seeds",
        "0",
        "--matmul-L",
        "6",
    ]
    assert quant.main([*args, "--batches", "1", "3", "--reps", "1", "--no-write"]) == 0
    out = capsys.readouterr().out
    assert "Proteus 2-bit" in out and "time per 1024x1024 matmul, batch 3, s" in out
    assert '"matmul_correct": true' in out
