"""Resolution of backbone names: aliases, local directories, hub ids, and fast, clear failures."""

import time

import pytest

from lightning_llm.backbones import BackboneNotFoundError, available_backbones, load_backbone, load_tokenizer


def _assert_helpful(message: str) -> None:
    assert "no such local directory" in message
    for alias in ("tiny", "tiny-moe", "smollm2-135m"):
        assert alias in message
    assert "hub id" in message


def test_known_aliases():
    assert {"tiny", "tiny-moe", "smollm2-135m"} <= set(available_backbones())


@pytest.mark.parametrize("name", ["nonexistent", "someone/nonexistent-model"])
def test_unknown_name_fails_fast_offline(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(BackboneNotFoundError) as error:
        load_backbone(name)
    assert time.perf_counter() - start < 3
    _assert_helpful(str(error.value))
    assert "offline" in str(error.value)


def test_unknown_name_fails_fast_when_the_hub_is_unreachable(monkeypatch):
    import huggingface_hub.constants

    for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    start = time.perf_counter()
    with pytest.raises(BackboneNotFoundError, match="unreachable") as error:
        load_tokenizer("nonexistent")
    assert time.perf_counter() - start < 5
    _assert_helpful(str(error.value))


@pytest.mark.parametrize("relative", ["./runs/modle", "runs/sft/modle"])
def test_mistyped_local_path_fails_fast(relative, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    with pytest.raises(BackboneNotFoundError) as error:
        load_backbone(relative)
    assert time.perf_counter() - start < 3
    _assert_helpful(str(error.value))


def test_absolute_missing_path_fails_fast(tmp_path):
    with pytest.raises(BackboneNotFoundError, match="no such local directory"):
        load_backbone(str(tmp_path / "does-not-exist"))
    assert issubclass(BackboneNotFoundError, FileNotFoundError)
