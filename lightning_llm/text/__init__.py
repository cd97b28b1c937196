"""Text utilities every layer shares: answers in model output, their normalisation, word counts, JSONL records,
strict JSON values; :mod:`lightning_llm.text.pcfg` holds the probabilistic context-free grammars whose sentences
the PCFG data are and whose exact quantities the grammar metrics compare a model with.

Verifiers and rewards parse strictly with regular expressions and never evaluate model output. This package
imports nothing of the library outside itself.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DataSourceError",
    "PromptPrefix",
    "exact_match",
    "extract_answer",
    "finite_json",
    "length_score",
    "normalize_answer",
    "parse_forecast",
    "prefix_messages",
    "read_jsonl",
    "read_text_records",
    "word_count",
]

_PUNCTUATION = frozenset(string.punctuation)

#: What comes before each user prompt in a chat: a system message, or whole messages (a system message and
#: worked user/assistant exchanges, as ``system_prompt="task"`` gives).
PromptPrefix = str | Sequence[Mapping[str, str]] | None


def prefix_messages(prefix: PromptPrefix) -> list[dict[str, str]]:
    """The chat messages of ``prefix``: none, one system message for a string, or a copy of the messages."""
    if not prefix:
        return []
    if isinstance(prefix, str):
        return [{"role": "system", "content": prefix}]
    return [dict(message) for message in prefix]


_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str | None:
    """The content of the *last* ``<answer>…</answer>`` in ``text`` (None if there is none).

    The last tag counts because a model may draft answers while reasoning; only its final one is its answer.
    """
    matches = _ANSWER_RE.findall(text)
    return matches[-1] if matches else None


_LAST_INTEGER_RE = re.compile(r"-?[0-9]+")


def last_integer(text: str) -> str | None:
    """The last integer written anywhere in ``text`` (inside or outside tags), as its digits with an optional
    leading minus and no leading zeros; None if there is none. Lenient scoring reads an answer this way, so that
    a right number in the wrong format still counts."""
    matches = _LAST_INTEGER_RE.findall(text)
    if not matches:
        return None
    digits = matches[-1]
    sign, digits = ("-", digits[1:]) if digits.startswith("-") else ("", digits)
    digits = digits.lstrip("0") or "0"
    return sign + digits if digits != "0" else "0"


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation (as in Search-R1's EM): lower-case, drop punctuation, drop the articles
    a/an/the, collapse whitespace."""
    text = "".join(char for char in text.lower() if char not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str | None, golds: Iterable[str]) -> float:
    """1.0 if ``prediction`` equals one of ``golds`` after :func:`normalize_answer`, else 0.0 (None → 0.0)."""
    if prediction is None:
        return 0.0
    normalized = normalize_answer(prediction)
    return float(any(normalized == normalize_answer(gold) for gold in golds))


_THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)
_TAG = re.compile(r"</?[A-Za-z_][\w-]*>")


def word_count(text: str) -> int:
    """Words of a response as LARFT counts them: whitespace-separated, after removing ``<think>…</think>``.

    Reasoning does not count towards the length (an unclosed ``<think>`` runs to the end of the text), and
    markup tags such as ``<answer>`` are separators, not words.
    """
    visible = _TAG.sub(" ", _THINK_BLOCK.sub(" ", text))
    return len(visible.split())


def length_score(text: str, target: int) -> float:
    r"""LARFT's length reward (arXiv 2603.19255) for one response: :math:`R = \max(0,\ 1 - |L - c| / c)`.

    ``L`` is :func:`word_count` and ``c`` the requested number of words. ``c = 0`` (an empty answer requested)
    has no relative error: 1.0 for an empty response, 0.0 otherwise.

    Raises:
        ValueError: for a negative target.
    """
    if target < 0:
        raise ValueError(f"target word count must be >= 0, got {target}")
    words = word_count(text)
    if target == 0:
        return 1.0 if words == 0 else 0.0
    return max(0.0, 1.0 - abs(words - target) / target)


# OpenForecaster's output format: ``<answer>…</answer><probability>q</probability>`` (whitespace allowed between
# and inside the tags; q a plain decimal, no percent sign, no exponent).
_FORECAST = re.compile(
    r"<answer>([^<>]*)</answer>\s*<probability>\s*(\d+(?:\.\d*)?|\.\d+)\s*</probability>", re.DOTALL
)


def parse_forecast(text: str) -> tuple[str, float] | None:
    """``(answer, q)`` from the last ``<answer>…</answer><probability>q</probability>`` of ``text``, else None.

    Strict, and never raises: the answer is the stripped, non-empty, tag-free content of the last ``<answer>``
    tag, which must be immediately followed (whitespace aside) by a ``<probability>`` holding a plain decimal
    in ``[0, 1]``. A later ``<answer>`` without its probability makes the whole text unparsable (the model's
    final answer has no confidence), as do ``q > 1``, ``70%`` and ``1e-1``.
    """
    if not isinstance(text, str):
        return None
    matches = list(_FORECAST.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    if text.rfind("<answer>") != last.start():
        return None
    answer, q = last.group(1).strip(), float(last.group(2))
    if not answer or not 0.0 <= q <= 1.0:
        return None
    return answer, q


class DataSourceError(ValueError):
    """Bad input data; the message names the source, the record (line for JSONL) and the column."""


def read_jsonl(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataSourceError(
                    f"{where}: malformed JSON ({error.msg} at column {error.colno})"
                ) from None
            if not isinstance(record, dict):
                raise DataSourceError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record


def read_text_records(
    path: str | Path, columns: Sequence[str], schema: str
) -> Iterator[tuple[str, Mapping[str, Any], list[str]]]:
    """Non-empty JSONL records of a corpus file whose ``columns`` are all strings: ``(where, record, values)``.

    The one validation every corpus loader shares (search documents, dated news): a missing file is a
    ``FileNotFoundError``; a missing or non-string column a :class:`DataSourceError` naming the file, line and
    column, with ``schema`` (e.g. ``"{'title': str, 'text': str}"``) saying what a line should be; a file with no
    record at all a :class:`DataSourceError` too.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such corpus file")
    empty = True
    for where, record in read_jsonl(path):
        values = []
        for column in columns:
            value = record.get(column)
            if not isinstance(value, str):
                problem = "missing column" if column not in record else f"{type(value).__name__} in column"
                raise DataSourceError(
                    f"{where}: {problem} {column!r} (a corpus line is {schema}); the record has columns "
                    f"{sorted(record)}"
                )
            values.append(value)
        empty = False
        yield where, record, values
    if empty:
        raise DataSourceError(f"{path}: no documents (empty corpus file)")


def finite_json(value: Any) -> Any:
    """``value`` with every NaN or infinite float (nested in dicts, lists and tuples) replaced by ``None``, so that
    ``json.dumps(..., allow_nan=False)`` writes it as strict JSON (``null`` where a figure does not exist)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value
