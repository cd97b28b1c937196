r"""LT-Tuning's three-stage curriculum (arXiv 2602.10229): explicit CoT → latents at α = 1 → fusion.

Stage 1 is ordinary SFT on explicit chain-of-thought data. At each stage change the training data is rebuilt
from those explicit items, as the authors' ``dataset.py`` (``ConfidenceThinkingStrategy``,
``ThinkingTokenStrategy.apply``) does: the current model scores every response token teacher-forced; the tokens
whose confidence :math:`p_\theta(y_t \mid y_{<t})` is below the stage's threshold τ (0.3 entering stage 2, 0.2
entering stage 3) are the candidate sites; at most ``max_sites`` of them (10, then 16) are kept, a random subset
when there are more; each kept site gets a ``<thinking>`` before its token with probability ``insertion_prob``
(0.85, then 0.95), and then a second one with probability ``second_prob`` (0.15, then 0.2). The inserted
``<thinking>`` is a trained target, so the model learns to ask for a latent step right before a hard token; at
those positions :class:`~lightning_llm.modules.LatentThoughtsModule` feeds the latent. Stage 2 trains with
α = 1 (the authors' ``hidden_state`` mode), stage 3 with the fusion α = 0.6, T = 1, top-p 0.9 (``soft_fusion``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_llm.backbones import eval_mode
from lightning_llm.datamodules.sources import pad_sequences
from lightning_llm.lm import last_hidden_states
from lightning_llm.types import IGNORE_INDEX

__all__ = ["LatentThoughtsCurriculum", "insert_thinking", "rebuild_with_thinking", "token_confidence"]


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
    max_sites: int | None = None,
    insertion_prob: float = 1.0,
    second_prob: float = 0.0,
    rng: random.Random | None = None,
) -> dict[str, Tensor]:
    """A copy of ``item`` with trained ``<thinking>`` tokens before label tokens of confidence < ``threshold``.

    The *sites* are the label tokens whose confidence is below ``threshold`` (NaN never is), except tokens in
    ``skip`` (e.g. eos, whose position is fixed by the template) and existing ``<thinking>`` tokens, which are
    kept as they are. With the defaults every site gets one ``<thinking>``. Otherwise, as the authors'
    ``ThinkingTokenStrategy.apply``: at most ``max_sites`` sites are kept (a sorted random sample when there are
    more), each kept site gets a ``<thinking>`` with probability ``insertion_prob`` and, if it got one, a second
    with probability ``second_prob``. ``rng`` draws those choices (required when any of them is random).
    """
    if max_sites is not None and max_sites < 0:
        raise ValueError(f"max_sites must be >= 0 or None, got {max_sites}")
    if not (0.0 <= insertion_prob <= 1.0 and 0.0 <= second_prob <= 1.0):
        raise ValueError(
            f"insertion_prob and second_prob must be in [0, 1], got {insertion_prob}, {second_prob}"
        )
    ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
    sites = [
        t
        for t, (token, label, conf) in enumerate(zip(ids, labels, confidence.tolist(), strict=True))
        if label != IGNORE_INDEX
        and conf == conf
        and conf < threshold  # conf == conf: not NaN
        and token not in skip
        and token != thinking_id
    ]
    random_choice = (
        (max_sites is not None and len(sites) > max_sites) or insertion_prob < 1.0 or second_prob > 0.0
    )
    if random_choice and rng is None:
        raise ValueError(
            "insert_thinking needs an rng when max_sites, insertion_prob or second_prob draw at random"
        )
    if max_sites is not None and len(sites) > max_sites:
        sites = sorted(rng.sample(sites, max_sites))
    count = dict.fromkeys(sites, 0)
    for t in sites:
        if insertion_prob < 1.0 and rng.random() > insertion_prob:
            continue
        count[t] = 1
        if second_prob > 0.0 and rng.random() < second_prob:
            count[t] = 2
    new_ids: list[int] = []
    new_labels: list[int] = []
    for t, (token, label) in enumerate(zip(ids, labels, strict=True)):
        new_ids.extend([thinking_id] * count.get(t, 0))
        new_labels.extend([thinking_id] * count.get(t, 0))
        new_ids.append(token)
        new_labels.append(label)
    return {"input_ids": torch.tensor(new_ids), "labels": torch.tensor(new_labels)}


def rebuild_with_thinking(
    model: torch.nn.Module,
    explicit: Sequence[dict[str, Tensor]],
    *,
    threshold: float,
    thinking_id: int,
    pad_id: int,
    skip: Sequence[int] = (),
    max_sites: int | None = None,
    insertion_prob: float = 1.0,
    second_prob: float = 0.0,
    seed: int | str = 0,
    batch_size: int = 32,
) -> list[dict[str, Tensor]]:
    """One curriculum rebuild: score ``explicit`` items with ``model`` and :func:`insert_thinking` into each.

    Item ``i`` draws its random choices from ``random.Random`` seeded with ``(seed, i)``, so a rebuild does not
    depend on batch order or on the other items.
    """
    confidence = token_confidence(model, explicit, pad_id=pad_id, batch_size=batch_size)
    return [
        insert_thinking(
            item,
            conf,
            threshold=threshold,
            thinking_id=thinking_id,
            skip=skip,
            max_sites=max_sites,
            insertion_prob=insertion_prob,
            second_prob=second_prob,
            rng=random.Random(f"{seed}:{i}"),
        )
        for i, (item, conf) in enumerate(zip(explicit, confidence, strict=True))
    ]


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
        stage_epochs: Epochs of stage 1 (explicit CoT) and of stage 2 (α = 1). The authors' README gives
            1, 2 and 7 epochs for the three stages.
        thresholds: Confidence thresholds τ for the rebuilds entering stage 2 and stage 3 (the authors'
            ``reinforce_prob_threshold``).
        max_sites: At most this many ``<thinking>`` sites per item in each rebuild (the authors'
            ``labels_per_stage``); ``None`` entries: no cap.
        insertion_prob: Probability that a kept site gets a ``<thinking>`` (``thinking_insertion_prob``).
        second_prob: Probability of a second, consecutive ``<thinking>`` at a site that got one
            (``thinking_secondary_insertion_prob``).
        alpha, temperature, top_p: The fusion of stage 3 (the authors' ``fusion_alpha`` 0.6 for the fusion
            stage, ``fusion_temperature`` 1, ``fusion_top_p`` 0.9).
        seed: Seeds the random choices of the rebuilds (per stage and item).
        batch_size: Items per forward when scoring confidence.

    ``max_sites=(None, None), insertion_prob=(1, 1), second_prob=(0, 0)`` inserts one ``<thinking>`` before
    every token below τ (this library's rule before it followed the authors' code).
    """

    def __init__(
        self,
        stage_epochs: tuple[int, int] = (1, 1),
        thresholds: tuple[float, float] = (0.3, 0.2),
        alpha: float = 0.6,
        temperature: float = 1.0,
        top_p: float = 0.9,
        batch_size: int = 32,
        *,
        max_sites: tuple[int | None, int | None] = (10, 16),
        insertion_prob: tuple[float, float] = (0.85, 0.95),
        second_prob: tuple[float, float] = (0.15, 0.2),
        seed: int = 0,
    ) -> None:
        if len(stage_epochs) != 2 or min(stage_epochs) < 1:
            raise ValueError(f"stage_epochs must be two positive epoch counts, got {stage_epochs}")
        if len(thresholds) != 2 or not all(0.0 < t <= 1.0 for t in thresholds):
            raise ValueError(f"thresholds must be two confidences in (0, 1], got {thresholds}")
        if len(max_sites) != 2 or any(m is not None and m < 0 for m in max_sites):
            raise ValueError(f"max_sites must be two counts >= 0 (or None), got {max_sites}")
        for name, probs in (("insertion_prob", insertion_prob), ("second_prob", second_prob)):
            if len(probs) != 2 or not all(0.0 <= p <= 1.0 for p in probs):
                raise ValueError(f"{name} must be two probabilities in [0, 1], got {probs}")
        from lightning_llm.modules.latent_thoughts import check_fusion

        check_fusion(alpha, temperature, top_p)
        self.stage_epochs = tuple(int(e) for e in stage_epochs)
        self.thresholds = tuple(float(t) for t in thresholds)
        self.alpha, self.temperature, self.top_p = float(alpha), float(temperature), float(top_p)
        self.batch_size = batch_size
        self.max_sites = tuple(None if m is None else int(m) for m in max_sites)
        self.insertion_prob = tuple(float(p) for p in insertion_prob)
        self.second_prob = tuple(float(p) for p in second_prob)
        self.seed = int(seed)
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
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Logged at the end (a run resumed mid-epoch does not start that epoch again), for the epoch just trained.
        pl_module.log("curriculum/stage", float(self.stage), on_step=False, on_epoch=True, sync_dist=True)
        upcoming = self.stage_of_epoch(trainer.current_epoch + 1)
        if upcoming == self.stage:
            return
        data = trainer.datamodule
        explicit = [_strip_thinking(item, pl_module.thinking_id) for item in data.train_items]
        k = upcoming - 2
        threshold = self.thresholds[k]
        items = rebuild_with_thinking(
            pl_module.model,
            explicit,
            threshold=threshold,
            thinking_id=pl_module.thinking_id,
            pad_id=pl_module.tokenizer.pad_token_id,
            skip=pl_module.stop_token_ids,
            max_sites=self.max_sites[k],
            insertion_prob=self.insertion_prob[k],
            second_prob=self.second_prob[k],
            seed=f"{self.seed}:{upcoming}",
            batch_size=self.batch_size,
        )
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
