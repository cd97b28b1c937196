"""SAE metrics against hand computation; ΔLoss with an exact-identity SAE spliced into the tiny backbone."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from lightning_llm.metrics import (
    DeadFeatures,
    DeltaLoss,
    ExplainedVariance,
    MeanL0,
    SAELike,
    SequenceMSE,
    delta_loss,
)
from lightning_llm.metrics.sae import _replace_layer_output, spliced_nll
from lightning_llm.sae import SparseAutoencoder


def hand_sae(W_enc: Tensor, b_enc: Tensor, W_dec: Tensor, b_dec: Tensor) -> SparseAutoencoder:
    """A hand-set ReLU SAE: ``f = relu((x - b_dec) W_enc + b_enc)``, ``x̂ = f W_dec + b_dec``."""
    return SparseAutoencoder.from_weights(W_enc.T, b_enc, W_dec, b_dec)


def identity_sae(d: int) -> hand_sae:
    """``x̂ = relu(x) − relu(−x) = x`` bit for bit: every output is one ±1 product plus exact zeros."""
    eye = torch.eye(d)
    return hand_sae(torch.cat([eye, -eye], 1), torch.zeros(2 * d), torch.cat([eye, -eye], 0), torch.zeros(d))


def random_sae(d: int, m: int, seed: int = 0) -> hand_sae:
    g = torch.Generator().manual_seed(seed)
    W_dec = torch.randn(m, d, generator=g)
    W_dec = W_dec / W_dec.norm(dim=1, keepdim=True)
    return hand_sae(W_dec.T.clone(), 0.1 * torch.randn(m, generator=g), W_dec, torch.zeros(d))


def _data(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 4, generator=g)
    x_hat = x + 0.5 * torch.randn(3, 5, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    special = torch.tensor([[1, 0, 0, 1, 0], [0, 0, 0, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)
    return x, x_hat, mask, special


def test_the_test_sae_satisfies_the_protocol():
    sae = random_sae(4, 6)
    assert isinstance(sae, SAELike)
    assert sae.d_in == 4 and sae.d_sae == 6
    x = torch.randn(2, 3, 4)
    assert torch.equal(identity_sae(4)(x), x)


# ------------------------------------------------------------------------------------------ SequenceMSE


def _hand_sequence_mse(x, x_hat, selected) -> float:
    per_sequence = []
    for b in range(x.shape[0]):
        errors = [float(((x[b, t] - x_hat[b, t]) ** 2).sum()) for t in range(x.shape[1]) if selected[b, t]]
        if errors:
            per_sequence.append(sum(errors) / len(errors))
    return sum(per_sequence) / len(per_sequence)


def test_sequence_mse_matches_hand_computation():
    x, x_hat, mask, special = _data()
    metric = SequenceMSE()
    metric.update(x, x_hat, mask)
    assert float(metric.compute()) == pytest.approx(_hand_sequence_mse(x, x_hat, mask), rel=1e-6)
    # special only: sequence 1's special tokens at 3, 4 are padding, so it has none and is skipped
    special_metric = SequenceMSE(special_only=True, log2=True)
    special_metric.update(x, x_hat, mask, special)
    assert int(special_metric.sequences) == 2
    expected = _hand_sequence_mse(x, x_hat, mask & special)
    assert float(special_metric.compute()) == pytest.approx(math.log2(expected), rel=1e-6)


def test_ordinary_only_sequence_mse_is_the_complement_of_special_only():
    x, x_hat, mask, special = _data()
    metric = SequenceMSE(ordinary_only=True)
    metric.update(x, x_hat, mask, special)
    assert float(metric.compute()) == pytest.approx(_hand_sequence_mse(x, x_hat, mask & ~special), rel=1e-6)
    with pytest.raises(ValueError, match="special_mask"):
        metric.update(x, x_hat, mask)
    with pytest.raises(ValueError, match="exclude each other"):
        SequenceMSE(special_only=True, ordinary_only=True)


def test_sequence_mse_accumulates_like_one_batch():
    x, x_hat, mask, special = _data(1)
    for kwargs in ({}, {"special_only": True}, {"ordinary_only": True}):
        whole, parts = SequenceMSE(**kwargs), SequenceMSE(**kwargs)
        whole.update(x, x_hat, mask, special)
        parts.update(x[:1], x_hat[:1], mask[:1], special[:1])
        parts.update(x[1:], x_hat[1:], mask[1:], special[1:])
        torch.testing.assert_close(parts.compute(), whole.compute(), rtol=1e-12, atol=0)


def test_sequence_mse_empty_special_set_is_nan_and_needs_the_mask():
    x, x_hat, mask, _ = _data()
    metric = SequenceMSE(special_only=True)
    metric.update(x, x_hat, mask, torch.zeros_like(mask))
    assert int(metric.sequences) == 0 and math.isnan(float(metric.compute()))
    with pytest.raises(ValueError, match="special_mask"):
        metric.update(x, x_hat, mask)


# ------------------------------------------------------------------------------------------ EV, L0, dead


def test_explained_variance_matches_hand_computation_and_pools_batches():
    x, x_hat, mask, _ = _data(2)
    rows, rows_hat = x[mask].double(), x_hat[mask].double()
    expected = 1 - ((rows - rows_hat) ** 2).sum() / ((rows - rows.mean(0)) ** 2).sum()
    whole = ExplainedVariance()
    whole.update(x, x_hat, mask)
    torch.testing.assert_close(whole.compute(), expected, rtol=1e-10, atol=0)
    parts = ExplainedVariance(d_in=4)
    parts.update(x[:2], x_hat[:2], mask[:2])
    parts.update(x[2:], x_hat[2:], mask[2:])
    torch.testing.assert_close(parts.compute(), expected, rtol=1e-10, atol=0)
    perfect = ExplainedVariance()
    perfect.update(x, x.clone(), mask)
    assert float(perfect.compute()) == 1.0
    with pytest.raises(ValueError, match="width"):
        parts.update(torch.zeros(2, 3), torch.zeros(2, 3))


def test_mean_l0_counts_active_features_of_real_tokens():
    f = torch.tensor(
        [[[1.0, 0.0, 2.0], [0.0, 0.0, 0.0], [9.0, 9.0, 9.0]], [[0.0, 3.0, 0.0], [1.0, 1.0, 0.0], [0, 0, 0]]]
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)  # (0, 2) is padding
    metric = MeanL0()
    metric.update(f[:1], mask[:1])
    metric.update(f[1:], mask[1:])
    assert float(metric.compute()) == pytest.approx((2 + 0 + 1 + 2 + 0) / 5)


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric DeadFeatures")
def test_dead_features_window_is_exact_over_the_token_stream():
    metric = DeadFeatures(d_sae=3, window_tokens=3)
    assert float(metric.compute()) == 1.0  # never fired = dead
    # stream: t1 fires feature 0, t2 feature 1 (a padding token in between fires everything: ignored)
    f1 = torch.tensor([[[1.0, 0.0, 0.0], [5.0, 5.0, 5.0], [0.0, 2.0, 0.0]]])
    metric.update(f1, torch.tensor([[True, False, True]]))
    assert metric.since_fired.tolist() == [1, 0, DeadFeatures.NEVER]
    assert float(metric.compute()) == pytest.approx(1 / 3)
    metric.update(torch.zeros(2, 3))  # t3, t4: nothing fires
    # feature 0 last fired 3 tokens ago (dead at window 3), feature 1 two tokens ago (alive)
    assert metric.since_fired.tolist()[:2] == [3, 2]
    assert metric.dead_mask().tolist() == [True, False, True]
    assert int(metric.tokens_seen) == 4
    # the same stream in one update gives the same state
    one = DeadFeatures(d_sae=3, window_tokens=3)
    one.update(torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(one.since_fired, metric.since_fired)
    assert "since_fired" in metric.state_dict()  # persistent: travels in checkpoints
    metric.reset()
    assert float(metric.compute()) == 1.0 and int(metric.tokens_seen) == 0


def test_states_merged_as_across_ranks_equal_one_pass():
    """``merge_state`` applies each state's ``dist_reduce_fx``, as the DDP sync does."""
    x, x_hat, mask, special = _data(3)
    f = torch.relu(x)
    makers = {
        "mse": (
            lambda: SequenceMSE(special_only=True),
            lambda m, i: m.update(x[i], x_hat[i], mask[i], special[i]),
        ),
        "ev": (lambda: ExplainedVariance(d_in=4), lambda m, i: m.update(x[i], x_hat[i], mask[i])),
        "l0": (MeanL0, lambda m, i: m.update(f[i], mask[i])),
    }
    for make, update in makers.values():
        whole, rank0, rank1 = make(), make(), make()
        update(whole, slice(None))
        update(rank0, slice(0, 1))
        update(rank1, slice(1, None))
        rank0.merge_state(rank1)
        torch.testing.assert_close(rank0.compute(), whole.compute(), rtol=1e-10, atol=0)
    rank0, rank1 = DeadFeatures(3, window_tokens=2), DeadFeatures(3, window_tokens=2)
    rank0.update(torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))  # feature 0: 2 ago
    rank1.update(torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))  # features 0, 1: just now
    rank0.merge_state(rank1)
    assert rank0.since_fired.tolist()[:2] == [0, 0] and int(rank0.tokens_seen) == 5
    assert rank0.dead_mask().tolist() == [False, False, True]


# ------------------------------------------------------------------------------------------ ΔLoss


@pytest.fixture(scope="module")
def batch(tiny_tokenizer):
    texts = ["the cat sees the fire and runs", "a fox is hot"]  # right-padded second row
    return tiny_tokenizer(texts, return_tensors="pt", padding=True)


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_identity_sae_splice_is_exactly_clean(tiny_backbone, batch, scale):
    model, _ = tiny_backbone
    d = model.config.hidden_size
    result = delta_loss(model, identity_sae(d), 1, batch["input_ids"], batch["attention_mask"], scale=scale)
    assert result["spliced"] == result["clean"]
    assert result["delta_loss"] == 0.0 and result["ce_recovered"] == 1.0
    assert result["zero"] > result["clean"]
    # clean is the model's own mean next-token loss over real tokens
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        hf_loss = model(**batch, labels=labels).loss
    assert result["clean"] == pytest.approx(float(hf_loss), rel=1e-5)


def test_delta_loss_of_a_lossy_sae_and_multi_batch_pooling(tiny_backbone, batch):
    model, _ = tiny_backbone
    sae = random_sae(model.config.hidden_size, 64)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    one = delta_loss(model, sae, 2, ids, mask)
    assert one["spliced"] != one["clean"]
    assert one["delta_loss"] == pytest.approx((one["spliced"] - one["clean"]) / one["clean"])
    assert one["ce_recovered"] == pytest.approx((one["zero"] - one["spliced"]) / (one["zero"] - one["clean"]))
    # token-pooled over two single-row updates = the two-row batch
    metric = DeltaLoss(layer=2)
    for row in range(2):
        length = int(mask[row].sum())
        metric.update(model, sae, ids[row : row + 1, :length], mask[row : row + 1, :length])
    pooled = {k: float(v) for k, v in metric.compute().items()}
    assert pooled == pytest.approx(one, rel=1e-4)
    sums, tokens = spliced_nll(model, sae, 2, ids, mask)
    assert tokens == int(mask[:, 1:].sum()) and sums.shape == (3,)


def test_splice_leaves_padding_and_other_layers_untouched(tiny_backbone, batch):
    model, _ = tiny_backbone
    mask = batch["attention_mask"]
    with torch.no_grad():
        clean = model(**batch, output_hidden_states=True).hidden_states
        # after a first output_hidden_states call: transformers 5 adds its own recording hooks lazily
        hooks = [len(layer._forward_hooks) for layer in model.model.layers]
        with _replace_layer_output(model, 1, mask, torch.zeros_like):
            ablated = model(**batch, output_hidden_states=True).hidden_states
    assert torch.equal(ablated[1], clean[1])  # output of layer 0
    real = mask.bool()
    assert bool((ablated[2][real] == 0).all())
    assert torch.equal(ablated[2][~real], clean[2][~real])
    assert [len(layer._forward_hooks) for layer in model.model.layers] == hooks  # the hook is gone


def test_explained_variance_of_zero_variance_tokens_is_nan_not_inf():
    """All selected tokens equal (special tokens of a batch that are one token), or a single token: the
    variance is 0 and EV undefined. NaN, as documented; the old ``1 - err / 0`` gave -inf."""
    same = torch.tensor([[0.5, -1.0, 2.0]]).repeat(5, 1)
    for rows in (same, same[:1]):
        metric = ExplainedVariance()
        metric.update(rows, rows + 0.1)
        assert math.isnan(float(metric.compute()))
    varied = ExplainedVariance()
    varied.update(same + torch.arange(5.0)[:, None] * 1e-3, same)  # tiny but real variance: finite
    assert math.isfinite(float(varied.compute()))


def test_delta_loss_ratios_are_nan_not_inf_when_undefined():
    metric = DeltaLoss(layer=0)
    metric.tokens += 4
    metric.clean_nll += 8.0
    metric.spliced_nll += 10.0
    metric.zero_nll += 8.0  # zero ablation leaves the loss unchanged: CE recovered undefined
    out = metric.compute()
    assert math.isnan(float(out["ce_recovered"]))
    assert float(out["delta_loss"]) == pytest.approx(0.25)
    perfect = DeltaLoss(layer=0)
    perfect.tokens += 4
    perfect.spliced_nll += 1.0
    perfect.zero_nll += 6.0  # clean loss 0: ΔL undefined
    out = perfect.compute()
    assert math.isnan(float(out["delta_loss"])) and float(out["ce_recovered"]) == pytest.approx(5 / 6)
