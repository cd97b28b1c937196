"""LLDS on hand-built steps: where it fires, its value, its gradient, and that it is zero while π_θ = π_old."""

from __future__ import annotations

import pytest
import torch

from lightning_llm.callbacks import LLDSRegularizer
from lightning_llm.callbacks.llds import llds_gate, llds_loss, segment_index

# Mini-batch rows [1, 0] flattened row-major. Row 1 (A < 0) has tokens at columns 3-5; row 0 (A > 0) has three
# actions at columns 6-8 | 11-12 | 14, separated by masked tool tokens (9-10, 13). Row 0's first column (6)
# follows row 1's last (5): the row change alone must start a new action.
ROWS = [1, 1, 1, 0, 0, 0, 0, 0, 0]
COLS = [3, 4, 5, 6, 7, 8, 11, 12, 14]
ADVANTAGES = [-1.0] * 3 + [1.0] * 6
# Δ = log π_old − log π_θ. Row 1 fell, but A < 0: ignored. Action 6-8 sums to 0.4 > 0 (gated, its Δ > 0 parts
# 0.4 and 0.1 count); action 11-12 sums to −0.2 (not gated, though its first token fell); action 14: 0.2.
DELTA = [0.5, 0.5, 0.5, 0.4, -0.1, 0.1, 0.3, -0.5, 0.2]
N = len(ROWS)
ACTION_VALUE = 0.2 * (0.4 + 0.1 + 0.2) / N
RESPONSE_VALUE = 0.2 * (0.4 + 0.1 + 0.3 + 0.2) / N  # row 0 sums to 0.4 > 0: all its tokens are gated


def _step(make_step, update_index=1):
    old = torch.full((N,), -1.0)
    logprobs = (old - torch.tensor(DELTA)).requires_grad_()
    return make_step(
        ROWS,
        COLS,
        update_index=update_index,
        logprobs=logprobs,
        old_logprobs=old.tolist(),
        advantages=ADVANTAGES,
    )


def _loss(step, gate="action"):
    return llds_loss(
        step.logprobs, step.old_logprobs, step.advantages, step.token_rows, step.token_positions, gate=gate
    )


def test_segments():
    rows, cols = torch.tensor(ROWS), torch.tensor(COLS)
    assert segment_index(rows, cols).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3]
    assert segment_index(rows).tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert segment_index(torch.tensor([], dtype=torch.long)).tolist() == []


@pytest.mark.parametrize(
    ("gate", "value", "gated"),
    [
        ("action", ACTION_VALUE, [0, 0, 0, 1, 1, 1, 0, 0, 1]),
        ("response", RESPONSE_VALUE, [0, 0, 0, 1, 1, 1, 1, 1, 1]),
    ],
)
def test_llds_value_gate_and_gradient(make_step, gate, value, gated):
    step = _step(make_step)
    loss, mask = _loss(step, gate)
    assert mask.tolist() == [bool(g) for g in gated]
    assert loss.item() == pytest.approx(value)
    loss.backward()
    # ∂L/∂log π_θ(y_t) = −λ/n on gated tokens whose own likelihood fell, 0 elsewhere
    expected = [-0.2 / N if g and d > 0 else 0.0 for g, d in zip(gated, DELTA, strict=True)]
    assert step.logprobs.grad.tolist() == pytest.approx(expected)


def test_llds_zero_while_policy_is_old(make_step):
    logprobs = torch.tensor([-0.3, -2.0, -0.7, -1.1], requires_grad=True)
    step = make_step([0, 0, 1, 1], [2, 3, 2, 4], logprobs=logprobs, advantages=[1.0, 1.0, 0.0, 0.0])
    for gate in ("action", "response"):
        loss, mask = _loss(step, gate)
        assert loss.item() == 0.0 and not mask.any()
        loss.backward()
        assert not logprobs.grad.any()


def test_llds_gate_advantage_condition():
    delta, rows, cols = torch.tensor([0.1, 0.1]), torch.tensor([0, 1]), torch.tensor([2, 2])
    assert llds_gate(delta, torch.tensor([0.0, -0.5]), rows, cols).tolist() == [True, False]  # A >= 0 only


def test_callback_returns_term_and_logs(make_step, fake_rollout, make_recorder):
    callback, module, rollout = LLDSRegularizer(), make_recorder(), fake_rollout(2, 16)
    assert callback.name == "LLDS" and not callback.needs_old_logprobs and not callback.needs_entropy_dynamics
    step = _step(make_step, update_index=0)
    loss = callback.on_policy_loss(None, module, rollout, step)
    assert loss.item() == pytest.approx(ACTION_VALUE)
    assert step.loss_mask.all()  # a loss term, not a token filter
    assert module.logged["train/LLDS/fire_rate"] == pytest.approx(4 / N)
    loglik_pos = -1.0 - sum(DELTA[3:]) / 6  # token mean of log π_θ over row 0, the A > 0 response
    assert module.logged["train/LLDS/loglik_pos"] == pytest.approx(loglik_pos)
    # a second update with nothing gated: running means over the rollout batch's 9 + 2 tokens
    neutral = make_step([0, 1], [2, 2], update_index=1, logprobs=[-2.0, -1.0], advantages=[1.0, -1.0])
    assert callback.on_policy_loss(None, module, rollout, neutral).item() == 0.0
    assert module.logged["train/LLDS/fire_rate"] == pytest.approx(4 / 11)
    assert module.logged["train/LLDS/loglik_pos"] == pytest.approx((6 * loglik_pos - 2.0) / 7)


def test_callback_response_gate_and_validation(make_step, fake_rollout, make_recorder):
    module = make_recorder()
    loss = LLDSRegularizer(coef=0.5, gate="response").on_policy_loss(
        None, module, fake_rollout(2, 16), _step(make_step)
    )
    assert loss.item() == pytest.approx(RESPONSE_VALUE * 0.5 / 0.2)
    assert module.logged["train/LLDS/fire_rate"] == pytest.approx(6 / N)
    with pytest.raises(ValueError, match="coef"):
        LLDSRegularizer(coef=-1.0)
    with pytest.raises(ValueError, match="gate"):
        LLDSRegularizer(gate="token")
