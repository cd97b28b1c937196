"""A configuration error stops ``lightning-llm`` with one message; ``LIGHTNING_LLM_DEBUG=1`` shows everything."""

from __future__ import annotations

from pathlib import Path

import pytest
from jsonargparse import ArgumentError

from lightning_llm.cli import main

CONFIG = str(Path(__file__).parents[1] / "configs" / "sft_tiny.yaml")


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        (
            "--model.init_args.lr=-1",
            "lightning_llm.modules.CausalLMModule: ValueError: lr must be positive, got -1.0",
        ),
        ("--data.init_args.num_train=-5", "num_train must be >= 1, got -5"),
        (
            "--model.class_path=lightning_llm.modules.NoSuchModule",
            "--model (lightning_llm.modules.NoSuchModule): module 'lightning_llm.modules' has no attribute "
            "'NoSuchModule'",
        ),
        (
            "--model.init_args.lr=abc",
            "--model.init_args.lr (lightning_llm.modules.CausalLMModule): Expected a",
        ),
        (
            "--model.init_args.nope=1",
            "--model (lightning_llm.modules.CausalLMModule): Option 'nope' is not accepted",
        ),
        ("--trainer.max_stepz=3", "unrecognized arguments: --trainer.max_stepz=3"),
    ],
)
def test_a_configuration_error_is_one_message(flag, expected, tmp_path, monkeypatch, capsys, tiny_backbone):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_LLM_DEBUG", raising=False)
    with pytest.raises(SystemExit) as err:
        main(["fit", "--config", CONFIG, flag])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert expected in lines[0] and lines[0].startswith("error: ")
    assert len(lines) <= 2, lines  # the error, and one line of tips
    assert "LIGHTNING_LLM_DEBUG=1" in lines[-1]


def test_debug_shows_the_full_trace(tmp_path, monkeypatch, tiny_backbone):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIGHTNING_LLM_DEBUG", "1")
    with pytest.raises(ValueError, match="Does not validate") as err:
        main(["fit", "--config", CONFIG, "--model.init_args.lr=-1"])
    assert "lr must be positive" in str(err.value.__cause__)
    with pytest.raises(ArgumentError, match="Subtypes"):  # jsonargparse's whole report, raised with its trace
        main(["fit", "--config", CONFIG, "--model.init_args.lr=abc"])
