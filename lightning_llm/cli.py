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

Configuration errors (an unknown flag, a bad value, a class path that does not resolve, a constructor that refuses
its arguments) end the command with one ``error:`` line naming the flag or class and the reason, exit status 2.
``LIGHTNING_LLM_DEBUG=1`` shows everything instead: the usage, jsonargparse's whole report and the traceback.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import shlex
import sys
import warnings
from typing import Any, NoReturn

from jsonargparse import ArgumentError, Namespace
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

# Imported for their side effect: short class names (``CausalLMModule``) resolve in configs.
import lightning_llm.callbacks
import lightning_llm.datamodules
import lightning_llm.modules  # noqa: F401
from lightning_llm.callbacks import InterruptCheckpoint
from lightning_llm.trainer import StepProgressBar

__all__ = ["DEBUG_ENV", "LightningLLMCLI", "checkpoint_problem", "condense_error", "main"]

#: Set to ``1`` to see configuration errors in full (usage, jsonargparse's report, traceback).
DEBUG_ENV = "LIGHTNING_LLM_DEBUG"


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


#: Lines of jsonargparse's nested union reports that repeat the structure rather than say what is wrong.
_NOISE = re.compile(
    r"^(Does not validate against any of the Union subtypes|Subtypes: .*|Errors:|Given value( type)?: .*|"
    r"Expected a <class 'NoneType'>|Expected a path but .* either not accessible or invalid|"
    r"Not a valid subclass of .*|Subclass types expect one of:|a class path \(str\)|a dict with(out)? .*)$"
)


def condense_error(message: str) -> str:
    """jsonargparse's error report in one line: the flag (``--model.init_args.lr``), the class it belongs to, and
    the reasons; the report as it is when nothing is left of it."""
    flag: list[str] = []  # parser keys; "init_args" after the top-level class (--model.init_args.lr)
    classes: list[str] = []
    reasons: list[str] = []
    for raw in message.splitlines():
        line = raw.strip().removeprefix("- ").strip()
        if not line or _NOISE.match(line):
            continue
        if key := re.fullmatch(r'Parser key "([^"]+)":', line):
            flag += ["init_args", key.group(1)] if len(classes) == 1 and len(flag) == 1 else [key.group(1)]
        elif cls := re.fullmatch(r"Problem with given class_path '([^']+)':", line):
            classes.append(cls.group(1))
        elif line not in reasons:
            reasons.append(line)
    if not reasons:
        return message
    where = ("--" + ".".join(flag)) if flag else ""
    if classes:
        where += f" ({classes[-1]})"
    return f"{where}: {'; '.join(reasons)}" if where else "; ".join(reasons)


class _ConfigParser(LightningArgumentParser):
    """Lightning's parser, reporting a configuration error in one line (in full under ``LIGHTNING_LLM_DEBUG=1``)."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        if _debug():  # the whole report, raised with its traceback and causes
            raise ArgumentError(None, message) from ex
        self._logger.error(message)
        prog = (getattr(ex, "subcommand_parser", None) or self).prog.replace(" [options]", "")
        sys.stderr.write(
            f"error: {condense_error(message)}\n"
            f"tip: `{prog} --help` lists the options; {DEBUG_ENV}=1 shows the full report and traceback\n"
        )
        self.exit(2)


class LightningLLMCLI(LightningCLI):
    """The library's CLI: Lightning's, in subclass mode for models and DataModules.

    On resume (``--ckpt_path``) a model flag of the command line set differently from the checkpoint's
    hyper-parameters is an error, except the output arguments of :attr:`resume_overridable`, which take the
    config's value.
    """

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        if self.parser_class is LightningArgumentParser:
            self.parser_class = _ConfigParser
        return super().init_parser(**kwargs)

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as error:
            if _debug():
                raise
            subcommand = self.config.get("subcommand")
            parser = self._subcommand_parsers.get(subcommand, self.parser) if subcommand else self.parser
            parser.error(_instantiation_message(error), error)

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
        # The step progress bar, unless the config turns the bar off or brings its own.
        given = config.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        if config.get("enable_progress_bar") is not False and not any(
            isinstance(cb, ProgressBar) for cb in [*given, *callbacks]
        ):
            callbacks = [*callbacks, StepProgressBar()]
        # Ctrl-C / SIGTERM save the last completed step and print how to resume, unless the config has its own.
        if self.config.get("subcommand") == "fit" and not any(
            isinstance(cb, InterruptCheckpoint) for cb in [*given, *callbacks]
        ):
            callbacks = [*callbacks, InterruptCheckpoint(resume_command=_resume_command(self._argv))]
        return super()._instantiate_trainer(config, callbacks)

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
        self._argv = list(argv) if isinstance(argv, (list, tuple)) else []
        self._model_flags = _model_flags(argv) if isinstance(argv, (list, tuple)) else set()
        # Before Lightning reads the checkpoint's hyper-parameters (a truncated file would end in the zip reader).
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        self._checkpoint_hparams: set[str] | None = None
        if ckpt_path:
            checkpoint, problem = _read_checkpoint(ckpt_path)
            if problem:
                self.parser.error(f"--ckpt_path {ckpt_path}: {problem}")
            self._checkpoint_hparams = set(checkpoint.get("hyper_parameters") or {})

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
            stored = self._checkpoint_hparams or set()
            for key in sorted(set(vars(ours)) | set(vars(theirs))):
                if ours.get(key) == theirs.get(key):
                    continue
                if key in self.resume_overridable or key not in stored:
                    # the export's place; or an argument the checkpoint does not hold (a module's
                    # save_hyperparameters(ignore=...): an environment, reward functions), which Lightning's
                    # restore resets to its default
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


def _instantiation_message(error: BaseException) -> str:
    """The class being built and the first cause of ``error`` (the constructor's own exception)."""
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    found = re.search(r"class_path='([^']+)'", str(error))
    return f"{found.group(1) + ': ' if found else ''}{type(root).__name__}: {root}"


def checkpoint_problem(path: str | os.PathLike[str]) -> str | None:
    """What makes ``path`` unusable as ``--ckpt_path`` (missing, unreadable, truncated, not a Lightning checkpoint,
    or one without a model state), or ``None``. Loads the file with ``torch.load(weights_only=True)`` on CPU."""
    return _read_checkpoint(path)[1]


def _read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, Any], None] | tuple[None, str]:
    """The checkpoint at ``path`` and no problem, or no checkpoint and what is wrong (see :func:`checkpoint_problem`)."""
    import torch

    if not os.path.exists(path):
        return None, "no such file"
    if os.path.isdir(path):
        return None, "is a directory, not a checkpoint file"
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # the zip reader's and unpickler's errors
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return (
            None,
            f"not a readable checkpoint (truncated or another format): {type(error).__name__}: {reason}",
        )
    if (
        not isinstance(checkpoint, dict)
        or "state_dict" not in checkpoint
        or "pytorch-lightning_version" not in checkpoint
    ):
        return None, "not a Lightning checkpoint (no 'state_dict' and 'pytorch-lightning_version' entries)"
    return checkpoint, None


def _resume_command(argv: list[str]) -> str:
    """``lightning-llm`` and ``argv`` quoted for a shell, without a ``--ckpt_path`` it already has."""
    kept: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--ckpt_path":
            skip = True
            continue
        if isinstance(token, str) and token.startswith("--ckpt_path="):
            continue
        kept.append(str(token))
    return shlex.join(["lightning-llm", *kept])


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


def run_cli(args: list[str] | None = None, **overrides: Any) -> LightningLLMCLI:
    """The ``lightning-llm`` command's CLI on ``args`` (any module and DataModule, by class path), run; returns it.

    ``overrides`` go to :class:`LightningLLMCLI` (e.g. ``trainer_defaults``)."""
    return LightningLLMCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        **overrides,
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-llm`` command (and ``python -m lightning_llm``)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["fetch"]:
        from lightning_llm.backbones.__main__ import main as backbones_main

        backbones_main(argv)
        return
    quiet_known_noise()
    run_cli(args)


#: Third-party messages with nothing for a user to act on: Lightning's product tips and tensorboard notice,
#: torchdata's and Lightning's internal deprecations.
_THIRD_PARTY_NOISE = (
    "💡 Tip:",
    "Starting from v1.9.0, `tensorboardX` has been removed",
    "'set_vital' is deprecated",
    "`isinstance(treespec, LeafSpec)` is deprecated",
)


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(_THIRD_PARTY_NOISE)


def quiet_known_noise() -> None:
    """Hide the messages of :data:`_THIRD_PARTY_NOISE` (warnings and log records); every other warning still shows."""
    for message in _THIRD_PARTY_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(message) + ".*")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_DropNoise())


if __name__ == "__main__":  # pragma: no cover
    main()
