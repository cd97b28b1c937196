"""``experiments/kv_smollm2.py``: part merging, and both parts end to end on the tiny backbone (plumbing)."""

from __future__ import annotations

import json

import pytest

from lightning_llm.datamodules.needle import DEPTHS
from lightning_llm.metrics import wilson_interval


@pytest.fixture
def study(experiment):
    return experiment("kv_smollm2")


def _part(seed, correct, depths, task="needle"):
    row = {"arm": "full", "policy": "full", "ratio": None, "per_prompt_correct": correct, "cpu_seconds": 1.0}
    row.update(peak_cache_bytes=10 * seed + 1, mean_budget_fraction=None)
    return {
        "model": "m",
        "settings": {"seed": seed},
        "command": "c",
        "seeds": [seed],
        "cpu_seconds": 2.0,
        "accuracy": [
            {
                "task": task,
                "n": len(correct),
                "seed": seed,
                "prefill_cpu_seconds": 0.5,
                "per_prompt_depth": depths,
                "prompt_tokens": {"mean": 500.0 + seed, "min": 490, "max": 510 + seed},
                "rows": [row],
            }
        ],
    }


def test_merge_pools_the_prompts_of_parts_of_one_task(study, tmp_path):
    a = _part(0, [1.0, 0.0, 1.0], [0.1, 0.1, 0.9])
    b = _part(1, [1.0, 1.0], [0.9, 0.5])
    merged = study.merge([a, b])
    (part,) = merged["accuracy"]
    row = part["rows"][0]
    assert part["n"] == 5 and part["seed"] == [0, 1] and merged["seeds"] == [0, 1]
    assert row["accuracy"] == pytest.approx(0.8) and row["wilson95"] == list(wilson_interval(4, 5))
    assert row["by_depth"]["0.1"]["accuracy"] == 0.5 and row["by_depth"]["0.9"]["n"] == 2
    assert set(row["by_depth"]) == {f"{d:g}" for d in DEPTHS} and row["by_depth"]["0.3"]["accuracy"] is None
    assert merged["cpu_seconds"] == 4.0 and part["prompt_tokens"]["max"] == 511
    with pytest.raises(ValueError, match="seed"):
        study.merge([a, a])
    paths = []
    for name, part_json in (("a", a), ("b", b)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(part_json))
    out = tmp_path / "out.json"
    study.main(["--out", str(out), "--merge", *map(str, paths)])
    assert json.loads(out.read_text())["accuracy"][0]["n"] == 5
    with pytest.raises(SystemExit, match="exists"):
        study.main(["--out", str(out), "--merge", *map(str, paths)])


def test_accuracy_and_timing_run_on_the_tiny_backbone(study, tmp_path, tiny_backbone, help_of):
    assert "--merge" in help_of(study)
    out = tmp_path / "kv.json"
    study.main([
        "--model", "tiny", "--out", str(out), "--tasks", "needle", "--n", "5", "--words", "20",
        "--batch-size", "3", "--max-new-tokens", "2", "--lengths", "80",
    ])  # fmt: skip
    result = json.loads(out.read_text())
    (needle,) = result["accuracy"]
    assert needle["complete"] and needle["n"] == 5 and set(needle["per_prompt_depth"]) <= set(DEPTHS)
    assert [row["arm"] for row in needle["rows"]][:2] == ["full", "streaming_llm@0.1"]
    assert len(needle["rows"]) == 1 + len(study.POLICIES) * len(study.RATIOS)
    for row in needle["rows"]:
        assert len(row["per_prompt_correct"]) == 5 and set(row["by_depth"]) == {f"{d:g}" for d in DEPTHS}
    assert {row["policy"] for row in result["timing"]} == {"full", *study.POLICIES}
    assert json.loads(out.with_suffix(".partial.json").read_text())["accuracy"][0]["complete"]
