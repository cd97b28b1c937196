"""``torchmetrics`` metrics of the methods: DDP-safe states, synced by torchmetrics itself."""

from lightning_llm.metrics.forecasting import ForecastingMetrics, forecast_outcomes, reliability_bins
from lightning_llm.metrics.grammar import GrammarKL, NGramModel, grammar_kl, model_next_token_logprobs

__all__ = [
    "ForecastingMetrics",
    "GrammarKL",
    "NGramModel",
    "forecast_outcomes",
    "grammar_kl",
    "model_next_token_logprobs",
    "reliability_bins",
]
