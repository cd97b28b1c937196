"""Plumbing of the ScaLoRA study (``experiments/scalora.py``) on the tiny backbone."""

import json

import pytest
import torch

from lightning_llm.modules import CausalLMModule

TINY_ARGV = [
    "--model", "tiny", "--seeds", "0", "--steps", "4", "--batch-size", "4", "--num-val", "6", "--val-every", "3",
    "--lora-r", "2", "--lora-alpha", "4", "--lr", "2e-2", "--warmup-ratio", "0", "--restart-interval", "2",
    "--max-new-tokens", "6",
]  # fmt: skip


@pytest.fixture
def study(experiment):
    return experiment("scalora")


def test_study_writes_every_arm_and_refuses_to_overwrite(study, tmp_path, tiny_backbone, help_of):
    assert "--combine" in help_of(study)
    out, partial = tmp_path / "scalora.json", tmp_path / "partial.json"
    argv = [*TINY_ARGV, "--out", str(out), "--partial", str(partial)]
    study.main(argv)
    result = json.loads(out.read_text())
    runs = {r["arm"]: r for r in result["runs"]}
    assert set(runs) == set(study.ARMS) == set(result["summary"])
    for run in runs.values():
        assert run["steps"] == 4
        # Validation before training, every 3 steps and at the last step, on the same held-out set.
        assert [step for step, _ in run["val_loss"]] == [0, 3, 4]
        assert len(run["train_loss"]) == 4 and 0.0 <= run["accuracy"] <= 1.0
        assert run["update_rank"]["layers"] > 0
    # Every arm starts from the same backbone and held-out set.
    assert len({run["val_loss"][0][1] for run in runs.values()}) == 1
    # Plain LoRA's update s B A has rank <= r; two merged rank-2 increments exceed it.
    assert runs["lora"]["update_rank"]["numerical_rank_max"] <= 2
    assert runs["restart"]["restarts"] == 2 and runs["restart"]["update_rank"]["numerical_rank_max"] > 2
    assert sum(runs["scalora"]["scalora_rescales"].values()) > 0
    assert result["summary"]["lora"]["final_val_loss"]["median"] == runs["lora"]["final_val_loss"]
    difference = runs["scalora"]["final_val_loss"] - runs["lora"]["final_val_loss"]
    assert result["summary"]["scalora"]["final_val_loss_minus_lora"]["per_seed"] == [difference]
    assert "final_val_loss_minus_lora" not in result["summary"]["lora"]
    assert len(json.loads(partial.read_text())["runs"]) == 3
    with pytest.raises(SystemExit, match="exists"):
        study.main(argv)


def test_combine_merges_processes_and_refuses_mismatches(study, tmp_path):
    def part(seed, lr=1e-3):
        args = study.build_parser().parse_args(["--seeds", str(seed), "--lr", str(lr)])
        run = {
            "arm": "lora",
            "seed": seed,
            "final_val_loss": 1.0 + seed,
            "accuracy": 0.5,
            "update_rank": {"stable_rank_mean": 2.0, "numerical_rank_mean": 8.0},
            "train_cpu_seconds": 10.0,
            "eval_cpu_seconds": 1.0,
        }
        return {"settings": study._settings(args), "runs": [run]}  # a --partial file

    with pytest.raises(ValueError, match="complete result file"):
        study.combine([part(1), part(0)])
    complete = {**part(1), "study": "scalora", "threads": 1}
    merged = study.combine([part(0), complete])
    assert [r["seed"] for r in merged["runs"]] == [0, 1] and merged["settings"]["seeds"] == [0, 1]
    assert merged["summary"]["lora"]["final_val_loss"] == {
        "median": 1.5,
        "min": 1.0,
        "max": 2.0,
        "spread": 1.0,
    }
    assert merged["total_cpu_seconds"] == 22.0 and merged["processes"] == 2
    assert merged["study"] == "scalora" and merged["threads"] == 1
    with pytest.raises(ValueError, match="settings differ"):
        study.combine([complete, part(0, lr=2e-3)])
    with pytest.raises(ValueError, match="twice"):
        study.combine([complete, part(1)])


def test_validation_loss_is_the_token_mean_over_the_held_out_set(study, tiny_backbone):
    args = study.build_parser().parse_args(["--model", "tiny", "--steps", "2", "--num-val", "6"])
    module = CausalLMModule("tiny")
    module.configure_model()
    data = study.make_data(args)
    data.setup("fit")
    loss = study.validation_loss(module, data)
    # Reference: the model's own loss on one batch holding every held-out conversation.
    batch = data._collator()(list(data._val_data))
    with torch.no_grad():
        reference = module.model(**batch).loss
    assert loss == pytest.approx(float(reference), rel=1e-5)
