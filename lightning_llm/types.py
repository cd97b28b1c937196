"""Record types every layer shares (they import nothing of the library)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IGNORE_INDEX", "Doc", "Example"]

#: Label of a token that is neither trained on nor scored (the ``ignore_index`` default of PyTorch's and Hugging
#: Face's cross-entropy): prompt tokens of SFT, padding, a given bos.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Example:
    """One data point, shared by SFT (prompt → completion) and RL (prompt, verified against ``answer``).

    Attributes:
        prompt: The user message.
        completion: The reference assistant response, the SFT target.
        answer: The exact answer a verifier checks (empty when the source has none).
        metadata: Anything else a reward function may need (task parameters, source columns).
    """

    prompt: str
    completion: str
    answer: str
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def to(self, *args: Any, **kwargs: Any) -> Example:
        """Return ``self``: examples ride along in batches, and Lightning moves a batch to the device by calling
        ``.to`` on whatever has one, but rebuilds other dataclasses field by field, which fails on a frozen one
        (and would copy it). With this the same objects reach ``training_step``."""
        return self


@dataclass(frozen=True)
class Doc:
    """One retrievable document: ``title`` (shown, and searched) and ``text``."""

    title: str
    text: str
