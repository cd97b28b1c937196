"""Shared fixtures. Runs before any test module imports triton, so the interpreter switch takes effect."""

from __future__ import annotations

import os

# Triton decides between compiled and interpreted kernels when `@triton.jit` runs, i.e. at import of the
# kernel module; it must be set before that. On a machine without CUDA the interpreter is the only way
# to execute the kernels, on CPU tensors.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread per test process: the README's test line runs one pytest-xdist worker per core,
    # and the behaviour tests' numbers (their docstrings) are measured at one thread, whatever the core count.
    torch.set_num_threads(1)
    # The same for the processes the tests start (notebook kernels, CLI subprocesses): two threads each beside
    # the other worker oversubscribe the cores, and small ops then wait on each other (seen: a tutorial 6x
    # slower).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Nothing in the suite may reach a model or dataset hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest

#: Where downloaded pretrained models are cached across test sessions and workers: the caller's
#: ``$LIGHTNING_LLM_HOME`` (CI sets one per run) or the default cache. Built models (tiny) never go there.
_PRETRAINED_HOME = os.environ.get("LIGHTNING_LLM_HOME", os.path.expanduser("~/.cache/lightning_llm"))


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Build the tiny backbone once per session into a fresh cache, never the user's."""
    if "LIGHTNING_LLM_TEST_HOME" in os.environ:  # reuse a warm cache when iterating locally
        os.environ["LIGHTNING_LLM_HOME"] = os.environ["LIGHTNING_LLM_TEST_HOME"]
    else:
        os.environ["LIGHTNING_LLM_HOME"] = str(tmp_path_factory.mktemp("lightning_llm_home"))


def _pretrained_directory(home: str, module, build) -> str:
    """``build()`` run against the shared pretrained cache, then linked (with the downloads) into ``home``."""
    from pathlib import Path

    os.environ["LIGHTNING_LLM_HOME"] = _PRETRAINED_HOME
    try:
        directory = build()
    finally:
        os.environ["LIGHTNING_LLM_HOME"] = home
    for name in (module.CACHE_KEY, "downloads"):
        link, target = Path(home) / name, Path(_PRETRAINED_HOME) / name
        if Path(home).resolve() != Path(_PRETRAINED_HOME).resolve() and not link.exists():
            link.symlink_to(target, target_is_directory=True)
    return str(directory)


@pytest.fixture(scope="session")
def smollm2_dir(_isolated_home) -> str:
    """The converted SmolLM2-135M-Instruct directory, fetched once into the shared pretrained cache.

    The session's isolated home gets links to it (and to the downloaded wheel), so ``load_backbone("smollm2-135m")``
    works inside tests without a second download; concurrent workers are serialised by the cache's file lock.
    """
    from lightning_llm.backbones import smollm2

    home = os.environ["LIGHTNING_LLM_HOME"]
    return _pretrained_directory(home, smollm2, lambda: smollm2.smollm2_directory(prefer_hub_cache=False))


@pytest.fixture(scope="session")
def gemma3_dir(_isolated_home) -> str:
    """The converted Gemma 3 270M directory, fetched once into the shared pretrained cache (as ``smollm2_dir``)."""
    from lightning_llm.backbones import gemma3

    return _pretrained_directory(os.environ["LIGHTNING_LLM_HOME"], gemma3, gemma3.gemma3_directory)


@pytest.fixture(scope="session")
def gemma3(gemma3_dir):
    """(model, tokenizer) of Gemma 3 270M in fp32, loaded once per session. Do not mutate the model."""
    from lightning_llm.backbones import load_backbone

    model, tokenizer = load_backbone(gemma3_dir)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(model, tokenizer) of SmolLM2-135M-Instruct in fp32, loaded once per session. Do not mutate the model."""
    from lightning_llm.backbones import load_backbone

    model, tokenizer = load_backbone(smollm2_dir)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def tiny_backbone(_isolated_home):
    """(model, tokenizer) of the embedded tiny backbone, built once per session. Do not mutate the model."""
    from lightning_llm.backbones import load_backbone

    return load_backbone("tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_backbone):
    return tiny_backbone[1]


@pytest.fixture(scope="session")
def quiet_trainer(tmp_path_factory: pytest.TempPathFactory):
    """Factory for a single-process CPU ``Trainer`` with no logger, progress bar, summary or validation.

    Session-scoped so module-scoped fixtures can train too; each Trainer gets its own root directory.
    """
    from lightning_llm.trainer import quiet_trainer

    def make(max_steps: int = -1, callbacks=(), **overrides):
        kwargs = dict(default_root_dir=tmp_path_factory.mktemp("trainer"), callbacks=list(callbacks))
        return quiet_trainer(max_steps, **{**kwargs, **overrides})

    return make


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from lightning_llm.kernels._dispatch import triton_available

    # Triton kernels run compiled on CUDA or interpreted on the CPU (TRITON_INTERPRET=1, set above).
    triton_runs = triton_available() and (_HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_triton = pytest.mark.skip(reason="needs triton with CUDA or TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip_gpu)
        if "triton" in item.keywords and not triton_runs:
            item.add_marker(skip_triton)
