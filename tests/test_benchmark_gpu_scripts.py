"""The prepared GPU scripts under ``benchmarks/gpu/`` run end to end on the CPU on tiny settings (plumbing only)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

GPU_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu"


def test_lt_tuning_gpu_script_plumbing_on_cpu(monkeypatch, tmp_path, tiny_backbone):
    monkeypatch.syspath_prepend(str(GPU_DIR))
    monkeypatch.delitem(sys.modules, "lt_tuning", raising=False)
    script = importlib.import_module("lt_tuning")
    out = tmp_path / "lt.json"
    argv = ["--model", "tiny", "--accelerator", "cpu", "--num-train", "8", "--num-eval", "4", "--batch-size", "8",
            "--out", str(out)]  # fmt: skip
    script.main(argv)
    result = json.loads(out.read_text())
    runs = {r["arm"]: r for r in result["runs"]}
    assert set(runs) == {"cot", "coconut", "lt_tuning"}
    # 1 + 2 + 2 epochs of one batch each; the curriculum's two rebuilds are recorded.
    assert {r["steps"] for r in runs.values()} == {5}
    assert [s["stage"] for s in runs["lt_tuning"]["curriculum"]] == [2, 3]
    assert runs["coconut"]["latent_steps"] == 3  # one latent per step, 4 operands -> 3 steps
    assert result["settings"]["operands"] == 4 and result["settings"]["thresholds"] == [0.3, 0.2]
    with pytest.raises(SystemExit, match="exists"):
        script.main(argv)
