"""Plumbing of the LT-Tuning study (``experiments/latent_thoughts.py``) on the tiny backbone, and merging seeds."""

import json

import pytest


@pytest.fixture
def study(experiment):
    return experiment("latent_thoughts")


def test_study_writes_every_arm_at_equal_steps_and_refuses_to_overwrite(
    study, tmp_path, tiny_backbone, help_of
):
    assert "--merge" in help_of(study)
    out = tmp_path / "lt.json"
    argv = [
        "--model", "tiny", "--num-train", "16", "--num-eval", "4", "--batch-size", "8", "--lora-r", "4",
        "--max-new-tokens", "20", "--out", str(out), "--partial", str(tmp_path / "partial.json"),
    ]  # fmt: skip
    study.main(argv)
    result = json.loads(out.read_text())
    runs = {r["arm"]: r for r in result["runs"]}
    assert set(runs) == set(study.ARMS) == set(result["summary_mean_over_seeds"])
    # Equal budget: 3 epochs of 16 / 8 = 2 steps for every arm, the curriculum's included.
    assert {r["steps"] for r in runs.values()} == {6} and result["steps_per_arm"] == 6
    assert [s["stage"] for s in runs["lt_tuning"]["curriculum"]] == [2, 3]
    assert runs["lt_tuning"]["final_alpha"] == 0.6 and runs["coconut"]["final_alpha"] == 1.0
    # Coconut forces its fixed count (1 per step x 2 steps); CoT never takes a latent step.
    assert runs["coconut"]["latent_steps"] == 2 and runs["cot"]["latent_steps"] == 0
    assert runs["coconut"]["latent_chains"] == 4  # every answer has a chain of 2 latents to measure
    assert 1.0 <= runs["coconut"]["latent_effective_rank"] <= 2.0
    for run in runs.values():
        assert 0.0 <= run["accuracy"] <= 1.0 and run["examples"]
    assert set(result["references"]) >= {"direct_zero_shot", "cot_zero_shot"}
    assert len(json.loads((tmp_path / "partial.json").read_text())["runs"]) == 3
    with pytest.raises(SystemExit, match="exists"):
        study.main(argv)


def _study_file(path, seeds, accuracies, **settings):
    runs = [
        {"arm": "lt_tuning", "seed": s, "steps": 6, "accuracy": a, "explicit_tokens": 10.0, "latent_steps": 0.0,
         "latent_cosine": None, "latent_effective_rank": None}
        for s, a in zip(seeds, accuracies, strict=True)
    ]  # fmt: skip
    body = {
        "settings": {"model": "tiny", "seeds": seeds, **settings},
        "runs": runs,
        "references": {"direct_zero_shot": 0.1},
        "total_cpu_seconds": 10.0,
        "total_wall_seconds": 20.0,
    }
    path.write_text(json.dumps(body))
    return path


def test_merge_combines_seeds_and_refuses_other_differences(study, tmp_path):
    a = _study_file(tmp_path / "a.json", [0], [0.5])
    b = _study_file(tmp_path / "b.json", [1, 2], [0.25, 1.0], thresholds=[0.3, 0.2])
    merged = study.merge([a, b])
    assert merged["settings"]["seeds"] == [0, 1, 2]
    assert merged["summary_mean_over_seeds"]["lt_tuning"]["accuracy"] == pytest.approx(1.75 / 3)
    assert merged["summary_range_over_seeds"]["lt_tuning"]["accuracy"] == [0.25, 1.0]
    assert merged["summary_mean_over_seeds"]["lt_tuning"]["latent_cosine"] is None  # no chain in any seed
    assert merged["total_cpu_seconds"] == 20.0 and merged["references"] == {"direct_zero_shot": 0.1}
    with pytest.raises(ValueError, match="repeat a seed"):
        study.merge([a, a])
    c = _study_file(tmp_path / "c.json", [3], [0.5], thresholds=[0.9, 0.8])
    with pytest.raises(ValueError, match=r"differ .* \['thresholds'\]"):
        study.merge([a, c])
    # A --partial file (settings and the runs so far) counts with the seeds and times of its runs.
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"settings": {"model": "tiny", "seeds": [5, 6]}, "runs": [
        {**json.loads(a.read_text())["runs"][0], "seed": 5, "train_cpu_seconds": 3.0, "eval_cpu_seconds": 1.0,
         "train_seconds": 6.0, "eval_seconds": 2.0}]}))  # fmt: skip
    with_partial = study.merge([a, partial])
    assert with_partial["settings"]["seeds"] == [0, 5] and with_partial["total_cpu_seconds"] == 14.0
    out = tmp_path / "merged.json"
    study.main(["--merge", str(a), str(b), "--out", str(out)])
    assert json.loads(out.read_text())["settings"]["seeds"] == [0, 1, 2]
