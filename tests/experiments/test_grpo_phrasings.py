"""The experiment drivers under ``experiments/`` run end to end on the tiny backbone (plumbing only)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _shrunk_main_job(tmp_path: Path) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "grpo_smollm2.yaml").read_text())
    config["trainer"].update({"max_steps": 2, "val_check_interval": 1})
    config["trainer"]["callbacks"][0]["init_args"].update({"num_examples": 2, "max_new_tokens": 4})
    config["model"]["init_args"].update({"model": "tiny", "group_size": 2, "max_new_tokens": 4})
    config["data"]["init_args"].update({"num_train": 16, "num_val": 4, "batch_size": 2})
    path = tmp_path / "main_job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_grpo_phrasings_records_counts_intervals_and_costs(monkeypatch, tmp_path, tiny_backbone):
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    monkeypatch.delitem(sys.modules, "grpo_phrasings", raising=False)
    script = importlib.import_module("grpo_phrasings")
    out, workdir = tmp_path / "result.json", tmp_path / "runs"
    argv = [
        "--seeds",
        "0",
        "1",
        "--workdir",
        str(workdir),
        "--out",
        str(out),
        "--config",
        str(_shrunk_main_job(tmp_path)),
    ]
    assert script.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["sizes"] == {"held_out": 2 * 2, "val": 4}
    assert set(result["runs"]) == {"0", "1"} and result["runs"]["0"]["steps"] == [1, 2]
    for name, condition in result["conditions"].items():
        before = condition["before"]
        assert (
            0 <= before["k"] <= before["n"]
            and before["wilson95"][0] <= before["accuracy"] <= before["wilson95"][1]
        )
        finals = condition["after_per_seed"].values()
        assert condition["gain_on_every_seed"] == all(
            f["wilson95"][0] > before["wilson95"][1] for f in finals
        )
        assert name in script.CONDITIONS
    assert all(run["peak_rss_mib"] > 0 and run["cpu_seconds"] > 0 for run in result["runs"].values())
    # finished runs are reused, and an existing result is never replaced
    with pytest.raises(SystemExit, match="exists"):
        script.main(argv)
    assert (workdir / "seed0" / "done").exists()
    table = script.readme_table(result)
    assert table.count("\n") == 1 + len(script.CONDITIONS) and "after, seed 1" in table
    readme = "intro\n<!-- main-job:start -->\nold\n<!-- main-job:end -->\noutro\n"
    assert (
        script.replace_block(readme, table)
        == f"intro\n<!-- main-job:start -->\n{table}\n<!-- main-job:end -->\noutro\n"
    )
    with pytest.raises(ValueError, match="exactly one"):
        script.replace_block("no markers", table)
