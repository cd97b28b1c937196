"""Verdicts on the claims of a reasoning trace.

:func:`verify_claims` checks each claim against the solution: an assignment ``r,c = v`` is true iff
:meth:`Puzzle.check_cell`, an elimination ``r,c != v`` iff the solution's value there is not ``v``. A claim is
*unsupported* when one of its dependencies is false or itself unsupported (it may still be true by luck).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_llm.datamodules.tasks.puzzles import Puzzle
from lightning_llm.evaluation.reasoning_graph.parse import Claim

__all__ = ["ClaimVerdict", "verify_claims"]


@dataclass(frozen=True)
class ClaimVerdict:
    """The verifier's view of one claim: ``correct`` (true of the solution) and ``unsupported`` (derived, directly
    or through other claims, from a false claim)."""

    claim_id: int
    correct: bool
    unsupported: bool


def verify_claims(puzzle: Puzzle, claims: Sequence[Claim]) -> list[ClaimVerdict]:
    """Check each claim against the puzzle's solution (see the module docstring), in trace order."""
    n = puzzle.size
    bad: set[int] = set()  # false or unsupported: anything derived from these is unsupported
    out = []
    for claim in claims:
        r, c = claim.cell
        inside = 0 <= r < n and 0 <= c < n
        if claim.kind == "assign":
            correct = puzzle.check_cell(r, c, claim.value)
        else:
            correct = inside and puzzle.solution[r][c] != claim.value
        unsupported = any(d in bad for d in claim.depends_on)
        if not correct or unsupported:
            bad.add(claim.id)
        out.append(ClaimVerdict(claim.id, correct, unsupported))
    return out
