"""The base of the LightningModules that hold a Hugging Face causal LM: the model is built in ``configure_model``."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_llm.backbones import load_model, load_tokenizer, stop_token_ids
from lightning_llm.lm import (
    apply_lora_config,
    check_export,
    export_owner,
    logprob_path,
    mark_export,
    save_backbone,
    shard_fsdp2,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["BackboneModule"]


class BackboneModule(L.LightningModule):
    """A LightningModule around a causal LM named by ``hparams.model`` (an alias, a directory or a hub id).

    The tokenizer is loaded at construction (cheap, and DataModules take it from the module). The model is built
    in :meth:`configure_model`, which Lightning calls inside the strategy's initialisation contexts (so DDP,
    FSDP and meta-device initialisation work) and before ``load_from_checkpoint`` restores weights. Under
    ``ModelParallelStrategy`` the model is sharded with FSDP2 (one unit per decoder layer, the embeddings and head
    in the root unit). Used without a Trainer, reading :attr:`model` builds it on the spot.

    At the end of ``fit`` the module exports itself with :meth:`save_pretrained` to ``hparams.save_dir`` when one
    is set, on global rank zero; a ``fast_dev_run`` exports nothing (it says so in the log), so a smoke test of a
    config never replaces the model its real run wrote. The export carries a marker with the module's
    :attr:`run_id` (kept in checkpoints, so a resumed run is the same run). A ``save_dir`` that holds files
    another run wrote, or files with no marker, stops the fit at its start (before any training) unless
    ``hparams.overwrite``; should one appear there during the run, the export goes beside it
    (``save_dir-<run id>``, said in a warning) rather than be lost.

    Subclasses call ``save_hyperparameters`` (with ``model`` and, where they take them, ``dtype``,
    ``trust_remote_code``, ``lora`` and ``gradient_checkpointing``), then :meth:`_init_tokenizer`, and adapt the
    built model in :meth:`prepare_model`.
    """

    tokenizer: PreTrainedTokenizerBase

    def _init_tokenizer(self) -> None:
        self.tokenizer = load_tokenizer(
            self.hparams.model, trust_remote_code=self.hparams.get("trust_remote_code", False)
        )

    @property
    def model(self) -> PreTrainedModel:
        """The causal LM (built by :meth:`configure_model` on first use)."""
        if "model" not in self._modules:
            self.configure_model()
        return self._modules["model"]

    @property
    def stop_token_ids(self) -> list[int]:
        """The model's stop set (:func:`~lightning_llm.backbones.stop_token_ids`): the tokenizer's eos, every id
        of the generation config's ``eos_token_id`` and the chat template's end of turn. Rollouts, ``generate``
        and completion masks end a completion at the first of them."""
        if getattr(self, "_stop_token_ids", None) is None:
            self._stop_token_ids = stop_token_ids(self.tokenizer, self.model)
        return self._stop_token_ids

    @property
    def model_built(self) -> bool:
        """Whether :meth:`configure_model` has run."""
        return "model" in self._modules

    @override
    def configure_model(self) -> None:
        if self.model_built:
            return
        hp = self.hparams
        model = load_model(
            hp.model, dtype=hp.get("dtype"), trust_remote_code=hp.get("trust_remote_code", False)
        )
        if len(self.tokenizer) > model.get_input_embeddings().weight.shape[0]:  # tokens added at construction
            model.resize_token_embeddings(len(self.tokenizer), mean_resizing=True)
        if model.generation_config.pad_token_id is None:
            model.generation_config.pad_token_id = self.tokenizer.pad_token_id
        self.model = self.prepare_model(model)
        mesh = self.device_mesh
        if mesh is not None:  # ModelParallelStrategy: FSDP2 over its data-parallel dimension
            shard_fsdp2(
                self.model, mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
            )

    def prepare_model(self, model: PreTrainedModel) -> PreTrainedModel:
        """Adapt the freshly loaded model before it is attached: the default makes it a trainable policy (its
        log-prob path chosen: fused, or the plain path with a notice for a model that post-processes its logits;
        LoRA applied when ``hparams.lora`` is set, train mode, optional gradient checkpointing)."""
        logprob_path(model, announce=True)
        self.hparams["lora"] = apply_lora_config(model, self.hparams.get("lora"))
        model.train()  # from_pretrained returns eval mode; Lightning keeps submodules' modes as found
        if self.hparams.get("gradient_checkpointing"):
            # transformers 5 renamed the method (and its kwargs); 4.x only has the old name.
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        return model

    @override
    def setup(self, stage: str) -> None:
        _refuse_rl_callbacks(self)

    @property
    def run_id(self) -> str:
        """The id of this training run (random at construction; restored from a checkpoint on resume)."""
        if getattr(self, "_run_id", None) is None:
            self._run_id = uuid.uuid4().hex
        return self._run_id

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["lightning_llm_run_id"] = self.run_id

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if checkpoint.get("lightning_llm_run_id"):
            self._run_id = str(checkpoint["lightning_llm_run_id"])

    @override
    def on_fit_start(self) -> None:
        self._run_id = self.trainer.strategy.broadcast(self.run_id, src=0)  # every rank: rank zero's
        directory = self.hparams.get("save_dir")
        if directory and not self.trainer.fast_dev_run:
            check_export(
                directory,
                self.run_id,
                overwrite=bool(self.hparams.get("overwrite")),
                writer=type(self).__name__,
            )

    @override
    def on_fit_end(self) -> None:
        directory = self.hparams.get("save_dir")
        if not directory:
            return
        if self.trainer.fast_dev_run:
            rank_zero_info(
                f"{type(self).__name__}: fast_dev_run writes no export; save_dir={directory} is left as it is"
            )
            return
        if not self.trainer.is_global_zero:
            return
        owner = export_owner(directory)
        if not self.hparams.get("overwrite") and owner is not None and owner != self.run_id:
            beside = f"{str(directory).rstrip('/')}-{self.run_id[:8]}"
            rank_zero_warn(
                f"{type(self).__name__}: save_dir={directory} was filled by another writer during this run; "
                f"the export goes to {beside} instead"
            )
            directory = beside
        self.save_pretrained(directory)
        mark_export(directory, self.run_id, type(self).__name__)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write model (safetensors) and tokenizer so that ``load_backbone(directory)`` reloads them."""
        return save_backbone(self.model, self.tokenizer, directory)


def _refuse_rl_callbacks(module: L.LightningModule) -> None:
    """An RL callback on a module that runs no RL loop would never be called: refuse it (GRPOModule overrides)."""
    from lightning_llm.rl import RLCallback

    ignored = [type(cb).__name__ for cb in module.trainer.callbacks if isinstance(cb, RLCallback)]
    if ignored:
        raise ValueError(
            f"{type(module).__name__} runs no RL loop, so the RL callback(s) {ignored} would never be called; "
            "use them with GRPOModule"
        )
