"""The research report: one part per outline section, every citation checked against the evidence held."""

from __future__ import annotations

import re
from dataclasses import dataclass

from lightning_llm.evaluation.dualgraph.backends import LLMBackend
from lightning_llm.evaluation.dualgraph.graphs import Evidence, KnowledgeGraph, OutlineGraph

__all__ = ["Report", "write_report"]


@dataclass
class Report:
    """A written report: markdown text, the references cited, and the citations that were dropped."""

    markdown: str
    references: dict[int, Evidence]
    invalid_citations: int = 0


_CITE = re.compile(r"\[(\d+)\]")
_WRITE_PROMPT = (
    "Write one paragraph for the section '{title}' of a report on {topic}, using only these facts, and cite "
    "each fact with its number in brackets.\n{facts}\n\nParagraph:"
)


def write_report(kg: KnowledgeGraph, outline: OutlineGraph, backend: LLMBackend | None = None) -> Report:
    """A report with one part per outline section, citing the evidence of every statement.

    Without a backend each section lists its relations as sentences with their citations. With one, the
    backend writes each section from the numbered facts; citations of numbers that are not among that
    section's facts are removed (and counted in ``invalid_citations``) — a report never cites what it does not hold.
    """
    numbers: dict[int, int] = {}
    references: dict[int, Evidence] = {}

    def cite(ev: Evidence) -> int:
        if ev.doc_id not in numbers:
            numbers[ev.doc_id] = len(numbers) + 1
            references[numbers[ev.doc_id]] = ev
        return numbers[ev.doc_id]

    parts = [f"# {outline.title}"]
    invalid = 0
    for section in outline.sections:
        rels = sorted(
            (r for r in kg.relations.values() if r.head in section.entities or r.tail in section.entities),
            key=lambda r: r.triple,
        )
        facts = [(f"{r.head} {r.relation} {r.tail}", sorted({cite(e) for e in r.evidence})) for r in rels]
        parts.append(f"\n## {section.title}\n")
        if not facts:
            parts.append("No evidence was found for this section.")
            continue
        if backend is None:
            parts.append(
                "\n".join(f"- {text} " + "".join(f"[{n}]" for n in nums) + "." for text, nums in facts)
            )
            continue
        listing = "\n".join(f"{text} " + "".join(f"[{n}]" for n in nums) for text, nums in facts)
        text = backend.complete(
            [_WRITE_PROMPT.format(title=section.title, topic=outline.title, facts=listing)]
        )[0]
        allowed = {n for _, nums in facts for n in nums}

        def keep(m: re.Match[str], allowed: set[int] = allowed) -> str:
            nonlocal invalid
            if int(m.group(1)) in allowed:
                return m.group(0)
            invalid += 1
            return ""

        parts.append(_CITE.sub(keep, text).strip() or "(the backend wrote nothing usable)")
    cited = {int(n) for n in _CITE.findall("\n".join(parts))}
    parts.append("\n## References\n")
    parts += [f"[{n}] {references[n].title}" for n in sorted(cited)]
    return Report("\n".join(parts), {n: references[n] for n in sorted(cited)}, invalid)
