"""What a run writes to ``save_dir``: never over a model it did not write."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from lightning_llm.cli import main

CONFIG = Path(__file__).parents[1] / "configs" / "sft_tiny.yaml"
SMALL_DATA = [
    "--data.init_args.num_train",
    "64",
    "--data.init_args.num_val",
    "8",
    "--trainer.callbacks",
    "[]",
]


def _cli(*args: str) -> None:
    """``lightning-llm fit`` on sft_tiny.yaml with small data, plus ``args``."""
    main(["fit", "--config", str(CONFIG), *SMALL_DATA, *args])


def _digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _trained_model(directory: Path, tiny_backbone) -> dict[str, str]:
    model, tokenizer = tiny_backbone
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return _digests(directory)


def test_fast_dev_run_never_overwrites_save_dir(tmp_path, monkeypatch, tiny_backbone, caplog):
    """A fast dev run on a config whose save_dir holds a trained model leaves it byte for byte, and says so."""
    monkeypatch.chdir(tmp_path)
    save_dir = tmp_path / "runs" / "sft_tiny" / "model"
    before = _trained_model(save_dir, tiny_backbone)
    with caplog.at_level(logging.INFO):
        main(["fit", "--config", str(CONFIG), "--trainer.fast_dev_run=true", *SMALL_DATA])
    assert _digests(save_dir) == before
    assert "fast_dev_run" in caplog.text and "runs/sft_tiny/model" in caplog.text


def test_fast_dev_run_never_overwrites_a_quantized_export(tmp_path, quiet_trainer, tiny_backbone, caplog):
    """TrellisQuantization(save_dir=...) under fast_dev_run quantises (at L = 8) but writes nothing."""
    from lightning_llm.callbacks import TrellisQuantization
    from lightning_llm.datamodules import ChatSFTDataModule
    from lightning_llm.modules import CausalLMModule

    save_dir = tmp_path / "quantized"
    before = _trained_model(save_dir, tiny_backbone)
    cb = TrellisQuantization("rtn", save_dir=save_dir)
    data = ChatSFTDataModule(task="arithmetic", num_train=4, num_val=0, batch_size=2)
    with caplog.at_level(logging.INFO):
        quiet_trainer(callbacks=[cb], fast_dev_run=True).fit(CausalLMModule(), datamodule=data)
    assert cb.quantized_layers
    assert _digests(save_dir) == before
    assert "fast_dev_run" in caplog.text and str(save_dir) in caplog.text


def _first_run(tmp_path: Path) -> Path:
    """A 1-step sft_tiny run (small data) in ``tmp_path``; returns its last checkpoint."""
    _cli("--trainer.max_steps", "1", "--trainer.val_check_interval", "1", "--trainer.limit_val_batches", "1")
    (ckpt,) = (tmp_path / "runs" / "sft_tiny").rglob("*.ckpt")
    return ckpt


def test_resume_takes_a_new_save_dir_from_the_command_line(tmp_path, monkeypatch, tiny_backbone):
    """--ckpt_path restores the checkpoint's hyper-parameters, but an output path given on the command line wins."""
    monkeypatch.chdir(tmp_path)
    ckpt = _first_run(tmp_path)
    first = _digests(tmp_path / "runs" / "sft_tiny" / "model")
    _cli("--trainer.max_steps", "2", "--ckpt_path", str(ckpt), "--model.init_args.save_dir", "runs/B/model")
    assert (tmp_path / "runs" / "B" / "model" / "model.safetensors").is_file()
    assert _digests(tmp_path / "runs" / "sft_tiny" / "model") == first


def test_resume_refuses_a_changed_hyperparameter(tmp_path, monkeypatch, tiny_backbone, capsys):
    """A model flag the checkpoint would silently override stops the run, naming the flag and both values."""
    monkeypatch.chdir(tmp_path)
    ckpt = _first_run(tmp_path)
    with pytest.raises(SystemExit) as err:
        _cli("--trainer.max_steps", "2", "--ckpt_path", str(ckpt), "--model.init_args.lr", "0.1")
    assert err.value.code != 0
    message = capsys.readouterr().err
    assert "--model.init_args.lr: checkpoint 0.005, command line 0.1" in message


def _fit(quiet_trainer, module, **kwargs):
    from lightning_llm.datamodules import ChatSFTDataModule

    data = ChatSFTDataModule(task="arithmetic", num_train=4, num_val=0, batch_size=2)
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = quiet_trainer(max_steps=kwargs.pop("max_steps", 1), **kwargs)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_export_refuses_a_model_another_run_wrote(tmp_path, quiet_trainer, tiny_backbone):
    """save_dir holding a model this run did not write: the fit stops before training, naming overwrite=True."""
    from lightning_llm.modules import CausalLMModule

    save_dir = tmp_path / "model"
    before = _trained_model(save_dir, tiny_backbone)
    module = CausalLMModule(save_dir=str(save_dir))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        _fit(quiet_trainer, module)
    assert _digests(save_dir) == before
    first = CausalLMModule(save_dir=str(tmp_path / "first"))
    _fit(quiet_trainer, first)
    with pytest.raises(FileExistsError, match="another run"):
        _fit(quiet_trainer, CausalLMModule(save_dir=str(tmp_path / "first")))


def test_export_overwrite_true_replaces_it(tmp_path, quiet_trainer, tiny_backbone):
    from lightning_llm.modules import CausalLMModule

    save_dir = tmp_path / "model"
    before = _trained_model(save_dir, tiny_backbone)
    _fit(quiet_trainer, CausalLMModule(save_dir=str(save_dir), overwrite=True))
    assert _digests(save_dir)["model.safetensors"] != before["model.safetensors"]


def test_export_a_resumed_run_replaces_its_own(tmp_path, quiet_trainer):
    """The run id travels in the checkpoint: the resumed run may rewrite the export it wrote before."""
    from lightning_llm.modules import CausalLMModule

    save_dir = tmp_path / "model"
    trainer = _fit(quiet_trainer, CausalLMModule(save_dir=str(save_dir)))
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    first = _digests(save_dir)
    _fit(quiet_trainer, CausalLMModule(save_dir=str(save_dir)), max_steps=2, ckpt_path=str(ckpt))
    assert _digests(save_dir)["model.safetensors"] != first["model.safetensors"]
    (tmp_path / "empty").mkdir()
    _fit(quiet_trainer, CausalLMModule(save_dir=str(tmp_path / "empty")))  # an empty directory is free
    assert (tmp_path / "empty" / "model.safetensors").is_file()


def test_quantized_export_refuses_another_runs_model(tmp_path, quiet_trainer, tiny_backbone):
    """TrellisQuantization(save_dir=...) follows the same rule, with its own ``overwrite`` argument."""
    from lightning_llm.callbacks import TrellisQuantization
    from lightning_llm.modules import CausalLMModule

    save_dir = tmp_path / "quantized"
    before = _trained_model(save_dir, tiny_backbone)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        _fit(quiet_trainer, CausalLMModule(), callbacks=[TrellisQuantization("rtn", save_dir=save_dir)])
    assert _digests(save_dir) == before
    cb = TrellisQuantization("rtn", save_dir=save_dir, overwrite=True)
    _fit(quiet_trainer, CausalLMModule(), callbacks=[cb])
    assert "quantization.json" in _digests(save_dir)
    with pytest.raises(FileExistsError, match="another run"):
        _fit(quiet_trainer, CausalLMModule(), callbacks=[TrellisQuantization("rtn", save_dir=save_dir)])
