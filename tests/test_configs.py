"""Every shipped YAML runs through the real CLI (``fast_dev_run``), as ``lightning-llm fit --config`` would."""

from pathlib import Path

import pytest

from lightning_llm.cli import main

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert CONFIGS


def _uses_real_model(config: Path) -> bool:
    return "model: smollm2-135m" in config.read_text()


@pytest.mark.parametrize(
    "config",
    [pytest.param(c, marks=pytest.mark.pretrained) if _uses_real_model(c) else c for c in CONFIGS],
    ids=lambda p: p.name,
)
def test_config_fast_dev_run(config, tmp_path, monkeypatch, tiny_backbone, request):
    if _uses_real_model(config):
        request.getfixturevalue("smollm2_dir")  # the shared, converted SmolLM2 (fetched once)
    monkeypatch.chdir(tmp_path)  # configs write relative run directories
    main(["fit", "--config", str(config), "--trainer.fast_dev_run=true"])


def test_cli_rejects_unknown_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = CONFIGS[0]
    with pytest.raises(SystemExit) as err:
        main(["fit", "--config", str(config), "--model.init_args.not_an_argument", "1"])
    assert err.value.code != 0
    assert "not_an_argument" in capsys.readouterr().err


def test_datamodule_takes_the_models_tokenizer(tmp_path, monkeypatch, tiny_backbone):
    """--model.init_args.model alone decides the tokenizer: the DataModule reads the fitted model's."""
    model, tokenizer = tiny_backbone
    save = tmp_path / "saved"
    model.save_pretrained(save)
    tokenizer.save_pretrained(save)
    monkeypatch.chdir(tmp_path)
    from lightning.pytorch import LightningDataModule, LightningModule

    from lightning_llm.cli import LightningLLMCLI

    cli = LightningLLMCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=["--config", str(CONFIGS[0]), "--model.init_args.model", str(save)],
    )
    assert cli.datamodule.hparams.tokenizer is None
    cli.trainer.strategy.connect(cli.model)
    cli.datamodule.trainer = cli.trainer
    assert cli.datamodule.tokenizer is cli.model.tokenizer
