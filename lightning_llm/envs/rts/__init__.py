"""A deterministic real-time-strategy benchmark for long-horizon agents (docs/methods.md §5).

Agents do not micro-manage: every ``Rules.decision_interval`` ticks they issue a budgeted handful of typed
macro/tactical intents (:mod:`~lightning_llm.envs.rts.intents`), which a deterministic executor carries out
(:mod:`~lightning_llm.envs.rts.world`, on the map of :mod:`~lightning_llm.envs.rts.map`) and answers with what
the player sees (:mod:`~lightning_llm.envs.rts.observation`). Rules are data with named perturbation presets
(:mod:`~lightning_llm.envs.rts.rules`); matches, language interventions and steerability are in
:mod:`~lightning_llm.envs.rts.match`; scripted agents in :mod:`~lightning_llm.envs.rts.agents`, the LLM agent
(grammar-constrained decoding, any backbone) in :mod:`~lightning_llm.envs.rts.llm_agent`; round-robin Elo and
Bradley–Terry ratings in :mod:`~lightning_llm.envs.rts.arena`; replay files, exact re-simulation and rendering in
:mod:`~lightning_llm.envs.rts.replay`.

>>> from lightning_llm.envs.rts import BalancedAgent, RushAgent, play_match
>>> result = play_match([BalancedAgent(), RushAgent()], seed=0)
>>> result.winner
0
"""

from lightning_llm.envs.rts.agents import (
    BalancedAgent,
    NoisyAgent,
    PassiveAgent,
    RandomAgent,
    RushAgent,
    ScriptedAgent,
    TurtleAgent,
)
from lightning_llm.envs.rts.arena import ArenaResult, Game, Rating, RTSArena, bradley_terry, elo
from lightning_llm.envs.rts.intents import (
    REGIONS,
    Intent,
    IntentError,
    all_intents,
    parse_intent,
    parse_intents,
)
from lightning_llm.envs.rts.llm_agent import LLMAgent
from lightning_llm.envs.rts.match import (
    STANDARD_INSTRUCTIONS,
    Agent,
    Instruction,
    Intervention,
    MatchResult,
    Steerability,
    play_match,
    steerability,
)
from lightning_llm.envs.rts.observation import Observation, Outcome
from lightning_llm.envs.rts.replay import load_replay, render_replay, replay_dict, resimulate, save_replay
from lightning_llm.envs.rts.rules import PRESETS, Rules, rules_preset
from lightning_llm.envs.rts.world import LOG_FIELDS, World

__all__ = [
    "LOG_FIELDS",
    "PRESETS",
    "REGIONS",
    "STANDARD_INSTRUCTIONS",
    "Agent",
    "ArenaResult",
    "BalancedAgent",
    "Game",
    "Instruction",
    "Intent",
    "IntentError",
    "Intervention",
    "LLMAgent",
    "MatchResult",
    "NoisyAgent",
    "Observation",
    "Outcome",
    "PassiveAgent",
    "RTSArena",
    "RandomAgent",
    "Rating",
    "Rules",
    "RushAgent",
    "ScriptedAgent",
    "Steerability",
    "TurtleAgent",
    "World",
    "all_intents",
    "bradley_terry",
    "elo",
    "load_replay",
    "parse_intent",
    "parse_intents",
    "play_match",
    "render_replay",
    "replay_dict",
    "resimulate",
    "rules_preset",
    "save_replay",
    "steerability",
]
