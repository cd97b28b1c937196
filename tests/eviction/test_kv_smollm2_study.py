"""The SmolLM2 KV study's scoring, interval and part merging (no model)."""

from __future__ import annotations

import json

import pytest

from lightning_llm.studies.kv_smollm2 import DEPTHS, first_number_score, main, merge, wilson_interval
from lightning_llm.types import Example


def test_first_number_score_reads_the_first_number_only():
    ex = Example(prompt="p", completion="<answer>0487</answer>", answer="0487")
    assert first_number_score("The code for sample is 0487.", ex) == 1.0
    assert first_number_score("0487", ex) == 1.0
    assert first_number_score("The code for sample is 048.", ex) == 0.0
    assert first_number_score("It is 12, not 0487", ex) == 0.0
    assert first_number_score("The code for sample is:", ex) == 0.0


def test_wilson_interval_matches_known_values():
    low, high = wilson_interval(81, 100)  # Wilson 95% for 81/100: [0.7222, 0.8749]
    assert low == pytest.approx(0.7222, abs=1e-4) and high == pytest.approx(0.8749, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        wilson_interval(0, 0)


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


def test_merge_pools_the_prompts_of_parts_of_one_task(tmp_path):
    a = _part(0, [1.0, 0.0, 1.0], [0.1, 0.1, 0.9])
    b = _part(1, [1.0, 1.0], [0.9, 0.5])
    merged = merge([a, b])
    (part,) = merged["accuracy"]
    row = part["rows"][0]
    assert part["n"] == 5 and part["seed"] == [0, 1] and merged["seeds"] == [0, 1]
    assert row["accuracy"] == pytest.approx(0.8) and row["wilson95"] == list(wilson_interval(4, 5))
    assert row["by_depth"]["0.1"]["accuracy"] == 0.5 and row["by_depth"]["0.9"]["n"] == 2
    assert set(row["by_depth"]) == {f"{d:g}" for d in DEPTHS} and row["by_depth"]["0.3"]["accuracy"] is None
    assert merged["cpu_seconds"] == 4.0 and part["prompt_tokens"]["max"] == 511
    with pytest.raises(ValueError, match="seed"):
        merge([a, a])
    paths = []
    for name, part_json in (("a", a), ("b", b)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(part_json))
    out = tmp_path / "out.json"
    main(["--out", str(out), "--merge", *map(str, paths)])
    assert json.loads(out.read_text())["accuracy"][0]["n"] == 5
    with pytest.raises(SystemExit, match="exists"):
        main(["--out", str(out), "--merge", *map(str, paths)])
