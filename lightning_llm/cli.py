"""``lightning-llm fit|validate|test|predict --config configs/X.yaml``.

A thin :class:`~lightning.pytorch.cli.LightningCLI` subclass: every constructor argument of every module and
DataModule is a typed flag (subclass mode for both, so ``--model CausalLMModule`` or a ``class_path`` in YAML
picks the method). DataModules take the fitted model's tokenizer unless a config names one (and then refuse a
mismatch). ``lightning-llm fetch NAME`` prepares a backbone (e.g. ``smollm2-135m``) ahead of its first use.

Resuming (``--ckpt_path``): Lightning restores the model's hyper-parameters from the checkpoint over the config.
The output arguments (:attr:`LightningLLMCLI.resume_overridable`: ``save_dir``, ``overwrite``) keep the value of
the config and command line; any other model flag given on the command line with a value that differs from the
checkpoint's stops the run with a message naming it and both values, instead of being silently replaced (values
from config files, and a module's own run-time updates of its hyper-parameters, yield to the checkpoint).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

# Imported for their side effect: short class names (``CausalLMModule``) resolve in configs.
import lightning_llm.callbacks
import lightning_llm.datamodules
import lightning_llm.modules  # noqa: F401

__all__ = ["LightningLLMCLI", "main"]


class LightningLLMCLI(LightningCLI):
    """The library's CLI: Lightning's, in subclass mode for models and DataModules.

    On resume (``--ckpt_path``) a model flag of the command line set differently from the checkpoint's
    hyper-parameters is an error, except the output arguments of :attr:`resume_overridable`, which take the
    config's value.
    """

    #: Model arguments that say where (and whether over what) a run writes its export: on resume the config's and
    #: command line's value wins over the checkpoint's.
    resume_overridable: tuple[str, ...] = ("save_dir", "overwrite")

    @override
    def parse_arguments(self, parser: Any, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        # What the config and command line say, before the checkpoint's hyper-parameters are laid over it.
        self._given_model = copy.deepcopy(self.config[subcommand].get("model")) if subcommand else None
        argv = sys.argv[1:] if args is None else args
        self._model_flags = _model_flags(argv) if isinstance(argv, (list, tuple)) else set()

    @override
    def before_instantiate_classes(self) -> None:
        subcommand = self.config.get("subcommand")
        given = getattr(self, "_given_model", None)
        if given is None or not self.config[subcommand].get("ckpt_path"):
            return
        restored = self.config[subcommand].model
        if given == restored or not isinstance(given, Namespace) or not isinstance(restored, Namespace):
            return
        if given.get("class_path") != restored.get("class_path"):
            conflicts = [("--model", restored.get("class_path"), given.get("class_path"))]
        else:
            conflicts = []
            theirs, ours = restored.get("init_args") or Namespace(), given.get("init_args") or Namespace()
            for key in sorted(set(vars(ours)) | set(vars(theirs))):
                if ours.get(key) == theirs.get(key):
                    continue
                if key in self.resume_overridable:
                    theirs[key] = ours.get(key)
                elif key in self._model_flags:
                    conflicts.append((f"--model.init_args.{key}", theirs.get(key), ours.get(key)))
        if conflicts:
            listed = "; ".join(
                f"{flag}: checkpoint {old!r}, command line {new!r}" for flag, old, new in conflicts
            )
            self.parser.error(
                f"--ckpt_path {self.config[subcommand].ckpt_path} resumes with the checkpoint's model "
                f"hyper-parameters, and the command line sets different ones: {listed}. Drop the flag (or give "
                f"the checkpoint's value) to resume, or start a new run without --ckpt_path; on resume only "
                f"{', '.join(self.resume_overridable)} may change"
            )


def _model_flags(argv: list[str] | tuple[str, ...]) -> set[str]:
    """The model arguments named on a command line (``--model.init_args.lr 1`` or ``--model.lr=1``: ``lr``)."""
    names = set()
    for token in argv:
        if not isinstance(token, str) or not token.startswith("--model."):
            continue
        path = token[len("--model.") :].split("=", 1)[0].split(".")
        if path[0] == "init_args":
            path = path[1:]
        if path and path[0] not in ("class_path", "dict_kwargs"):
            names.add(path[0])
    return names


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
