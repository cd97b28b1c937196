"""Hand-built ``PolicyLossStep`` s and stand-ins for the module and rollout: RL callbacks tested without a Trainer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_llm.rl import PolicyLossStep


class Recorder:
    """Stand-in for ``pl_module``: keeps the last value logged under each key, as Lightning does within a step."""

    def __init__(self, **hparams: Any) -> None:
        self.logged: dict[str, float] = {}
        self.hparams = SimpleNamespace(**hparams)

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        self.logged[name] = float(value)


def _make_step(
    token_rows: list[int],
    token_positions: list[int],
    *,
    update_index: int = 0,
    logprobs: list[float] | torch.Tensor | None = None,
    old_logprobs: list[float] | None = None,
    advantages: list[float] | None = None,
    entropy: list[float] | None = None,
    s_target: list[float] | None = None,
    n_term: list[float] | None = None,
    loss_mask: list[bool] | None = None,
    learning_rate: float = 0.0,
) -> PolicyLossStep:
    """A step over the given tokens; unspecified per-token values are zeros (log-probs: old = new = -1)."""
    n = len(token_rows)

    def vec(values: list[float] | None, default: float = 0.0) -> torch.Tensor:
        return torch.tensor(values if values is not None else [default] * n, dtype=torch.float32)

    rows = torch.tensor(token_rows)
    new = logprobs if isinstance(logprobs, torch.Tensor) else vec(logprobs, -1.0)
    old = vec(old_logprobs) if old_logprobs is not None else new.detach().clone()
    return PolicyLossStep(
        update_index=update_index,
        rows=rows.unique_consecutive(),
        token_rows=rows,
        token_positions=torch.tensor(token_positions),
        logprobs=new,
        entropy=vec(entropy),
        old_logprobs=old,
        ref_logprobs=None,
        ratio=torch.exp(new - old),
        advantages=vec(advantages),
        loss_mask=torch.tensor(loss_mask) if loss_mask is not None else torch.ones(n, dtype=torch.bool),
        s_target=vec(s_target) if s_target is not None else None,
        n_term=vec(n_term) if n_term is not None else None,
        learning_rate=learning_rate,
    )


def _fake_rollout(num_rows: int, length: int) -> SimpleNamespace:
    """What the callbacks read from a ``Rollout``: its row count and the shape of its token tensors."""
    return SimpleNamespace(num_rows=num_rows, loss_mask=torch.zeros(num_rows, length, dtype=torch.bool))


@pytest.fixture
def make_step():
    return _make_step


@pytest.fixture
def fake_rollout():
    return _fake_rollout


@pytest.fixture
def make_recorder():
    return Recorder
