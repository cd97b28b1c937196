"""PreferenceDataModule on real sources: a bad record is reported where it sits in the file."""

from __future__ import annotations

import json

import pytest

from lightning_llm.datamodules import PreferenceDataModule
from lightning_llm.datamodules.sources import DataSourceError


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    ("column", "value", "state"),
    [
        ("rejected", None, "missing column 'rejected'"),
        ("chosen", 3, "column 'chosen' must hold a string, got int"),
    ],
)
def test_a_bad_record_names_its_file_and_line(tmp_path, tiny_backbone, column, value, state):
    records = [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no"} for i in range(12)]
    if value is None:
        del records[6][column]
    else:
        records[6][column] = value
    source = _write(tmp_path / "prefs.jsonl", records)
    data = PreferenceDataModule(task=None, source=str(source), tokenizer="tiny", num_val=4, batch_size=2)
    with pytest.raises(DataSourceError, match=rf"prefs\.jsonl, line 7: {state}"):
        data.setup("fit")


def test_renamed_columns_are_checked_under_their_names(tmp_path, tiny_backbone):
    records = [{"prompt": f"q{i}", "good": "yes", "bad": "no"} for i in range(6)]
    del records[2]["bad"]
    source = _write(tmp_path / "prefs.jsonl", records)
    data = PreferenceDataModule(
        task=None,
        source=str(source),
        tokenizer="tiny",
        num_val=2,
        chosen_column="good",
        rejected_column="bad",
    )
    with pytest.raises(DataSourceError, match=r"prefs\.jsonl, line 3: missing column 'bad'"):
        data.setup("fit")
    del records[2]
    data = PreferenceDataModule(
        task=None,
        source=str(_write(tmp_path / "ok.jsonl", records)),
        tokenizer="tiny",
        num_val=2,
        batch_size=2,
        chosen_column="good",
        rejected_column="bad",
    )
    data.setup("fit")
    assert len(data.train_items) == 3
