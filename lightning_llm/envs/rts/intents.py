"""The typed intent schema agents speak, and its strict parser.

An agent does not move units; it issues a few macro/tactical intents every ``Rules.decision_interval`` ticks,
one per line, in this grammar (case and spaces around tokens are free, nothing else is)::

    expand()                 build a refinery on the nearest free resource field
    build(<building>)        refinery | barracks | factory | tower, placed near the HQ
    train(<unit>, <count>)   infantry | rocket | tank | scout, 1 <= count <= Rules.max_train
    attack(<region>)         the army (every unit but scouts) attack-moves to the region
    defend()                 the army holds the home region and engages what enters it
    retreat()                the army walks home without stopping to fight
    scout(<region>)          one scout moves there (needs an idle scout)
    wait()                   do nothing this decision

Regions are the cells of a 3 × 3 grid over the map: ``nw n ne / w c e / sw s se``.

Parsing never evaluates anything: a line either matches the grammar exactly and becomes an :class:`Intent`, or
it is rejected with an :class:`IntentError` whose ``reason`` says what is wrong (unknown verb, wrong number of
arguments, unknown unit, count out of range, ...). Execution problems (not enough credits, no barracks) are
reported separately by the executor, as outcomes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lightning_llm.envs.rts.rules import BUILDING_KINDS, UNIT_KINDS, Rules

__all__ = [
    "BUILDABLE",
    "REGIONS",
    "VERBS",
    "Intent",
    "IntentError",
    "all_intents",
    "parse_intent",
    "parse_intents",
]

#: Region names, row by row from the north-west; player 0 starts in ``sw``, player 1 in ``ne``.
REGIONS = ("nw", "n", "ne", "w", "c", "e", "sw", "s", "se")
#: Buildings an agent may order (the HQ is given).
BUILDABLE = tuple(k for k in BUILDING_KINDS if k != "hq")
#: verb -> the kinds of its arguments, in order.
VERBS: dict[str, tuple[str, ...]] = {
    "expand": (),
    "build": ("building",),
    "train": ("unit", "count"),
    "attack": ("region",),
    "defend": (),
    "retreat": (),
    "scout": ("region",),
    "wait": (),
}
_MAX_LINE = 80
_CALL = re.compile(r"^\s*([A-Za-z_]+)\s*\(([^()]*)\)\s*$")
_ARG = re.compile(r"^[A-Za-z0-9_]+$")


class IntentError(ValueError):
    """A line that is not a valid intent; ``reason`` says why, ``line`` is the offending text."""

    def __init__(self, line: str, reason: str) -> None:
        super().__init__(f"{reason}: {line!r}")
        self.line = line
        self.reason = reason


@dataclass(frozen=True)
class Intent:
    """One parsed intent. ``args`` are normalised (lower case; counts as ``int``)."""

    verb: str
    args: tuple[str | int, ...] = ()

    def __str__(self) -> str:
        return f"{self.verb}({', '.join(str(a) for a in self.args)})"

    @classmethod
    def parse(cls, line: str, rules: Rules | None = None) -> Intent:
        """Same as :func:`parse_intent`."""
        return parse_intent(line, rules)


def parse_intent(line: str, rules: Rules | None = None) -> Intent:
    """Parse one line into an :class:`Intent`, or raise :class:`IntentError` with the reason.

    ``rules`` bounds ``train`` counts (``Rules.max_train``; default rules when ``None``).
    """
    if not isinstance(line, str):
        raise IntentError(repr(line), "not a string")
    if len(line) > _MAX_LINE:
        raise IntentError(line[:_MAX_LINE] + "...", f"longer than {_MAX_LINE} characters")
    match = _CALL.match(line)
    if match is None:
        raise IntentError(line, "not of the form verb(arguments)")
    verb = match.group(1).lower()
    if verb not in VERBS:
        raise IntentError(line, f"unknown verb {verb!r} (known: {', '.join(VERBS)})")
    raw = match.group(2).strip()
    parts = [p.strip() for p in raw.split(",")] if raw else []
    kinds = VERBS[verb]
    if len(parts) != len(kinds):
        raise IntentError(line, f"{verb} takes {len(kinds)} argument(s), got {len(parts)}")
    max_train = (rules or Rules()).max_train
    args: list[str | int] = []
    for kind, part in zip(kinds, parts, strict=True):
        if not _ARG.match(part):
            raise IntentError(line, f"argument {part!r} is not a plain word or number")
        value = part.lower()
        if kind == "building" and value not in BUILDABLE:
            raise IntentError(line, f"unknown building {value!r} (buildable: {', '.join(BUILDABLE)})")
        if kind == "unit" and value not in UNIT_KINDS:
            raise IntentError(line, f"unknown unit {value!r} (units: {', '.join(UNIT_KINDS)})")
        if kind == "region" and value not in REGIONS:
            raise IntentError(line, f"unknown region {value!r} (regions: {', '.join(REGIONS)})")
        if kind == "count":
            if not value.isdigit():
                raise IntentError(line, f"count {value!r} is not a positive integer")
            count = int(value)
            if not 1 <= count <= max_train:
                raise IntentError(line, f"count {count} outside 1..{max_train}")
            args.append(count)
            continue
        args.append(value)
    return Intent(verb, tuple(args))


def parse_intents(text: str, rules: Rules | None = None) -> tuple[list[Intent], list[IntentError]]:
    """Parse an agent's reply: one intent per line (``;`` also separates); blank lines are skipped.

    Returns the valid intents in order and one :class:`IntentError` per rejected line. The intent budget is
    not applied here (the executor does, so that over-budget intents are logged as such).
    """
    intents: list[Intent] = []
    errors: list[IntentError] = []
    for line in re.split(r"[\n;]", text):
        if not line.strip():
            continue
        try:
            intents.append(parse_intent(line, rules))
        except IntentError as err:
            errors.append(err)
    return intents, errors


def all_intents(rules: Rules | None = None) -> list[Intent]:
    """Every valid intent under ``rules``: the finite language an LLM agent is constrained to."""
    rules = rules or Rules()
    out: list[Intent] = []
    for verb, kinds in VERBS.items():
        if not kinds:
            out.append(Intent(verb))
        elif kinds == ("building",):
            out.extend(Intent(verb, (b,)) for b in BUILDABLE)
        elif kinds == ("region",):
            out.extend(Intent(verb, (r,)) for r in REGIONS)
        else:
            out.extend(Intent(verb, (u, n)) for u in UNIT_KINDS for n in range(1, rules.max_train + 1))
    return out
