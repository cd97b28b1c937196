"""Multi-turn environments: what a model talks to between its turns in RL (a search engine, a game).

:class:`~lightning_llm.envs.base.Environment` is the contract (stop strings, a turn budget, ``reset`` /
``step`` / ``reward`` on text); :func:`~lightning_llm.envs.base.run_episode` is the reference loop on text.

:mod:`lightning_llm.envs.rts` is a separate subpackage (imported on its own): a deterministic real-time-strategy
benchmark where agents issue budgeted, typed intents, with an arena, Elo ratings, steerability and replays.
"""

from lightning_llm.envs.base import Environment, EnvReply, Episode, cut_at_stop, run_episode
from lightning_llm.envs.search import (
    INVALID_ACTION,
    BM25Retriever,
    Doc,
    Retriever,
    SearchEnvironment,
    SearchState,
    exact_match,
    final_answer,
    load_corpus,
    normalize_answer,
    parse_action,
)
from lightning_llm.envs.twenty_questions import (
    ATTRIBUTES,
    ITEMS,
    TwentyQuestionsEnvironment,
    TwentyQuestionsState,
    parse_question,
)

__all__ = [
    "ATTRIBUTES",
    "INVALID_ACTION",
    "ITEMS",
    "BM25Retriever",
    "Doc",
    "EnvReply",
    "Environment",
    "Episode",
    "Retriever",
    "SearchEnvironment",
    "SearchState",
    "TwentyQuestionsEnvironment",
    "TwentyQuestionsState",
    "cut_at_stop",
    "exact_match",
    "final_answer",
    "load_corpus",
    "normalize_answer",
    "parse_action",
    "parse_question",
    "run_episode",
]
