"""Analyses of trained models that are not training signals: geometry of steering directions, detectors."""

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
    "ConceptDetector",
    "CylindricalAnalysis",
    "LLMJudgeDetector",
    "RegexConceptDetector",
    "Steerability",
    "sector_predictability",
    "steerability",
    "steerability_correlation",
    "steered_generations",
]
