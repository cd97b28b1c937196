"""The trace format of reasoning graphs: :class:`Claim`, :func:`format_trace` and :class:`TraceParser`.

One claim per line; cells are 1-based ``r{row}c{col}`` (as in the puzzle prompts), values ``1..n``::

    [1] r1c3!=2 <- 4 : r1c4 holds 2        elimination: r1c3 is not 2, because of claim 4
    [2] r1c3=1 <- 1,3 # only 1 is left     assignment: r1c3 is 1, because of claims 1 and 3
    [3] r2c2=4                             no dependencies: follows from the givens alone
    <answer>1234/3412/2143/4321</answer>

- ``[id]`` is a positive integer, unique in the trace; ``<- i,j`` lists the claims this one is derived from,
  which must appear on *earlier* lines (so the graph is acyclic by construction).
- Anything after ``:`` or ``#`` is the free-text reason, kept in :attr:`Claim.text` and never interpreted.
- Blank lines, lines starting with ``#`` and the optional ``<answer>...</answer>`` block are not claims. The
  answer is read leniently: the puzzle tasks' format (``12/21``) or numbers in reading order with any
  separators (:meth:`TraceParser.parse_answer`).

:class:`TraceParser` reads this format with strict regular expressions (never ``eval``); strict mode raises a
``ValueError`` naming the line, lenient mode skips what it cannot read and counts it. Free-form traces are
first rewritten into the format by an LLM
(:class:`~lightning_llm.evaluation.reasoning_graph.extract.LLMClaimExtractor`), then parsed leniently.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from lightning_llm.datamodules.tasks.puzzles import Cell, Grid, format_grid

__all__ = ["Claim", "ClaimKind", "TraceParser", "format_trace"]

ClaimKind = Literal["assign", "eliminate"]


@dataclass(frozen=True)
class Claim:
    """One atomic claim of a trace.

    Attributes:
        id: The trace's own label, a positive integer unique in the trace.
        kind: ``"assign"`` (the cell holds ``value``) or ``"eliminate"`` (it does not).
        cell: ``(row, col)``, 0-based.
        value: The value claimed (or ruled out).
        depends_on: Ids of the earlier claims this one is derived from.
        text: The free-text reason, if any.
    """

    id: int
    kind: ClaimKind
    cell: Cell
    value: int
    depends_on: tuple[int, ...] = ()
    text: str = ""

    @property
    def label(self) -> str:
        """``r1c2=4`` / ``r1c2!=3`` (1-based)."""
        op = "=" if self.kind == "assign" else "!="
        return f"r{self.cell[0] + 1}c{self.cell[1] + 1}{op}{self.value}"

    def format(self) -> str:
        """The claim as one line of the trace format."""
        line = f"[{self.id}] {self.label}"
        if self.depends_on:
            line += " <- " + ",".join(str(d) for d in self.depends_on)
        if self.text:
            line += f" : {self.text}"
        return line


def format_trace(claims: Iterable[Claim], answer: Grid | None = None) -> str:
    """Write claims (and optionally an answer grid, in the puzzle tasks' answer format ``12/21``) in the trace
    format; :meth:`TraceParser.parse` reads it back."""
    lines = [c.format() for c in claims]
    if answer is not None:
        lines.append(f"<answer>{format_grid(answer)}</answer>")
    return "\n".join(lines)


# The whole line must match: a claim with trailing junk is an error, not a claim. Values and ids are bounded
# in length so that a pathological line cannot produce huge integers.
_CLAIM = re.compile(
    r"""^\s*\[\s*(?P<id>\d{1,6})\s*\]\s*
        r(?P<row>\d{1,3})\s*c(?P<col>\d{1,3})\s*(?P<op>!=|=)\s*(?P<value>\d{1,3})
        \s*(?:<-\s*(?P<deps>\d{1,6}(?:\s*,\s*\d{1,6})*))?
        \s*(?:[:#]\s*(?P<text>.*?))?\s*$""",
    re.VERBOSE,
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


class TraceParser:
    """Reads the trace format of the module docstring into :class:`Claim` objects.

    Args:
        size: The grid side ``n``; when given, cells must lie in the grid and values in ``1..n``.
        strict: Raise ``ValueError`` (naming the 1-based line) on any line that is not a valid claim; otherwise
            skip such lines, and drop dependencies on unknown ids, counting both.

    Attributes:
        skipped: Lines skipped in lenient mode, summed over calls.
        dropped_dependencies: Unknown dependency ids dropped in lenient mode, summed over calls.
        errors: The reasons for what the last :meth:`parse` call skipped or dropped.
    """

    def __init__(self, size: int | None = None, *, strict: bool = True) -> None:
        if size is not None and size < 1:
            raise ValueError(f"size must be positive, got {size}")
        self.size, self.strict = size, strict
        self.skipped = 0
        self.dropped_dependencies = 0
        self.errors: list[str] = []

    def parse(self, text: str) -> list[Claim]:
        """The claims of ``text`` in trace order."""
        self.errors = []
        claims: list[Claim] = []
        seen: set[int] = set()
        body = _ANSWER.sub("", text)  # the answer block may span lines; it is not a claim
        for number, line in enumerate(body.splitlines(), start=1):
            stripped = line.strip()
            if not stripped or stripped.startswith(("#", "```")):
                continue
            claim = self._parse_line(number, line, seen)
            if claim is not None:
                claims.append(claim)
                seen.add(claim.id)
        return claims

    def parse_answer(self, text: str) -> Grid | None:
        """The grid in the last ``<answer>...</answer>`` block, or None if there is none or it does not have
        ``size × size`` values. Numbers are read in reading order; rows written as digit strings (``1234``) are
        split into digits."""
        found = _ANSWER.findall(text)
        if not found or self.size is None:
            return None
        n = self.size
        tokens = re.findall(r"\d+", found[-1])
        if len(tokens) != n * n and len(tokens) == n and all(len(t) == n for t in tokens) and n <= 9:
            tokens = [ch for t in tokens for ch in t]
        if len(tokens) != n * n:
            return None
        values = [int(t) for t in tokens]
        return tuple(tuple(values[r * n : (r + 1) * n]) for r in range(n))

    def _fail(self, number: int, line: str, reason: str) -> None:
        message = f"line {number}: {reason}: {line.strip()[:80]!r}"
        if self.strict:
            raise ValueError(message)
        self.errors.append(message)

    def _parse_line(self, number: int, line: str, seen: set[int]) -> Claim | None:
        m = _CLAIM.match(line)
        if m is None:
            self._fail(number, line, "not a claim (expected '[id] r<row>c<col>=<v>' or '!=<v>')")
            self.skipped += 1
            return None
        cid, row, col, value = (int(m.group(k)) for k in ("id", "row", "col", "value"))
        problem = None
        if cid < 1:
            problem = "claim ids must be positive"
        elif cid in seen:
            problem = f"duplicate claim id {cid}"
        elif row < 1 or col < 1 or (self.size is not None and (row > self.size or col > self.size)):
            problem = f"cell r{row}c{col} is outside the {self.size or '?'} x {self.size or '?'} grid"
        elif value < 1 or (self.size is not None and value > self.size):
            problem = f"value {value} is outside 1..{self.size or '?'}"
        if problem is not None:
            self._fail(number, line, problem)
            self.skipped += 1
            return None
        deps: list[int] = []
        for d in (int(x) for x in (m.group("deps") or "").replace(" ", "").split(",") if x):
            if d == cid:
                reason = f"claim {cid} depends on itself"
            elif d not in seen:
                reason = f"unknown dependency id {d} (claims may only depend on earlier claims)"
            else:
                if d not in deps:
                    deps.append(d)
                continue
            self._fail(number, line, reason)
            self.dropped_dependencies += 1
        kind: ClaimKind = "assign" if m.group("op") == "=" else "eliminate"
        return Claim(cid, kind, (row - 1, col - 1), value, tuple(deps), (m.group("text") or "").strip())
