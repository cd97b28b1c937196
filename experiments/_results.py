"""What every experiment driver does with its results file: refuse to replace one, write it, read part files.

A driver imports this as ``from _results import ...`` (``python experiments/x.py`` puts ``experiments/`` first
on ``sys.path``; the tests prepend it).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_llm.text import finite_json


def refuse_existing(
    out: Path, overwrite: bool = False, hint: str = "pass --overwrite or choose another --out"
) -> None:
    """Stop (``SystemExit``) when ``out`` exists and may not be replaced."""
    if out.exists() and not overwrite:
        raise SystemExit(f"{out} exists; {hint}")


def write_results(out: Path, result: dict[str, Any], *, indent: int = 2, replace: bool = True) -> None:
    """``result`` as JSON in ``out`` (parents made, non-finite floats as ``null``, a final newline).

    ``replace=False`` opens with ``"x"``: a file created meanwhile (by a parallel run) is never overwritten.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w" if replace else "x") as handle:
        handle.write(json.dumps(finite_json(result), indent=indent, allow_nan=False) + "\n")


def read_parts(paths: Sequence[Path | str]) -> list[dict[str, Any]]:
    """The results files of runs made in separate processes, in the order given (to merge)."""
    if not paths:
        raise ValueError("nothing to merge")
    return [json.loads(Path(p).read_text()) for p in paths]


def host() -> dict[str, Any]:
    """The machine and library versions a result was measured with."""
    return {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
