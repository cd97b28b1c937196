"""Build-once directories under ``$LIGHTNING_LLM_HOME``, verified on every use.

A cached directory is complete exactly when its ``manifest.json`` lists every file with its SHA-256 (the
manifest is written last). :func:`cached_directory` returns such a directory or builds it: beside the target in
a temporary directory that is renamed into place, under an exclusive file lock, so concurrent first users (DDP
ranks, test workers) build it once and never see a half-written one; a partial or corrupt cache is rebuilt,
never used. The backbones and the activation harvests share this mechanism.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST",
    "cached_directory",
    "file_lock",
    "lightning_llm_home",
    "sha256",
    "verify",
    "write_manifest",
]

MANIFEST = "manifest.json"


def lightning_llm_home() -> Path:
    """Cache root: ``$LIGHTNING_LLM_HOME`` or ``~/.cache/lightning_llm``."""
    return Path(os.environ.get("LIGHTNING_LLM_HOME", Path.home() / ".cache" / "lightning_llm")).expanduser()


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, record: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``manifest.json`` with ``record`` and the SHA-256 of every file of ``directory`` (call it last)."""
    files = {p.name: sha256(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {**record, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


#: Directories this process verified, with the (size, mtime) of each file when it did: a 0.5 GB checkpoint is
#: hashed once per process, not on every load, and any change to a file since then re-verifies it.
_VERIFIED: dict[Path, tuple[tuple[str, int, int], ...]] = {}


def verify(directory: Path) -> str | None:
    """None if every file the manifest lists is present with its digest, else what is wrong."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (missing or partially written cache)"
    try:
        files: dict[str, str] = json.loads(manifest_path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return f"unreadable manifest ({err})"
    if any(not (directory / name).is_file() for name in files):
        return f"missing file {next(name for name in files if not (directory / name).is_file())}"
    signature = tuple(
        (name, (stat := (directory / name).stat()).st_size, stat.st_mtime_ns) for name in (MANIFEST, *files)
    )
    if _VERIFIED.get(directory) == signature:
        return None
    for name, digest in files.items():
        if sha256(directory / name) != digest:
            _VERIFIED.pop(directory, None)
            return f"checksum mismatch for {name}"
    _VERIFIED[directory] = signature
    return None


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if needed) for the duration of the block.

    POSIX only (``fcntl``); elsewhere the block runs unlocked and the atomic rename alone keeps the cache whole.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_directory(
    target: Path,
    build: Callable[[Path], Mapping[str, Any]],
    *,
    what: str,
    check: Callable[[Path], str | None] = verify,
) -> Path:
    """``target`` if it passes ``check``, else build it first.

    ``build(staging)`` writes the files into an empty staging directory and returns the manifest record (e.g.
    the recipe); the manifest with every file's digest is then written and the staging directory renamed to
    ``target``. ``what`` names the cache in the warning shown when an existing one is rebuilt.
    """
    if check(target) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        problem = check(target)  # another process may have built it while this one waited
        if problem is None:
            return target
        if target.exists():
            warnings.warn(f"rebuilding the {what} cache at {target}: {problem}", stacklevel=3)
            shutil.rmtree(target, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".building-{target.name}-", dir=target.parent))
        try:
            record = build(staging)
            write_manifest(staging, record)
            staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary shared directory
            try:
                staging.rename(target)
            except OSError:
                if (
                    check(target) is not None
                ):  # a builder without the lock won the race; accept only a valid one
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target
