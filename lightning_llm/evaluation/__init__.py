"""Analyses of trained models that are not training signals: geometry of steering directions, detectors, and
benchmark coresets (RepCore and its baselines)."""

from lightning_llm.evaluation.repcore import (
    Alignment,
    AnchorPoints,
    AnchorRidge,
    IRTCoreset,
    RandomCoreset,
    RepCore,
    align_representations,
    extract_hidden_states,
    score_multiple_choice,
    spearman,
)
from lightning_llm.evaluation.steering import (
    ConceptDetector,
    CylindricalAnalysis,
    LLMJudgeDetector,
    RegexConceptDetector,
    Steerability,
    sector_predictability,
    steerability,
    steerability_correlation,
    steered_generations,
)

__all__ = [
    "Alignment",
    "AnchorPoints",
    "AnchorRidge",
    "ConceptDetector",
    "CylindricalAnalysis",
    "IRTCoreset",
    "LLMJudgeDetector",
    "RandomCoreset",
    "RegexConceptDetector",
    "RepCore",
    "Steerability",
    "align_representations",
    "extract_hidden_states",
    "score_multiple_choice",
    "sector_predictability",
    "spearman",
    "steerability",
    "steerability_correlation",
    "steered_generations",
]
