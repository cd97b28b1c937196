"""Callbacks, one file per method.

Placement rule (see :mod:`lightning_llm`): every Lightning ``Callback`` of the library lives here, whatever the
method it serves (:class:`ExpertPruning` for :mod:`lightning_llm.pruning`, :class:`TrellisQuantization` for
:mod:`lightning_llm.quantization`, :class:`LoRARestart` and :class:`ScaLoRA` for :mod:`lightning_llm.lora`); the
method's non-Lightning building blocks stay in its feature package, which the callback imports. The base class
of the RL callbacks, :class:`lightning_llm.rl.RLCallback`, is part of the RL contract in :mod:`lightning_llm.rl`.
"""

from lightning_llm.callbacks.delta_belief import DeltaBeliefReward
from lightning_llm.callbacks.entropy import EntropyDiscriminatorClipping, EntropyDynamicsMonitor
from lightning_llm.callbacks.expert_pruning import ExpertPruning
from lightning_llm.callbacks.gsnr import GradientSNRMonitor, gradient_snr
from lightning_llm.callbacks.interrupt import InterruptCheckpoint
from lightning_llm.callbacks.larft import HindsightLengthAwareness
from lightning_llm.callbacks.latent_thoughts import LatentThoughtsCurriculum
from lightning_llm.callbacks.llds import LLDSRegularizer
from lightning_llm.callbacks.lora_restart import LoRARestart
from lightning_llm.callbacks.pcfg import GrammarKLMonitor, LayerwiseProbe
from lightning_llm.callbacks.recontext import Recontextualization
from lightning_llm.callbacks.safety import SafetyEvaluation
from lightning_llm.callbacks.scalora import ScaLoRA
from lightning_llm.callbacks.sft_warmup import SFTWarmup
from lightning_llm.callbacks.steering import ActivationSteering, train_steering_vector
from lightning_llm.callbacks.task_accuracy import PhrasingAccuracy, TaskAccuracy
from lightning_llm.callbacks.trellis_quantization import TrellisQuantization
from lightning_llm.callbacks.update_rank import UpdateRankMonitor

__all__ = [
    "ActivationSteering",
    "DeltaBeliefReward",
    "EntropyDiscriminatorClipping",
    "EntropyDynamicsMonitor",
    "ExpertPruning",
    "GradientSNRMonitor",
    "GrammarKLMonitor",
    "HindsightLengthAwareness",
    "InterruptCheckpoint",
    "LLDSRegularizer",
    "LatentThoughtsCurriculum",
    "LayerwiseProbe",
    "LoRARestart",
    "PhrasingAccuracy",
    "Recontextualization",
    "SFTWarmup",
    "SafetyEvaluation",
    "ScaLoRA",
    "TaskAccuracy",
    "TrellisQuantization",
    "UpdateRankMonitor",
    "gradient_snr",
    "train_steering_vector",
]
