"""``lightning-llm fit|validate|test|predict --config configs/X.yaml``.

A thin :class:`~lightning.pytorch.cli.LightningCLI` subclass: every constructor argument of every module and
DataModule is a typed flag (subclass mode for both, so ``--model CausalLMModule`` or a ``class_path`` in YAML
picks the method). DataModules take the fitted model's tokenizer unless a config names one (and then refuse a
mismatch). ``lightning-llm fetch NAME`` prepares a backbone (e.g. ``smollm2-135m``) ahead of its first use.
"""

from __future__ import annotations

import sys

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

# Imported for their side effect: short class names (``CausalLMModule``) resolve in configs.
import lightning_llm.callbacks
import lightning_llm.datamodules
import lightning_llm.modules  # noqa: F401

__all__ = ["LightningLLMCLI", "main"]


class LightningLLMCLI(LightningCLI):
    """The library's CLI: Lightning's, in subclass mode for models and DataModules."""


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-llm`` command (and ``python -m lightning_llm``)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["fetch"]:
        from lightning_llm.backbones.__main__ import main as backbones_main

        backbones_main(argv)
        return
    LightningLLMCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":  # pragma: no cover
    main()
