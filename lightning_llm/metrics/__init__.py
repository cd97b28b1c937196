"""``torchmetrics`` metrics of the methods: DDP-safe states, synced by torchmetrics itself."""

from lightning_llm.metrics.forecasting import ForecastingMetrics, forecast_outcomes, reliability_bins
from lightning_llm.metrics.grammar import GrammarKL, NGramModel, grammar_kl, model_next_token_logprobs
from lightning_llm.metrics.safety import (
    KeywordJudge,
    LLMJudge,
    SafetyJudge,
    SafetyMetrics,
    evaluate_safety,
    safety_outcomes,
)

__all__ = [
    "ForecastingMetrics",
    "GrammarKL",
    "KeywordJudge",
    "LLMJudge",
    "NGramModel",
    "SafetyJudge",
    "SafetyMetrics",
    "evaluate_safety",
    "forecast_outcomes",
    "grammar_kl",
    "model_next_token_logprobs",
    "reliability_bins",
    "safety_outcomes",
]
