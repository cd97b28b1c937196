"""Preference pairs for DPO: a prompt with a chosen and a rejected response; and honeypot hard negatives.

:class:`PreferenceDataModule` reads ``(prompt, chosen, rejected)`` records from any source.
:class:`HoneypotPreferenceDataModule` builds them from the ``honeypot`` task (fictitious procedures), with
*honeypot* responses — flagged by judges, no correct step — as hard negatives (ICML 2026 honeypot paper).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_llm.datamodules.sources import DataSourceError, ExampleDataModule, pad_sequences
from lightning_llm.datamodules.tasks.honeypot import HoneypotTask
from lightning_llm.types import IGNORE_INDEX, Example

__all__ = ["HoneypotPreferenceDataModule", "PreferenceDataModule", "PreferencePair", "honeypot_pairs"]


@dataclass(frozen=True)
class PreferencePair:
    """One preference: ``chosen`` ≻ ``rejected`` as responses to ``prompt``; ``kind`` names the pair type."""

    prompt: str
    chosen: str
    rejected: str
    kind: str = "pair"


class PreferenceDataModule(ExampleDataModule):
    """Batches of preference pairs, each side rendered as ``[system?, user=prompt, assistant=response]``.

    Each side is encoded exactly as :class:`~lightning_llm.datamodules.ChatSFTDataModule` encodes a
    conversation (only the response and its end token have labels), and cut to ``max_length``; a pair where
    either side keeps no response token is dropped (one warning counts them). A real source needs ``prompt``,
    ``chosen`` and ``rejected`` string columns (names set by ``chosen_column`` / ``rejected_column``).

    Batch: ``dict(chosen_input_ids, chosen_attention_mask, chosen_labels, rejected_input_ids,
    rejected_attention_mask, rejected_labels)``, all ``[B, T]`` long tensors right-padded to one common ``T``
    (so a module can stack both sides into one forward), plus ``kind: list[str]``.

    Args:
        chosen_column: Column of the preferred response (real sources).
        rejected_column: Column of the dispreferred response (real sources).
        **kwargs: The arguments of :class:`~lightning_llm.datamodules.sources.ExampleDataModule`.
    """

    _required = ("prompt",)

    def __init__(
        self, *, chosen_column: str = "chosen", rejected_column: str = "rejected", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)

    @override
    def _string_columns(self) -> tuple[str, ...]:
        return (self.hparams.chosen_column, self.hparams.rejected_column)

    def _pairs(self, examples: list[Example], split: str) -> list[PreferencePair]:
        """The pairs of a split. Real sources read the chosen/rejected columns (in ``metadata``; checked at
        load with each record's file and line)."""
        hp = self.hparams
        pairs = []
        for index, example in enumerate(examples):
            sides = []
            for column in (hp.chosen_column, hp.rejected_column):
                value = example.metadata.get(column)
                if not isinstance(value, str):
                    state = "missing" if value is None else f"a {type(value).__name__}, not a string, in"
                    raise DataSourceError(
                        f"{hp.source}: {split} record {index} (prompt {example.prompt[:60]!r}): column "
                        f"{column!r} is {state}; preference records need string columns {hp.chosen_column!r} "
                        f"and {hp.rejected_column!r}"
                    )
                sides.append(value)
            pairs.append(PreferencePair(example.prompt, sides[0], sides[1]))
        return pairs

    def _build(self, train: list[Example], val: list[Example]) -> tuple[list[Any], list[Any]]:
        train_items = self._items(self._pairs(train, "train"))
        val_items = self._items(self._pairs(val, "validation"))
        if not train_items:
            raise ValueError(f"no training pair fits in max_length={self.hparams.max_length} tokens")
        return train_items, val_items

    def _items(self, pairs: list[PreferencePair]) -> list[dict[str, Any]]:
        chosen = self._encode([Example(p.prompt, p.chosen, "") for p in pairs])
        rejected = self._encode([Example(p.prompt, p.rejected, "") for p in pairs])
        items = []
        for pair, c, r in zip(pairs, chosen, rejected, strict=True):
            c_item, r_item = self._truncate(*c), self._truncate(*r)
            if c_item is None or r_item is None:
                continue
            items.append(
                {
                    "chosen_input_ids": c_item["input_ids"],
                    "chosen_labels": c_item["labels"],
                    "rejected_input_ids": r_item["input_ids"],
                    "rejected_labels": r_item["labels"],
                    "kind": pair.kind,
                }
            )
        if len(items) < len(pairs):
            rank_zero_warn(
                f"{type(self).__name__}: dropped {len(pairs) - len(items)} of {len(pairs)} pairs whose prompt "
                f"fills max_length={self.hparams.max_length} tokens"
            )
        return items

    def _collator(self) -> _PreferenceCollator:
        return _PreferenceCollator(pad_id=self.tokenizer.pad_token_id)


@dataclass(frozen=True)
class _PreferenceCollator:
    """Right-pads both sides of every pair to the longest sequence of the batch (either side)."""

    pad_id: int

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        length = max(max(len(i["chosen_input_ids"]), len(i["rejected_input_ids"])) for i in items)
        batch: dict[str, Any] = {"kind": [item["kind"] for item in items]}
        for side in ("chosen", "rejected"):
            ids = [item[f"{side}_input_ids"] for item in items]
            # A dummy row of the common length makes pad_sequences pad every row to it; dropped right after.
            ref = torch.zeros(length, dtype=torch.long)
            batch[f"{side}_input_ids"] = pad_sequences([*ids, ref], self.pad_id)[:-1]
            batch[f"{side}_attention_mask"] = pad_sequences([*(torch.ones_like(i) for i in ids), ref], 0)[:-1]
            batch[f"{side}_labels"] = pad_sequences(
                [*(item[f"{side}_labels"] for item in items), ref], IGNORE_INDEX
            )[:-1]
        return batch


# ------------------------------------------------------------------------------------------- honeypot

#: The extra pair kinds each honeypot role adds.
_HONEYPOT_KINDS = {
    "chosen": ("honeypot>actionable",),
    "rejected": ("refusal>honeypot",),
    "ranked": ("honeypot>actionable", "refusal>honeypot"),
}
HoneypotRole = Literal["chosen", "rejected", "ranked"]


def honeypot_pairs(
    task: HoneypotTask,
    examples: list[Example],
    *,
    negatives: Literal["plain", "honeypot"] = "honeypot",
    honeypot_role: HoneypotRole = "chosen",
    honeypot_fraction: float = 0.5,
    seed: int = 0,
) -> list[PreferencePair]:
    r"""Safety preference pairs from examples of the ``honeypot`` task.

    Every example gives its *plain* pair: refusal ≻ actionable answer for a restricted request, correct answer
    ≻ refusal for a benign one (so safety training does not teach blanket refusal). With
    ``negatives="honeypot"`` a restricted example gives, with probability ``honeypot_fraction``, one *extra*
    pair with a honeypot response (judge-flagged, no correct step) as the hard negative. The plain pairs are
    the same in both modes, so a honeypot run sees every plain pair exactly as often as the plain run; the
    honeypot pairs are added data, as a pipeline that constructs hard negatives adds them.

    Where the honeypot sits (``honeypot_role``): the paper's pipeline is not public, and the three readings
    behave differently, so all three are here.

    - ``"chosen"`` (default): honeypot ≻ actionable. The honeypot is a negative for the judge but the
      *preferred way to fail*: this is the reading that reshapes failures towards low actionability, the
      paper's stated aim.
    - ``"rejected"``: refusal ≻ honeypot, the literal "honeypot on the rejected side". It lowers the attack
      success rate, but what still gets through is *more* often actionable (the tutorial measures it).
    - ``"ranked"``: either of the two, with equal probability (refusal ≻ honeypot ≻ actionable).

    Pair kinds: ``"refusal>actionable"``, ``"actionable>refusal"``, ``"honeypot>actionable"``,
    ``"refusal>honeypot"``. Deterministic in ``seed`` and the examples.
    """
    if negatives not in ("plain", "honeypot"):
        raise ValueError(f"negatives must be 'plain' or 'honeypot', got {negatives!r}")
    if honeypot_role not in _HONEYPOT_KINDS:
        raise ValueError(f"honeypot_role must be one of {sorted(_HONEYPOT_KINDS)}, got {honeypot_role!r}")
    if not 0.0 <= honeypot_fraction <= 1.0:
        raise ValueError(f"honeypot_fraction must be in [0, 1], got {honeypot_fraction}")
    # Two streams, so the plain pairs are identical whether or not honeypot pairs are drawn beside them.
    plain_rng, extra_rng = random.Random(f"{seed}/plain"), random.Random(f"{seed}/honeypot")
    pairs = []
    for example in examples:
        restricted = example.metadata["restricted"]
        drawn = [("refusal>actionable" if restricted else "actionable>refusal", plain_rng)]
        if negatives == "honeypot" and restricted and extra_rng.random() < honeypot_fraction:
            drawn.append((extra_rng.choice(_HONEYPOT_KINDS[honeypot_role]), extra_rng))
        for kind, rng in drawn:
            better, worse = kind.split(">")
            chosen, rejected = task.response(example, better, rng), task.response(example, worse, rng)
            pairs.append(PreferencePair(example.prompt, chosen, rejected, kind))
    return pairs


class HoneypotPreferenceDataModule(PreferenceDataModule):
    """Safety preference pairs from the ``honeypot`` task, with or without honeypot hard negatives.

    See :func:`honeypot_pairs` for what each mode builds; the task (``task_kwargs``) sets the world, the
    prompt templates (training wrappers only, by default: the held-out attacks stay for evaluation) and the
    honeypot style. Validation pairs are built the same way from held-out prompts. A honeypot run has more
    pairs than a plain one; compare them at equal epochs.

    Args:
        negatives: ``"plain"`` (refusal ≻ actionable) or ``"honeypot"`` (adds honeypot hard negatives).
        honeypot_role: ``"chosen"``, ``"rejected"`` or ``"ranked"`` (see :func:`honeypot_pairs`).
        honeypot_fraction: Probability that a restricted example adds a honeypot pair.
        **kwargs: The arguments of :class:`~lightning_llm.datamodules.sources.ExampleDataModule`.
    """

    def __init__(
        self,
        *,
        negatives: Literal["plain", "honeypot"] = "honeypot",
        honeypot_role: HoneypotRole = "chosen",
        honeypot_fraction: float = 0.5,
        task: str | None = "honeypot",
        **kwargs: Any,
    ) -> None:
        super().__init__(task=task, **kwargs)
        if not isinstance(self.task, HoneypotTask):
            raise ValueError(f"HoneypotPreferenceDataModule needs task='honeypot', got task={task!r}")
        # Validates the pair arguments now rather than at setup.
        honeypot_pairs(
            self.task,
            [],
            negatives=negatives,
            honeypot_role=honeypot_role,
            honeypot_fraction=honeypot_fraction,
        )

    def _pairs(self, examples: list[Example], split: str) -> list[PreferencePair]:
        hp = self.hparams
        return honeypot_pairs(
            self.task,
            examples,
            negatives=hp.negatives,
            honeypot_role=hp.honeypot_role,
            honeypot_fraction=hp.honeypot_fraction,
            seed=2 * hp.seed + (split == "validation"),
        )
