"""The RL contract modules and callbacks share: :class:`Rollout` (what a step generated), the rollout engine
(generation behind one interface, multi-turn episodes), and :class:`RLCallback` with its hook points."""

from lightning_llm.rl.callback import PolicyLossStep, RLCallback
from lightning_llm.rl.engine import HFEngine, RolloutEngine, Sampling, left_pad, run_episodes
from lightning_llm.rl.rollout import Rollout

__all__ = [
    "HFEngine",
    "PolicyLossStep",
    "RLCallback",
    "Rollout",
    "RolloutEngine",
    "Sampling",
    "left_pad",
    "run_episodes",
]
