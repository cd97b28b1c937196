"""``torchmetrics`` metrics of the methods: DDP-safe states, synced by torchmetrics itself."""

from lightning_llm.metrics.forecasting import ForecastingMetrics, forecast_outcomes, reliability_bins

__all__ = ["ForecastingMetrics", "forecast_outcomes", "reliability_bins"]
