"""``torchmetrics`` metrics of the methods: DDP-safe states, synced by torchmetrics itself."""

from lightning_llm.metrics.forecasting import ForecastingMetrics, forecast_outcomes, reliability_bins
from lightning_llm.metrics.grammar import (
    GrammarKL,
    NGramModel,
    grammar_kl,
    model_next_token_logprobs,
    prefix_batches,
)
from lightning_llm.metrics.intervals import wilson_interval
from lightning_llm.metrics.perplexity import perplexity, token_nll, token_nll_sum
from lightning_llm.metrics.sae import (
    DeadFeatures,
    DeltaLoss,
    ExplainedVariance,
    MeanL0,
    SAELike,
    SequenceMSE,
    delta_loss,
    spliced_nll,
)
from lightning_llm.metrics.safety import (
    KeywordJudge,
    LLMJudge,
    SafetyJudge,
    SafetyMetrics,
    evaluate_safety,
    safety_outcomes,
)
from lightning_llm.text.pcfg import PCFG, Constituent  # the grammar the grammar metrics score against

__all__ = [
    "PCFG",
    "Constituent",
    "DeadFeatures",
    "DeltaLoss",
    "ExplainedVariance",
    "ForecastingMetrics",
    "GrammarKL",
    "KeywordJudge",
    "LLMJudge",
    "MeanL0",
    "NGramModel",
    "SAELike",
    "SafetyJudge",
    "SafetyMetrics",
    "SequenceMSE",
    "delta_loss",
    "evaluate_safety",
    "forecast_outcomes",
    "grammar_kl",
    "model_next_token_logprobs",
    "perplexity",
    "prefix_batches",
    "reliability_bins",
    "safety_outcomes",
    "spliced_nll",
    "token_nll",
    "token_nll_sum",
    "wilson_interval",
]
