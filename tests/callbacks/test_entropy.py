"""Clip_B / Clip_V masks on hand-built tensors, the clipping callback, and the entropy-dynamics monitor."""

from __future__ import annotations

import io

import pytest
import torch

from lightning_llm.callbacks import EntropyDiscriminatorClipping, EntropyDynamicsMonitor
from lightning_llm.callbacks.entropy import clip_batch_mask, clip_vocab_mask


def t(values):
    return torch.tensor(values, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ Clip_B


def test_clip_batch_drops_only_negative_advantage_outliers():
    s = t([0.0] * 15 + [-4.0])  # mean -0.25, std sqrt(15/16): the last token sits 3.9 std below
    assert clip_batch_mask(s, t([-1.0] * 16)).tolist() == [False] * 15 + [True]
    assert not clip_batch_mask(s, t([1.0] * 16)).any()  # same token, positive advantage: kept
    assert not clip_batch_mask(s, t([0.0] * 16)).any()  # zero advantage: kept
    assert not clip_batch_mask(s, t([-1.0] * 16), mu=4.0).any()  # 3.9 std is not below -4 std


def test_clip_batch_threshold_is_strict():
    s = t([1.0, 1.0, -1.0, -1.0])  # mean 0, population std 1: the -1s sit exactly 1 std below
    advantages = t([-1.0, -1.0, -1.0, -1.0])
    assert not clip_batch_mask(s, advantages, mu=1.0).any()
    assert clip_batch_mask(s, advantages, mu=0.999).tolist() == [False, False, True, True]
    assert clip_batch_mask(s, t([-1.0, 1.0, 0.0, -1.0]), mu=0.5).tolist() == [False, False, False, True]


def test_clip_batch_degenerate_inputs_drop_nothing():
    assert not clip_batch_mask(t([0.3] * 5), t([-1.0] * 5), mu=0.1).any()  # std 0
    assert clip_batch_mask(t([]), t([])).shape == (0,)


# ------------------------------------------------------------------------------------------------ Clip_V


def test_clip_vocab_threshold_on_x_and_negative_advantages():
    x = t([8.0, 8.0, 0.0, 0.0, 0.0, 0.0, -8.0, -8.0])  # std sqrt(32) = 5.66
    s, n = t([0.1] * 8), t([0.1] * 8) + x
    drop = clip_vocab_mask(s, n, t([-1.0] * 8), mu=1.0, max_fraction=0.25)  # k = 2
    assert drop.tolist() == [True, True] + [False] * 6
    drop = clip_vocab_mask(s, n, t([1.0, -1.0] + [-1.0] * 6), mu=1.0, max_fraction=0.25)
    assert drop.tolist() == [False, True] + [False] * 6
    assert not clip_vocab_mask(s, n, t([-1.0] * 8), mu=1.5, max_fraction=0.25).any()  # 8 < 1.5 * 5.66


def test_clip_vocab_caps_at_top_k_by_x():
    s = t([0.0] * 8)
    n = t([8.0, 9.0, 0.0, 0.0, 0.0, 0.0, -8.0, -9.0])  # both 8 and 9 exceed 1 std (6.02)
    drop = clip_vocab_mask(s, n, t([-1.0] * 8), mu=1.0, max_fraction=0.125)  # k = 1: the largest x only
    assert drop.tolist() == [False, True] + [False] * 6
    # the cap picks among candidates: with the largest x at a positive advantage, the next one goes
    drop = clip_vocab_mask(s, n, t([-1.0, 1.0] + [-1.0] * 6), mu=1.0, max_fraction=0.125)
    assert drop.tolist() == [True] + [False] * 7


def test_clip_vocab_k_zero_drops_nothing():
    s, n = t([0.0] * 8), t([8.0, 9.0, 0.0, 0.0, 0.0, 0.0, -8.0, -9.0])
    assert not clip_vocab_mask(s, n, t([-1.0] * 8), mu=1.0, max_fraction=0.1).any()  # floor(0.8) = 0
    assert not clip_vocab_mask(s, n, t([-1.0] * 8)).any()  # paper defaults: k = 0 below 10 000 tokens


def test_clip_vocab_paper_defaults_on_ten_thousand_tokens():
    x = torch.zeros(10_000)
    x[5], x[7] = 1000.0, 900.0  # std ~13.4: both beyond 8.5 std, but k = floor(1e-4 * 10 000) = 1
    drop = clip_vocab_mask(torch.zeros(10_000), x, -torch.ones(10_000))
    assert drop.nonzero().flatten().tolist() == [5]


# ------------------------------------------------------------------------------------------ the callback


def test_clipping_callback_edits_mask_and_logs_running_fraction(make_step, fake_rollout, make_recorder):
    callback, module, rollout = EntropyDiscriminatorClipping(mu=0.5), make_recorder(), fake_rollout(2, 8)
    assert (
        callback.name == "Clip_B"
        and callback.needs_entropy_dynamics
        and EntropyDiscriminatorClipping().mu == 2.5
    )
    step = make_step(
        [0, 0, 1, 1],
        [2, 3, 2, 3],
        s_target=[1.0, 1.0, -1.0, -1.0],
        n_term=[0.0] * 4,
        advantages=[1.0, 1.0, -1.0, 1.0],
        loss_mask=[False, True, True, True],  # an earlier callback's drop stays
    )
    assert callback.on_policy_loss(None, module, rollout, step) is None
    assert step.loss_mask.tolist() == [False, True, False, True]
    assert module.logged["train/Clip_B/clipped_frac"] == pytest.approx(1 / 4)
    step = make_step([0, 1], [2, 2], update_index=1, s_target=[0.0, 0.0], n_term=[0.0, 0.0])
    callback.on_policy_loss(None, module, rollout, step)
    assert module.logged["train/Clip_B/clipped_frac"] == pytest.approx(1 / 6)  # 1 of 6 tokens this batch
    step = make_step([0], [2], update_index=0, s_target=[0.0], n_term=[0.0])
    callback.on_policy_loss(None, module, rollout, step)  # a new rollout batch starts the count afresh
    assert module.logged["train/Clip_B/clipped_frac"] == 0.0


def test_clipping_callback_vocab_mode(make_step, fake_rollout, make_recorder):
    callback, module = EntropyDiscriminatorClipping("vocab", mu=1.0, max_fraction=0.125), make_recorder()
    assert callback.name == "Clip_V" and EntropyDiscriminatorClipping("vocab").mu == 8.5
    step = make_step(
        list(range(8)),
        [2] * 8,
        s_target=[0.0] * 8,
        n_term=[8.0, 9.0, 0.0, 0.0, 0.0, 0.0, -8.0, -9.0],
        advantages=[-1.0] * 8,
    )
    assert callback.on_policy_loss(None, module, fake_rollout(8, 4), step) is None
    assert step.loss_mask.tolist() == [True, False] + [True] * 6
    assert module.logged["train/Clip_V/clipped_frac"] == pytest.approx(1 / 8)


def test_clipping_callback_errors(make_step, fake_rollout, make_recorder):
    with pytest.raises(ValueError, match="mode"):
        EntropyDiscriminatorClipping("token")
    with pytest.raises(ValueError, match="mu"):
        EntropyDiscriminatorClipping(mu=0.0)
    with pytest.raises(ValueError, match="max_fraction"):
        EntropyDiscriminatorClipping("vocab", max_fraction=2.0)
    with pytest.raises(RuntimeError, match="needs_entropy_dynamics"):
        EntropyDiscriminatorClipping().on_policy_loss(
            None, make_recorder(), fake_rollout(1, 4), make_step([0], [2])
        )


# ------------------------------------------------------------------------------------------- the monitor

# Two rows: row 0 has tokens at columns 2, 3, 4 and row 1 at 2, 3. Hand computation, lr = 0.1:
#   predicted_t = -lr * keep * A * (S - N) = [-0.02, 0.025, -0.02, -0.03, 0]
#     means: all -0.009, row 0 -0.005, row 1 -0.015
#   measured_t = H1 - H0 = [-0.3, 0.1, 0.0, -0.1, 0.2]
#     means: all -0.02, row 0 -0.2/3, row 1 0.05
ROWS, COLS = [0, 0, 0, 1, 1], [2, 3, 4, 2, 3]
H0, H1 = [1.0, 2.0, 0.5, 1.5, 1.0], [0.7, 2.1, 0.5, 1.4, 1.2]
FIRST = dict(
    s_target=[0.25, -0.2, 0.3, -0.2, 0.2],
    n_term=[0.05, 0.05, 0.1, 0.1, 0.1],
    advantages=[1.0, 1.0, 1.0, -1.0, -1.0],
    loss_mask=[True, True, True, True, False],  # the last token was dropped by an earlier callback
    learning_rate=0.1,
)


def _visit(make_step, tokens, update_index, entropy, **values):
    """A step over the listed token indices (into ROWS/COLS) with the given per-token values."""
    sub = {k: [v[i] for i in tokens] if isinstance(v, list) else v for k, v in values.items()}
    sub.setdefault("s_target", [0.0] * len(tokens))
    sub.setdefault("n_term", [0.0] * len(tokens))
    return make_step(
        [ROWS[i] for i in tokens],
        [COLS[i] for i in tokens],
        update_index=update_index,
        entropy=[entropy[i] for i in tokens],
        **sub,
    )


def test_monitor_single_mini_batch(make_step, fake_rollout, make_recorder):
    monitor, module, rollout = EntropyDynamicsMonitor(), make_recorder(), fake_rollout(2, 6)
    everything = [0, 1, 2, 3, 4]
    assert (
        monitor.on_policy_loss(None, module, rollout, _visit(make_step, everything, 0, H0, **FIRST)) is None
    )
    assert module.logged == {}  # nothing revisited yet
    monitor.on_policy_loss(None, module, rollout, _visit(make_step, everything, 1, H1))
    assert module.logged["train/entropy_delta_predicted"] == pytest.approx(-0.009)
    assert module.logged["train/entropy_delta_measured"] == pytest.approx(-0.02)

    module = make_recorder()  # a new rollout batch: update 0 forgets the previous one
    monitor.on_policy_loss(None, module, rollout, _visit(make_step, everything, 0, H1))
    assert module.logged == {}


def test_monitor_mini_batches_running_mean(make_step, fake_rollout, make_recorder):
    monitor, module, rollout = EntropyDynamicsMonitor(), make_recorder(), fake_rollout(2, 6)
    row0, row1 = [0, 1, 2], [3, 4]
    monitor.on_policy_loss(None, module, rollout, _visit(make_step, row1, 0, H0, **FIRST))  # epoch 0
    monitor.on_policy_loss(None, module, rollout, _visit(make_step, row0, 1, H0, **FIRST))
    assert module.logged == {}
    monitor.on_policy_loss(None, module, rollout, _visit(make_step, row0, 2, H1))  # epoch 1
    assert module.logged["train/entropy_delta_predicted"] == pytest.approx(-0.005)
    assert module.logged["train/entropy_delta_measured"] == pytest.approx(-0.2 / 3)
    monitor.on_policy_loss(None, module, rollout, _visit(make_step, row1, 3, H1))
    assert module.logged["train/entropy_delta_predicted"] == pytest.approx(-0.009)  # all five tokens
    assert module.logged["train/entropy_delta_measured"] == pytest.approx(-0.02)


def test_monitor_state_dict_round_trip(make_step, fake_rollout, make_recorder):
    rollout, everything = fake_rollout(2, 6), [0, 1, 2, 3, 4]
    first = EntropyDynamicsMonitor()
    first.on_policy_loss(None, make_recorder(), rollout, _visit(make_step, everything, 0, H0, **FIRST))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed, module = EntropyDynamicsMonitor(), make_recorder()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    resumed.on_policy_loss(None, module, rollout, _visit(make_step, everything, 1, H1))
    assert module.logged["train/entropy_delta_predicted"] == pytest.approx(-0.009)
    assert module.logged["train/entropy_delta_measured"] == pytest.approx(-0.02)


def test_monitor_setup_needs_two_epochs(make_recorder):
    with pytest.raises(ValueError, match="ppo_epochs >= 2"):
        EntropyDynamicsMonitor().setup(None, make_recorder(ppo_epochs=1), "fit")
    EntropyDynamicsMonitor().setup(None, make_recorder(ppo_epochs=2), "fit")
    EntropyDynamicsMonitor().setup(None, make_recorder(), "fit")  # a module without PPO epochs: no check
