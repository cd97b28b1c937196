r"""LT-Tuning's three-stage curriculum (arXiv 2602.10229): explicit CoT → latents at α = 1 → fusion.

Stage 1 is ordinary SFT on explicit chain-of-thought data. At each stage change the training data is rebuilt
from those explicit items: the current model scores every response token teacher-forced, and a ``<thinking>``
token is inserted before each token whose confidence :math:`p_\theta(y_t \mid y_{<t})` is below the stage's
threshold τ (0.3 entering stage 2, 0.2 entering stage 3). The inserted ``<thinking>`` is a trained target, so the
model learns to ask for a latent step right before a hard token; at those positions
:class:`~lightning_llm.modules.LatentThoughtsModule` feeds the fused latent. Stage 2 trains with α = 1
(Coconut-like hidden-state feedback), stage 3 with the fusion α ≈ 0.55, T = 1, top-p 0.9.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_llm.backbones import eval_mode
from lightning_llm.datamodules.sources import IGNORE_INDEX, pad_sequences
from lightning_llm.lm import last_hidden_states

__all__ = ["LatentThoughtsCurriculum", "insert_thinking", "token_confidence"]


@torch.no_grad()
def token_confidence(
    model: torch.nn.Module, items: Sequence[dict[str, Tensor]], *, pad_id: int, batch_size: int = 32
) -> list[Tensor]:
    """Teacher-forced probability of every token of each item, ``[T]`` per item (NaN where not a label).

    Entry ``t`` is :math:`p_\\theta(y_t \\mid y_{<t})` for a trained position ``t`` (label ≠ −100, ``t > 0``).
    """
    device = next(model.parameters()).device
    head = model.get_output_embeddings().weight
    out: list[Tensor] = []
    with eval_mode(model):
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            ids = pad_sequences([item["input_ids"] for item in chunk], pad_id).to(device)
            mask = pad_sequences([torch.ones_like(item["input_ids"]) for item in chunk], 0).to(device)
            hidden = last_hidden_states(model, ids, mask)
            logprobs = (hidden[:, :-1] @ head.T).float().log_softmax(-1)
            picked = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1).exp()
            for row, item in enumerate(chunk):
                length = len(item["input_ids"])
                conf = torch.full((length,), float("nan"))
                conf[1:] = picked[row, : length - 1].cpu()
                conf[item["labels"] == IGNORE_INDEX] = float("nan")
                out.append(conf)
    return out


def insert_thinking(
    item: dict[str, Tensor],
    confidence: Tensor,
    *,
    threshold: float,
    thinking_id: int,
    skip: Sequence[int] = (),
) -> dict[str, Tensor]:
    """A copy of ``item`` with a trained ``<thinking>`` before every label token of confidence < ``threshold``.

    Tokens in ``skip`` (e.g. eos, whose position is fixed by the template) never get one. Existing
    ``<thinking>`` tokens are kept as they are.
    """
    ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
    new_ids: list[int] = []
    new_labels: list[int] = []
    for token, label, conf in zip(ids, labels, confidence.tolist(), strict=True):
        hard = label != IGNORE_INDEX and conf == conf and conf < threshold  # conf == conf: not NaN
        if hard and token not in skip and token != thinking_id:
            new_ids.append(thinking_id)
            new_labels.append(thinking_id)
        new_ids.append(token)
        new_labels.append(label)
    return {"input_ids": torch.tensor(new_ids), "labels": torch.tensor(new_labels)}


def _strip_thinking(item: dict[str, Tensor], thinking_id: int) -> dict[str, Tensor]:
    keep = item["input_ids"] != thinking_id
    return {"input_ids": item["input_ids"][keep], "labels": item["labels"][keep]}


class LatentThoughtsCurriculum(Callback):
    """Run LT-Tuning's stages by epoch and rebuild the data at each stage change.

    Stage 1 lasts ``stage_epochs[0]`` epochs, stage 2 ``stage_epochs[1]``, stage 3 the rest of training. The
    data is rebuilt at the end of a stage's last epoch so that the next epoch's loader serves it: the Trainer
    must reload dataloaders every epoch (``reload_dataloaders_every_n_epochs=1``; checked at fit start). Every
    rebuild starts from the explicit items (the DataModule's own, without ``<thinking>``), on token ids, so it
    does not depend on the DataModule's tokenizer knowing ``<thinking>``.

    The stage and the current rebuilt items live in the state dict: a resumed run continues in the same stage
    on the same data with the same fusion.

    Args:
        stage_epochs: Epochs of stage 1 (explicit CoT) and of stage 2 (α = 1).
        thresholds: Confidence thresholds τ for the rebuilds entering stage 2 and stage 3.
        alpha, temperature, top_p: The fusion of stage 3 (the paper's α ≈ 0.5–0.6, T = 1, top-p 0.9).
        batch_size: Items per forward when scoring confidence.
    """

    def __init__(
        self,
        stage_epochs: tuple[int, int] = (1, 1),
        thresholds: tuple[float, float] = (0.3, 0.2),
        alpha: float = 0.55,
        temperature: float = 1.0,
        top_p: float = 0.9,
        batch_size: int = 32,
    ) -> None:
        if len(stage_epochs) != 2 or min(stage_epochs) < 1:
            raise ValueError(f"stage_epochs must be two positive epoch counts, got {stage_epochs}")
        if len(thresholds) != 2 or not all(0.0 < t <= 1.0 for t in thresholds):
            raise ValueError(f"thresholds must be two confidences in (0, 1], got {thresholds}")
        from lightning_llm.modules.latent_thoughts import check_fusion

        check_fusion(alpha, temperature, top_p)
        self.stage_epochs = tuple(int(e) for e in stage_epochs)
        self.thresholds = tuple(float(t) for t in thresholds)
        self.alpha, self.temperature, self.top_p = float(alpha), float(temperature), float(top_p)
        self.batch_size = batch_size
        self.stage = 1
        self.inserted = 0
        self._items: list[dict[str, Tensor]] | None = None

    def stage_of_epoch(self, epoch: int) -> int:
        """The stage that epoch ``epoch`` (0-based) trains in."""
        first, second = self.stage_epochs
        return 1 if epoch < first else 2 if epoch < first + second else 3

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.reload_dataloaders_every_n_epochs != 1:
            raise ValueError(
                "LatentThoughtsCurriculum rebuilds the training data between epochs; set "
                "Trainer(reload_dataloaders_every_n_epochs=1) so the rebuilt data is used"
            )
        if not hasattr(pl_module, "thinking_id") or not hasattr(pl_module, "set_fusion"):
            raise TypeError("LatentThoughtsCurriculum needs a LatentThoughtsModule")
        data = trainer.datamodule
        if data is None or not hasattr(data, "replace_train_items"):
            raise TypeError(
                "LatentThoughtsCurriculum needs an SFT DataModule (ChatSFTDataModule or a subclass)"
            )
        if pl_module.hparams.get("num_latents") is not None:
            raise ValueError(
                "the curriculum trains dynamic latents; use LatentThoughtsModule(num_latents=None)"
            )
        if self._items is not None:  # resumed in stage 2 or 3
            data.replace_train_items(self._items)
        self._apply_fusion(pl_module)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log("curriculum/stage", float(self.stage), on_step=False, on_epoch=True, sync_dist=True)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        upcoming = self.stage_of_epoch(trainer.current_epoch + 1)
        if upcoming == self.stage:
            return
        data = trainer.datamodule
        explicit = [_strip_thinking(item, pl_module.thinking_id) for item in data.train_items]
        confidence = token_confidence(
            pl_module.model, explicit, pad_id=pl_module.tokenizer.pad_token_id, batch_size=self.batch_size
        )
        threshold = self.thresholds[upcoming - 2]
        skip = pl_module.stop_token_ids
        items = [
            insert_thinking(item, conf, threshold=threshold, thinking_id=pl_module.thinking_id, skip=skip)
            for item, conf in zip(explicit, confidence, strict=True)
        ]
        self.inserted = sum(
            len(new["input_ids"]) - len(old["input_ids"]) for new, old in zip(items, explicit, strict=True)
        )
        self._items = items
        self.stage = upcoming
        data.replace_train_items(items)
        self._apply_fusion(pl_module)
        rank_zero_info(
            f"LatentThoughtsCurriculum: stage {upcoming} from epoch {trainer.current_epoch + 1}: "
            f"{self.inserted} <thinking> tokens inserted (tau={threshold}) into {len(items)} items"
        )

    def _apply_fusion(self, pl_module: L.LightningModule) -> None:
        if self.stage == 2:
            pl_module.set_fusion(alpha=1.0)
        elif self.stage == 3:
            pl_module.set_fusion(alpha=self.alpha, temperature=self.temperature, top_p=self.top_p)

    @override
    def state_dict(self) -> dict[str, Any]:
        items = None
        if self._items is not None:
            # Plain lists: loadable with torch.load(weights_only=True).
            items = [{k: v.tolist() for k, v in item.items()} for item in self._items]
        return {"stage": self.stage, "inserted": self.inserted, "items": items}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stage = int(state_dict["stage"])
        self.inserted = int(state_dict.get("inserted", 0))
        items = state_dict.get("items")
        self._items = (
            None if items is None else [{k: torch.tensor(v) for k, v in item.items()} for item in items]
        )
