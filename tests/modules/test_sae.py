"""SparseAutoencoder / SparseAutoencoderModule: each architecture against a hand-written dense reference."""

from __future__ import annotations

import math

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_llm.modules.sae import SparseAutoencoderModule
from lightning_llm.sae import SparseAutoencoder, geometric_median

D_IN, D_SAE = 12, 36


def _sae(architecture: str, **kwargs) -> SparseAutoencoder:
    torch.manual_seed(0)
    sae = SparseAutoencoder(
        D_IN, D_SAE, architecture, k=5, jumprelu_threshold=0.05, jumprelu_bandwidth=0.5, **kwargs
    )
    with torch.no_grad():  # move away from the tied initialisation so encoder and decoder grads differ
        sae.W_enc.add_(0.1 * torch.randn_like(sae.W_enc))
        sae.b_enc.copy_(0.1 * torch.randn(D_SAE))
        sae.b_dec.copy_(0.1 * torch.randn(D_IN))
        sae.input_scale.fill_(1.7)
    return sae


def _reference(
    sae: SparseAutoencoder, x: torch.Tensor, coefficient: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, reconstruction in raw units) written out densely from the module docstring's equations."""
    c = sae.input_scale
    xs = x * c
    z = (xs - sae.b_dec) @ sae.W_enc.T + sae.b_enc
    if sae.architecture == "relu":
        f = torch.relu(z)
        sparsity = coefficient * (f * sae.W_dec.norm(dim=1)).sum(-1).mean()
    elif sae.architecture == "topk":
        r = torch.relu(z)
        keep = torch.zeros_like(r, dtype=torch.bool).scatter(-1, r.topk(sae.k, dim=-1).indices, True)
        f = r * keep
        sparsity = z.new_zeros(())
    else:
        theta = sae.log_threshold.exp()
        f = z * (z > theta)
        sparsity = coefficient * (z > theta).sum(-1).float().mean()
    recon = f @ sae.W_dec + sae.b_dec
    loss = (recon - xs).pow(2).sum(-1).mean() + sparsity
    return loss, recon / c


@pytest.mark.parametrize("architecture", ["relu", "topk", "jumprelu"])
def test_forward_and_loss_match_the_dense_reference(architecture):
    sae = _sae(architecture)
    x = torch.randn(9, D_IN)
    module = SparseAutoencoderModule(D_IN, expansion=D_SAE // D_IN, architecture=architecture)
    module.sae = sae
    coefficient = module.sparsity_coefficient()
    loss, recon = _reference(sae, x, coefficient)
    torch.testing.assert_close(sae(x), recon, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sae.decode(sae.encode(x)), recon, atol=1e-5, rtol=1e-5)
    out = module.losses(x)
    torch.testing.assert_close(out["loss"], loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("architecture", ["relu", "topk"])
def test_gradients_match_the_dense_reference(architecture):
    sae = _sae(architecture)
    x = torch.randn(9, D_IN)
    module = SparseAutoencoderModule(D_IN, expansion=D_SAE // D_IN, architecture=architecture)
    module.sae = sae
    module.losses(x)["loss"].backward()
    ours = {name: p.grad.clone() for name, p in sae.named_parameters()}
    sae.zero_grad()
    _reference(sae, x, module.sparsity_coefficient())[0].backward()
    for name, p in sae.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_jumprelu_straight_through_gradients():
    """∂L/∂θ_i = Σ_n -(1/ε) K((z-θ)/ε) (θ ∂L/∂f + λ/N): only tokens inside the bandwidth window contribute."""
    sae = _sae("jumprelu")
    x = torch.randn(9, D_IN)
    module = SparseAutoencoderModule(
        D_IN, expansion=D_SAE // D_IN, architecture="jumprelu", l0_coefficient=0.3
    )
    module.sae = sae
    module.losses(x)["loss"].backward()
    with torch.no_grad():
        theta, eps = sae.log_threshold.exp(), sae.bandwidth
        xs = x * sae.input_scale
        z = (xs - sae.b_dec) @ sae.W_enc.T + sae.b_enc
        f = z * (z > theta)
        recon = f @ sae.W_dec + sae.b_dec
        grad_f = 2 * (recon - xs) @ sae.W_dec.T / x.shape[0]
        window = ((z - theta).abs() < eps / 2).float()
        grad_theta = (-(1 / eps) * window * (theta * grad_f + 0.3 / x.shape[0])).sum(0)
    assert window.sum() > 0  # the example exercises the window
    torch.testing.assert_close(sae.log_threshold.grad, grad_theta * theta, atol=1e-5, rtol=1e-4)


def test_topk_has_at_most_k_active_latents():
    sae = _sae("topk")
    f = sae.encode(torch.randn(7, D_IN))
    assert ((f > 0).sum(-1) <= sae.k).all() and ((f > 0).sum(-1) >= 1).all()


def test_geometric_median_beats_mean_and_resists_outliers():
    torch.manual_seed(0)
    points = torch.randn(200, 3)
    points[:5] += 1000.0  # a few attention-sink-like outliers
    median = geometric_median(points)

    def cost(y):
        return (points - y).norm(dim=1).sum()

    assert cost(median) < cost(points.mean(0))
    for _ in range(20):  # a local check of optimality
        assert cost(median) <= cost(median + 0.01 * torch.randn(3)) + 1e-4
    assert median.norm() < 0.5  # the mean is pulled ~25 away
    torch.testing.assert_close(geometric_median(torch.tensor([[1.0, 2.0]])), torch.tensor([1.0, 2.0]))


def test_decoder_rows_stay_unit_norm_and_gradient_is_tangent():
    sae = _sae("relu").double()  # fp64, so the projection is checked to rounding of the exact identity
    (sae(torch.randn(5, D_IN, dtype=torch.float64)) ** 2).sum().backward()
    sae.remove_parallel_gradient()
    assert (sae.W_dec.grad * sae.W_dec).sum(1).abs().max() < 1e-10
    with torch.no_grad():
        sae.W_dec.mul_(3.0)
    sae.normalize_decoder()
    torch.testing.assert_close(sae.W_dec.norm(dim=1), torch.ones(D_SAE, dtype=torch.float64))


@pytest.mark.parametrize("architecture", ["relu", "topk", "jumprelu"])
def test_save_and_load_round_trip(tmp_path, architecture):
    sae = _sae(architecture)
    x = torch.randn(4, D_IN)
    loaded = SparseAutoencoder.from_pretrained(sae.save_pretrained(tmp_path / "sae"))
    torch.testing.assert_close(loaded(x), sae(x))
    assert float(loaded.input_scale) == pytest.approx(1.7)
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        SparseAutoencoder.from_pretrained(tmp_path)


def test_invalid_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="architecture"):
        SparseAutoencoderModule(8, architecture="gated")
    with pytest.raises(ValueError, match="k must be"):
        SparseAutoencoder(8, 16, "topk", k=17)
    with pytest.raises(ValueError, match="lr"):
        SparseAutoencoderModule(8, lr=0.0)


def _loader(n: int = 512, seed: int = 0) -> StatefulDataLoader:
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(n, D_IN, generator=g) * 3 + 1
    return StatefulDataLoader([{"activations": row} for row in data], batch_size=64, shuffle=False)


def test_training_reduces_mse_and_initialises_from_data(quiet_trainer):
    torch.manual_seed(0)
    module = SparseAutoencoderModule(D_IN, expansion=4, architecture="topk", k=4, lr=3e-3)
    before = module.losses(torch.randn(64, D_IN) * 3 + 1)["mse"].item()
    quiet_trainer(max_steps=40).fit(module, _loader())
    assert bool(module.initialized)
    # c makes E||c x|| = sqrt(d): the data's norm is about sqrt(9 d + d)
    assert float(module.sae.input_scale) == pytest.approx(math.sqrt(D_IN) / math.sqrt(10 * D_IN), rel=0.15)
    torch.testing.assert_close(module.sae.W_dec.norm(dim=1), torch.ones(4 * D_IN))
    after = module.losses(torch.randn(64, D_IN) * 3 + 1)["mse"].item()
    assert after < 0.5 * before


def test_checkpoint_resume_is_exact(tmp_path, quiet_trainer):
    """Resume from the step-10 checkpoint of a 20-step run: the same weights and dead-latent counters."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def make():
        torch.manual_seed(0)
        return SparseAutoencoderModule(
            D_IN, expansion=4, architecture="topk", k=4, lr=3e-3, dead_window_tokens=128
        )

    straight = make()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1, filename="{step}")
    quiet_trainer(max_steps=20, callbacks=[saver], enable_checkpointing=True).fit(straight, _loader())
    ckpt = tmp_path / "step=10.ckpt"
    resumed = make()
    quiet_trainer(max_steps=20).fit(resumed, _loader(), ckpt_path=str(ckpt))
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    state = torch.load(ckpt, weights_only=True)
    assert state["hyper_parameters"]["d_in"] == D_IN


def test_special_and_ordinary_tokens_are_scored_and_logged_apart(quiet_trainer):
    """Validation logs MSE and explained variance over special and ordinary tokens separately (each equal to
    the pooled metric restricted to its tokens), and training logs the two per-token MSEs."""
    torch.manual_seed(0)
    module = SparseAutoencoderModule(
        D_IN, expansion=4, architecture="topk", k=4, lr=3e-3, compute_delta_loss=False
    )
    x = torch.randn(4, 6, D_IN)
    special = torch.zeros(4, 6, dtype=torch.bool)
    special[:, 0] = True  # an attention-sink-like first token with a far larger norm
    x[:, 0] *= 30
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[3, 4:] = 0
    batch = {"activations": x, "attention_mask": mask, "special_mask": special}
    trainer = quiet_trainer(max_steps=1, limit_val_batches=1.0)
    logged = trainer.validate(module, StatefulDataLoader([batch], batch_size=None), verbose=False)[0]
    with torch.no_grad():
        x_hat = module.sae(x)
    real = mask.bool()
    for name, selected in (("special", real & special), ("ordinary", real & ~special)):
        error = (x - x_hat).pow(2).sum(-1)
        per_sequence = [float(error[b][selected[b]].mean()) for b in range(4)]
        assert logged[f"val/mse_{name}"] == pytest.approx(sum(per_sequence) / 4, rel=1e-5)
        rows, rows_hat = x[selected].double(), x_hat[selected].double()
        ev = 1 - float((rows - rows_hat).pow(2).sum() / (rows - rows.mean(0)).pow(2).sum())
        assert logged[f"val/explained_variance_{name}"] == pytest.approx(ev, rel=1e-5, abs=1e-6)
    # the pooled figure is not the ordinary tokens' one (the large special tokens dominate it)
    assert logged["val/explained_variance_ordinary"] < logged["val/explained_variance"]

    flat = x[real]
    out = module.losses(flat, special_mask=special[real])
    scaled_error = (module.sae(flat) - flat).pow(2).sum(-1) * module.sae.input_scale**2
    torch.testing.assert_close(out["mse_special"], scaled_error[special[real]].mean().detach())
    torch.testing.assert_close(out["mse_ordinary"], scaled_error[~special[real]].mean().detach())
    train = StatefulDataLoader(
        [{"activations": flat[:16], "special_mask": special[real][:16]}], batch_size=None, shuffle=False
    )
    fit = quiet_trainer(max_steps=1, log_every_n_steps=1)
    fit.fit(module, train)
    assert {"train/mse_special", "train/mse_ordinary"} <= set(fit.logged_metrics)
