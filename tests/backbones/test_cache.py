"""The build-once cache: concurrent first users build one directory, a partial one is rebuilt."""

import multiprocessing
import time
from pathlib import Path

import pytest

from lightning_llm.backbones.cache import cached_directory, verify


def _slow_build(staging: Path, log: Path) -> dict:
    with log.open("a") as f:
        f.write("built\n")
    (staging / "weights.bin").write_bytes(b"x" * 1000)
    time.sleep(0.5)  # a second process arrives while the first is still building
    (staging / "config.json").write_text("{}")
    return {"recipe": "test"}


def _worker(target: str, log: str) -> None:
    cached_directory(Path(target), lambda staging: _slow_build(staging, Path(log)), what="test")


def test_concurrent_first_use_builds_once(tmp_path):
    target, log = tmp_path / "model", tmp_path / "builds.log"
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_worker, args=(str(target), str(log))) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
        assert worker.exitcode == 0
    assert log.read_text().count("built") == 1
    assert verify(target) is None
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "manifest.json", "weights.bin"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".building-")]  # no staging left behind


def test_partial_cache_is_rebuilt_and_a_failed_build_leaves_nothing(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "weights.bin").write_bytes(b"half")  # a crashed writer without the manifest
    with pytest.warns(UserWarning, match="no manifest"):
        cached_directory(target, lambda staging: _slow_build(staging, tmp_path / "log"), what="test")
    assert verify(target) is None

    def broken(staging: Path) -> dict:
        (staging / "weights.bin").write_bytes(b"x")
        raise RuntimeError("download interrupted")

    other = tmp_path / "other"
    with pytest.raises(RuntimeError, match="interrupted"):
        cached_directory(other, broken, what="test")
    assert not other.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".building-")]
