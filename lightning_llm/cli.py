"""``lightning-llm fit|validate|test|predict --config configs/X.yaml``.

A thin :class:`~lightning.pytorch.cli.LightningCLI` subclass: every constructor argument of every module and
DataModule is a typed flag (subclass mode for both, so ``--model CausalLMModule`` or a ``class_path`` in YAML
picks the method). The DataModule's tokenizer is linked to the model's backbone so they can never disagree.
"""

from __future__ import annotations

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

# Imported for their side effect: short class names (``CausalLMModule``) resolve in configs.
import lightning_llm.callbacks
import lightning_llm.datamodules
import lightning_llm.modules  # noqa: F401

__all__ = ["LightningLLMCLI", "main"]


class LightningLLMCLI(LightningCLI):
    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.init_args.model", "data.init_args.tokenizer")


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-llm`` command (and ``python -m lightning_llm``)."""
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
