"""``experiments/zero_shot.py`` on the tiny backbone: the table's rows, ``--update`` and refusing to overwrite."""

from __future__ import annotations

import json

import pytest


def test_zero_shot_table_updates_rows_and_refuses_to_overwrite(experiment, tmp_path, tiny_backbone, help_of):
    study = experiment("zero_shot")
    assert "--update" in help_of(study)
    out = tmp_path / "zero_shot.json"
    argv = ["--model", "tiny", "--n", "2", "--seeds", "0", "1", "--out", str(out)]
    study.main([*argv, "--settings", "copy", "word_count"])
    result = json.loads(out.read_text())
    assert [row["setting"] for row in result["rows"]] == ["copy", "word_count"]
    for row in result["rows"]:
        assert len(row["per_seed"]) == 2 and row["min"] <= row["median"] <= row["max"]
        assert all(acc in (0.0, 0.5, 1.0) for acc in row["per_seed"])  # 2 prompts per seed
    with pytest.raises(SystemExit, match="exists"):
        study.main([*argv, "--settings", "copy"])
    study.main([*argv, "--settings", "latin_square", "copy", "--update"])
    assert [r["setting"] for r in json.loads(out.read_text())["rows"]] == [
        "copy",
        "word_count",
        "latin_square",
    ]
    with pytest.raises(SystemExit, match="unknown settings"):
        study.main([*argv, "--settings", "no such setting", "--update"])
    with pytest.raises(SystemExit, match="another model, n or seeds"):
        study.main([*argv[:3], "3", "--seeds", "0", "1", "--out", str(out), "--settings", "copy", "--update"])
