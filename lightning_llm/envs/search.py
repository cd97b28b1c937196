"""Search-R1's retrieval environment: the model searches a corpus in ``<search>`` tags and answers in ``<answer>``.

Protocol (Jin et al., 2025, "Search-R1", arXiv 2503.09516; the environment of LLDS, arXiv 2512.04220)::

    <think>free reasoning</think><search>query</search>          → observation: top-k documents
    \\n\\n<information>Doc 1(Title: …) …\\nDoc 2(Title: …) …</information>\\n\\n
    <think>…</think><answer>final answer</answer>                → episode over

A model turn ends at ``</search>`` or ``</answer>`` (or EOS). A turn whose action is not a well-formed search or
answer gets Search-R1's fixed "My previous action is invalid…" message and the episode goes on. The reward is
exact match (SQuAD normalisation) of the *last* ``<answer>`` against the gold answer(s).

The observation strings (``\\n\\n<information>…</information>\\n\\n``, ``Doc i(Title: t) text``) and the invalid
message are Search-R1's own, so a model trained here sees the format of the paper's released checkpoints.
Search-R1 uses an E5 dense retriever over Wikipedia; here the retriever is BM25 (``bm25s``) behind the small
:class:`Retriever` interface, so a dense one can be plugged in.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_llm.envs.base import Environment, EnvReply, cut_at_stop
from lightning_llm.text import exact_match, normalize_answer, read_text_records
from lightning_llm.types import Doc

if TYPE_CHECKING:
    from lightning_llm.types import Example

__all__ = [
    "INVALID_ACTION",
    "BM25Retriever",
    "Doc",
    "Retriever",
    "SearchEnvironment",
    "SearchState",
    "exact_match",
    "final_answer",
    "load_corpus",
    "normalize_answer",
    "parse_action",
]

#: Search-R1's observation for a turn without a well-formed action (verbatim, newlines included).
INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
_NO_RESULTS = "No results."
# Every tag of the protocol. Retrieved text is stripped of them (a document saying "<answer>x</answer>" must
# not become the model's answer), and an action's content may not contain one (nested or unclosed tags).
_PROTOCOL_TAG_RE = re.compile(r"</?(?:think|search|answer|information)>")
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INFORMATION_RE = re.compile(r"<information>.*?</information>", re.DOTALL)


class Retriever(ABC):
    """Anything that maps a query to documents; the only thing :class:`SearchEnvironment` needs to search."""

    @abstractmethod
    def search(self, query: str, k: int) -> list[Doc]:
        """The at most ``k`` best documents for ``query``, best first (fewer, or none, if fewer match)."""


class BM25Retriever(Retriever):
    """Okapi BM25 (Lucene variant, ``k1=1.5``, ``b=0.75``) with ``bm25s``, over each document's title and text.

    Tokens are lower-cased words of two or more characters, English stop words removed, no stemming. Only
    documents that share a token with the query are returned: a query of unknown words gets no results
    rather than arbitrary documents.
    """

    def __init__(self, docs: Sequence[Doc]) -> None:
        import bm25s  # deferred: importing the tasks package must not pay for it

        if not docs:
            raise ValueError("BM25Retriever needs at least one document")
        self.docs = list(docs)
        self._index = bm25s.BM25()
        self._index.index(
            self._tokenize([f"{doc.title} {doc.text}" for doc in self.docs]), show_progress=False
        )

    def search(self, query: str, k: int) -> list[Doc]:
        tokens = self._tokenize([query])
        if not tokens[0] or k < 1:
            return []
        ids, scores = self._index.retrieve(tokens, k=min(k, len(self.docs)), show_progress=False)
        return [
            self.docs[i] for i, score in zip(ids[0].tolist(), scores[0].tolist(), strict=True) if score > 0
        ]

    @staticmethod
    def _tokenize(texts: list[str]) -> list[list[str]]:
        import bm25s

        return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


def load_corpus(path: str | Path) -> list[Doc]:
    """Documents from a JSONL file with one ``{"title": str, "text": str}`` object per line (blank lines and
    other keys ignored). Raises :class:`~lightning_llm.datamodules.DataSourceError` naming the file, line and
    column of the first bad record."""
    schema = "{'title': str, 'text': str}"
    return [Doc(*values) for _, _, values in read_text_records(path, ("title", "text"), schema)]


# --------------------------------------------------------------------------------------------- answers


def final_answer(completion: str) -> str | None:
    """The content of the last ``<answer>…</answer>`` the *model* wrote in ``completion`` (None if none).

    Observations are removed first: ``<information>`` blocks and the invalid-action message (which itself
    says "between <answer> and </answer>" and would otherwise read as the answer " and ").
    """
    model_text = _INFORMATION_RE.sub("", completion.replace(INVALID_ACTION, ""))
    matches = _ANSWER_RE.findall(model_text)
    return matches[-1] if matches else None


def parse_action(turn: str) -> tuple[str, str] | None:
    """``("search", query)`` or ``("answer", answer)`` for a well-formed turn, else None. Never raises.

    The turn is read up to its first stop string (``</search>`` or ``</answer>``), which must close the first
    matching opening tag before it; the content between them is stripped and must be non-empty and free of
    protocol tags (no nesting). Text before the opening tag (reasoning) is free. So ``<think>…</think>
    <search>q</search>`` is a search, while ``<search>q``, ``<search> </search>``, ``q</search>`` and
    ``<search>a <search>b</search>`` are invalid.
    """
    cut = cut_at_stop(turn, SearchEnvironment.stop_strings)
    for action in ("search", "answer"):
        close = f"</{action}>"
        if cut.endswith(close):
            start = cut.find(f"<{action}>")
            if start < 0:
                return None
            content = cut[start + len(action) + 2 : len(cut) - len(close)].strip()
            if not content or _PROTOCOL_TAG_RE.search(content):
                return None
            return action, content
    return None


# --------------------------------------------------------------------------------------------- environment


@dataclass
class SearchState:
    """One episode of :class:`SearchEnvironment` (plain, picklable).

    Attributes:
        turns: Model turns taken so far.
        queries: The queries searched, in order.
        invalid: Turns answered with the invalid-action message.
        done: Whether the episode is over.
    """

    turns: int = 0
    queries: list[str] = field(default_factory=list)
    invalid: int = 0
    done: bool = False


class SearchEnvironment(Environment):
    """Search-R1's environment: retrieve with ``<search>``, finish with ``<answer>``, reward = exact match.

    The corpus is one of: a JSONL path (see :func:`load_corpus`), a list of :class:`Doc`, or a
    :class:`Retriever` (anything searchable, e.g. a dense index). A synthetic task with a knowledge base builds
    its own environment (``MultiHopQATask.make_env``; ``GRPOModule(env="task")`` asks the DataModule's task).

    Args:
        corpus: JSONL path, documents or retriever.
        corpus_id: Identifies the knowledge base; examples whose ``metadata["corpus_id"]`` names another one
            are refused (None: not checked).
        top_k: Documents per search (Search-R1: 3).
        max_turns: Most model turns per episode; the turn that reaches it ends the episode without an
            observation. A 2-hop question answered by the book takes 3 turns (search, search, answer).
        max_observation_chars: Most characters of retrieved text per observation: when the documents exceed
            it, each document's text is cut to an equal share (titles are kept, as is the closing tag).

    Rewards: ``exact_match(final_answer(completion), golds)``, the golds being ``example.answer`` and any
    ``example.metadata["golden_answers"]`` (a string or a list of strings, Search-R1's data format).
    """

    stop_strings = ("</search>", "</answer>")

    def __init__(
        self,
        corpus: str | Path | Sequence[Doc] | Retriever,
        *,
        corpus_id: str | None = None,
        top_k: int = 3,
        max_turns: int = 4,
        max_observation_chars: int = 2000,
    ) -> None:
        for name, value, low in (
            ("top_k", top_k, 1),
            ("max_turns", max_turns, 1),
            ("max_observation_chars", max_observation_chars, 1),
        ):
            if value < low:
                raise ValueError(f"SearchEnvironment: {name} must be >= {low}, got {value}")
        self.top_k = top_k
        self.max_turns = max_turns
        self.max_observation_chars = max_observation_chars
        #: Identifies the knowledge base; examples carrying another ``corpus_id`` are refused.
        self.corpus_id = corpus_id
        if isinstance(corpus, Retriever):
            self.retriever = corpus
        elif isinstance(corpus, str | Path):
            self.retriever = BM25Retriever(load_corpus(corpus))
        else:
            self.retriever = BM25Retriever(corpus)

    def reset(self, example: Example) -> SearchState:
        theirs = example.metadata.get("corpus_id")
        if theirs is not None and self.corpus_id is not None and theirs != self.corpus_id:
            raise ValueError(
                f"example is about knowledge base {theirs!r} but this environment searches {self.corpus_id!r}: "
                "build the environment from the data's task (task.make_env())"
            )
        return SearchState()

    def step(self, state: SearchState, turn: str) -> EnvReply:
        if state.done:
            return EnvReply(None, done=True)
        state.turns += 1
        action = parse_action(turn)
        if (action is not None and action[0] == "answer") or state.turns >= self.max_turns:
            state.done = True
            return EnvReply(None, done=True)
        if action is None:
            state.invalid += 1
            return EnvReply(INVALID_ACTION, done=False)
        query = action[1]
        state.queries.append(query)
        return EnvReply(self.information(self.retriever.search(query, self.top_k)), done=False)

    def reward(self, state: SearchState, example: Example, completion: str) -> float:
        golds = example.metadata.get("golden_answers") or ()
        golds = [golds] if isinstance(golds, str) else [gold for gold in golds if isinstance(gold, str)]
        if example.answer:
            golds.append(example.answer)
        return exact_match(final_answer(completion), golds)

    def information(self, docs: Sequence[Doc]) -> str:
        """The observation for retrieved ``docs``, in Search-R1's format, within ``max_observation_chars``."""
        if not docs:
            return f"\n\n<information>{_NO_RESULTS}</information>\n\n"
        heads = [f"Doc {i}(Title: {_clean(doc.title)}) " for i, doc in enumerate(docs, start=1)]
        texts = [_clean(doc.text) for doc in docs]
        excess = sum(map(len, heads)) + sum(map(len, texts)) + len(docs) - self.max_observation_chars
        if excess > 0:
            share = max(0, self.max_observation_chars - sum(map(len, heads)) - len(docs)) // len(docs)
            texts = [_shorten(text, share) for text in texts]
        body = "".join(f"{head}{text}\n" for head, text in zip(heads, texts, strict=True))
        return f"\n\n<information>{body[: self.max_observation_chars].strip()}</information>\n\n"


def _shorten(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, the cut marked with "..." where there is room."""
    if len(text) <= limit:
        return text
    return text[: limit - 3] + "..." if limit > 3 else text[:limit]


def _clean(text: str) -> str:
    """Retrieved text without protocol tags or line breaks (one document, one line)."""
    return " ".join(_PROTOCOL_TAG_RE.sub("", text).split())
