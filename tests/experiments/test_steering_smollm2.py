"""``experiments/steering_smollm2.py`` end to end on the tiny backbone (plumbing), and merging concepts."""

from __future__ import annotations

import json

import pytest


def test_steering_study_runs_and_merges_concepts(experiment, tmp_path, tiny_backbone, help_of):
    study = experiment("steering_smollm2")
    assert "--merge" in help_of(study)
    small = [
        "--model", "tiny", "--seeds", "0", "1", "--layer", "0", "--pairs", "4", "--prompts", "2",
        "--crh-prompts", "10", "--multipliers", "0", "4", "--new-tokens", "3", "--lengths", "1", "4",
        "--penalties", "1", "0",
    ]  # fmt: skip
    parts = []
    for concept in ("ocean", "food"):
        parts.append(tmp_path / f"{concept}.json")
        study.main([*small, "--concepts", concept, "--out", str(parts[-1])])
    ocean = json.loads(parts[0].read_text())["concepts"]["ocean"]
    assert [row["multiplier"] for row in ocean["effect"]["rows"]] == [0.0, 4.0]
    assert len(ocean["effect"]["vector_cosine_between_seeds"]) == 1  # one pair of seeds
    assert len(ocean["crh"]["sin_theta"]) == 10 and set(ocean["crh"]["sweep"]) == {"p=1", "p=0"}
    out = tmp_path / "merged.json"
    study.main(["--merge", *map(str, parts), "--out", str(out)])
    merged = json.loads(out.read_text())
    assert list(merged["concepts"]) == ["ocean", "food"] and merged["processes"] == 2
    assert set(merged["pooled_steerability_vs_sin_theta"]) == {"p=1", "p=0"}
    with pytest.raises(SystemExit, match="share a concept"):
        study.main(["--merge", str(parts[0]), str(parts[0]), "--out", str(tmp_path / "twice.json")])
    with pytest.raises(SystemExit, match="exists"):
        study.main(["--merge", *map(str, parts), "--out", str(out)])
