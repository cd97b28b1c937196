"""``experiment(name)``: a driver of ``experiments/`` imported fresh, as ``python experiments/<name>.py`` sees it;
``help_of(script)``: its ``--help``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


@pytest.fixture
def experiment(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    monkeypatch.syspath_prepend(str(EXPERIMENTS))

    def load(name: str) -> ModuleType:
        monkeypatch.delitem(sys.modules, name, raising=False)
        return importlib.import_module(name)

    return load


@pytest.fixture
def help_of(capsys: pytest.CaptureFixture[str]) -> Callable[[ModuleType], str]:
    """``help_of(script)``: what ``script --help`` prints, checking that it exits 0 with a usage line."""

    def run(script: ModuleType) -> str:
        with pytest.raises(SystemExit) as exit_info:
            script.main(["--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage:") and "--out" in out
        return out

    return run
