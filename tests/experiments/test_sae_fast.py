"""``experiments/sae_fast.py`` end to end on the tiny backbone (plumbing): both modes per seed, paired ratios."""

from __future__ import annotations

import json

import pytest


def test_sae_study_trains_both_modes_per_seed(experiment, tmp_path, tiny_backbone, help_of):
    study = experiment("sae_fast")
    assert "--num-tokens" in help_of(study)
    out = tmp_path / "sae.json"
    argv = [
        "--model", "tiny", "--layer", "0", "--seeds", "0", "1", "--num-tokens", "1024", "--num-val", "4",
        "--num-delta", "2", "--max-length", "64", "--block-size", "64", "--expansion", "2", "--k", "4",
        "--steps", "3", "--batch-size", "64", "--dead-window-tokens", "128", "--out", str(out),
    ]  # fmt: skip
    study.main(argv)
    result = json.loads(out.read_text())
    assert [(r["mode"], r["seed"]) for r in result["runs"]] == [
        ("sequential", 0), ("block", 0), ("sequential", 1), ("block", 1)
    ]  # fmt: skip
    for run in result["runs"]:
        assert set(study.METRICS) <= set(run) and run["l0"] == pytest.approx(4.0)
    assert set(result["summary"]) == set(study.MODES)
    assert result["paired_ratios"]["mse_block_over_sequential"]["median"] > 0
    assert 0 < result["heldout_special_fraction"] < 1 and result["clean_nll"] > 0
    with pytest.raises(SystemExit, match="exists"):
        study.main(argv)
