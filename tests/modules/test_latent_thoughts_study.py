"""Plumbing of the LT-Tuning study (``lightning_llm.studies.latent_thoughts``) on the tiny backbone, and the
SmolLM2 tokenization of ``<thinking>`` in the study's data."""

import json

import lightning as L
import pytest
import torch

from lightning_llm.backbones import load_backbone
from lightning_llm.datamodules import ChatSFTDataModule
from lightning_llm.studies import latent_thoughts as study

TINY = dict(
    model="tiny",
    seed=0,
    num_train=16,
    num_eval=4,
    batch_size=8,
    ops="+",
    latent_steps=1,
    lora_r=4,
    lr=1e-2,
)


def test_study_writes_every_arm_at_equal_steps_and_refuses_to_overwrite(tmp_path, tiny_backbone):
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


@pytest.mark.parametrize("train_row", [True, False])
def test_only_the_thinking_row_of_the_embeddings_trains_under_lora(tiny_backbone, train_row):
    module, _, record = study.train_arm("lt_tuning", train_thinking_row=train_row, **TINY)
    assert record["steps"] == 6
    pretrained = load_backbone("tiny")[0].get_input_embeddings().weight
    trained = module.model.get_input_embeddings().weight.detach()
    others = torch.ones(trained.shape[0], dtype=torch.bool)
    others[module.thinking_id] = False
    torch.testing.assert_close(trained[others], pretrained[others], rtol=0, atol=0)
    if train_row:  # the row moved from its initial draw (recorded when the model was built)
        assert (trained[module.thinking_id] - module.initial_thinking_row).abs().max() > 1e-4
    assert module.model.get_input_embeddings().weight.requires_grad is train_row


def test_thinking_row_needs_zero_weight_decay(tiny_backbone):
    module = study._StudyModule("tiny", weight_decay=0.01, lora=study.LoRAConfig(r=4))
    with pytest.raises(ValueError, match="weight_decay=0"):
        module.configure_model()


@pytest.mark.pretrained
def test_smollm2_data_tokenizes_thinking_as_one_token(smollm2_dir):
    # The DataModule (tokenizer=None) takes the fitted module's tokenizer, which has <thinking> added.
    module = study._StudyModule(smollm2_dir, num_latents=2, alpha=1.0, weight_decay=0.0)
    data = ChatSFTDataModule(
        task="arithmetic",
        task_kwargs={"digits": 1, "operands": 3, "ops": "+", "latent_steps": 1},
        num_train=8,
        num_val=4,
        batch_size=4,
    )
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    trainer.strategy.connect(module)
    data.trainer = trainer
    data.setup("fit")
    assert data.tokenizer is module.tokenizer
    thinking = module.tokenizer.convert_tokens_to_ids("<thinking>")
    assert thinking == module.thinking_id == len(module.tokenizer) - 1
    for item in data.train_items:
        ids = item["input_ids"]
        assert int((ids == thinking).sum()) == 2  # one token per placeholder, two reasoning steps
        first = int((ids == thinking).nonzero()[0])
        assert ids[first + 1] == thinking  # adjacent, as written: "<thinking><thinking><answer>"
        assert module.tokenizer.decode(ids[first + 2 :]).startswith("<answer>")


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


def test_merge_combines_seeds_and_refuses_other_differences(tmp_path):
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
