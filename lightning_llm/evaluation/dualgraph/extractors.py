"""Relation extractors: ``(head, relation, tail)`` triples from retrieved documents, by a fixed sentence pattern
(:class:`DeterministicExtractor`) or by an LLM whose answer is parsed strictly (:class:`LLMExtractor`)."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence

from lightning_llm.envs.search import Doc
from lightning_llm.evaluation.dualgraph.backends import LLMBackend
from lightning_llm.evaluation.dualgraph.graphs import Triple

__all__ = ["DeterministicExtractor", "Extractor", "LLMExtractor"]


class Extractor(ABC):
    """Turns a retrieved document into ``(head, relation, tail)`` triples."""

    @abstractmethod
    def extract(self, docs: Sequence[Doc]) -> list[list[Triple]]:
        """One list of triples per document."""


class DeterministicExtractor(Extractor):
    """Reads sentences of the form ``<Entity> <relation> <Entity>.`` for a known relation vocabulary
    (the synthetic corpus's format): capitalised single-word entities, relation verbs from ``relations``."""

    def __init__(self, relations: Sequence[str]) -> None:
        if not relations:
            raise ValueError("the extractor needs a relation vocabulary")
        verbs = "|".join(re.escape(r) for r in sorted(relations, key=len, reverse=True))
        self._pattern = re.compile(rf"\b([A-Z][a-z]+) ({verbs}) ([A-Z][a-z]+)\b")

    def extract(self, docs: Sequence[Doc]) -> list[list[Triple]]:
        return [
            [m.groups() for m in self._pattern.finditer(doc.text) if m.group(1) != m.group(3)] for doc in docs
        ]


_EXTRACT_PROMPT = (
    "List every relation stated in the text, one per line, as: head | relation | tail\n"
    "Allowed relations: {relations}\n\nText: {text}\n\nRelations:"
)
_LINE = re.compile(r"^\s*([^|]{1,60}?)\s*\|\s*([^|]{1,40}?)\s*\|\s*([^|]{1,60}?)\s*$")


class LLMExtractor(Extractor):
    """Asks an :class:`LLMBackend` for ``head | relation | tail`` lines; keeps only well-formed lines whose
    relation is in the vocabulary and whose entities occur in the document (no invented entities).
    ``dropped`` counts the lines thrown away."""

    def __init__(
        self, backend: LLMBackend, relations: Sequence[str], template: str = _EXTRACT_PROMPT
    ) -> None:
        self.backend, self.relations, self.template = backend, set(relations), template
        self.dropped = 0

    def extract(self, docs: Sequence[Doc]) -> list[list[Triple]]:
        prompts = [
            self.template.format(relations=", ".join(sorted(self.relations)), text=d.text) for d in docs
        ]
        out = []
        for doc, answer in zip(docs, self.backend.complete(prompts), strict=True):
            triples = []
            for line in answer.splitlines():
                if not line.strip():
                    continue
                m = _LINE.match(line)
                ok = (
                    m is not None
                    and m.group(2) in self.relations
                    and m.group(1) in doc.text
                    and m.group(3) in doc.text
                )
                if ok and m.group(1) != m.group(3):
                    triples.append((m.group(1), m.group(2), m.group(3)))
                else:
                    self.dropped += 1
            out.append(triples)
        return out
