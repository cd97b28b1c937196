"""``experiments/quant_smollm2.py`` and ``quant_smollm2_ldlq.py`` end to end on the tiny backbone (plumbing)."""

from __future__ import annotations

import json

import pytest


def test_quant_study_scores_each_method_and_caches_encodings(experiment, tmp_path, tiny_backbone, help_of):
    study = experiment("quant_smollm2")
    assert "--quantized-dir" in help_of(study)
    out, cache = tmp_path / "quant.json", tmp_path / "encoded"
    argv = [
        "--model", "tiny", "--out", str(out), "--L", "4", "--methods", "fp32", "rtn", "proteus",
        "--seq-len", "64", "--max-windows", "2", "--calib-len", "64", "--quantized-dir", str(cache),
    ]  # fmt: skip
    study.main(argv)
    result = json.loads(out.read_text())
    assert result["complete"] and result["settings"]["scored_windows"] == 2
    assert set(result["methods"]) == {"fp32", "rtn", "proteus"}
    assert result["methods"]["fp32"]["kl_to_fp32"]["median"] == 0.0
    for method in ("rtn", "proteus"):
        record = result["methods"][method]
        assert record["kl_to_fp32"]["median"] > 0 and record["perplexity"]["median"] > 1
        assert 0 < record["relative_weight_error"]["median"] < 1
    assert (cache / "proteus_L4_seed0" / "times.json").exists()  # rtn is not cached
    with pytest.raises(SystemExit, match="exists"):
        study.main(argv)
    study.main([*argv, "--overwrite"])  # the cached encoding is reused: same bits, same scores
    again = json.loads(out.read_text())["methods"]["proteus"]
    assert again["perplexity"] == result["methods"]["proteus"]["perplexity"]
    assert again["encode_cpu_s"] == result["methods"]["proteus"]["encode_cpu_s"]


def test_ldlq_study_compares_the_roundings(experiment, tmp_path, tiny_backbone, help_of):
    study = experiment("quant_smollm2_ldlq")
    help_of(study)
    out = tmp_path / "ldlq.json"
    study.main(["--model", "tiny", "--L", "8", "--max-windows", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["methods"]) == {"fp32", "proteus-data-free", "proteus-ldlq"}
    ldlq = result["methods"]["proteus-ldlq"]
    assert 0 < ldlq["proxy_relative_median"] <= ldlq["proxy_relative_max"]
    with pytest.raises(SystemExit, match="exists"):
        study.main(["--model", "tiny", "--out", str(out)])
