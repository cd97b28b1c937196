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
        if sae.rescale_acts_by_decoder_norm:  # SAELens: hidden_pre * ||W_dec||, decoded divided by it
            z = z * sae.W_dec.norm(dim=1)
        r = torch.relu(z)
        keep = torch.zeros_like(r, dtype=torch.bool).scatter(-1, r.topk(sae.k, dim=-1).indices, True)
        f = r * keep
        sparsity = z.new_zeros(())
        if sae.rescale_acts_by_decoder_norm:
            f = f / sae.W_dec.norm(dim=1)
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


def _aux_reference(
    sae: SparseAutoencoder, x: torch.Tensor, dead: torch.Tensor, *, relu: bool
) -> torch.Tensor:
    """AuxK written out as SAELens's ``calculate_topk_aux_loss`` (coefficient 1): top-k_aux of the dead latents'
    pre-activations (negative ones allowed unless ``relu``), decoded without bias against the residual."""
    xs = x * sae.input_scale
    _, recon = _reference(sae, x, 0.0)
    residual = (xs - recon * sae.input_scale).detach()
    z = (xs - sae.b_dec) @ sae.W_enc.T + sae.b_enc
    norms = sae.W_dec.norm(dim=1) if sae.rescale_acts_by_decoder_norm else torch.ones(sae.d_sae)
    z = z * norms
    if relu:
        z = torch.relu(z)
    n_dead = int(dead.sum())
    k_aux = min(D_IN // 2, n_dead)
    top = torch.where(dead[None], z, -torch.inf).topk(k_aux, dim=-1)
    acts = torch.zeros_like(z).scatter(-1, top.indices, top.values)
    e_hat = (acts / norms) @ sae.W_dec
    return min(n_dead / (D_IN // 2), 1.0) * (e_hat - residual).pow(2).sum(-1).mean()


def _module_with_dead(sae: SparseAutoencoder, dead: torch.Tensor, **kwargs) -> SparseAutoencoderModule:
    module = SparseAutoencoderModule(
        D_IN, expansion=D_SAE // D_IN, architecture="topk", k=sae.k, aux_coefficient=1.0,
        dead_window_tokens=10, **kwargs,
    )  # fmt: skip
    module.sae = sae
    module.tokens_since_fired.masked_fill_(dead, 10)
    return module


@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_aux_loss_and_gradients_match_saelens_formula(relu, rescale):
    sae = _sae("topk", rescale_acts_by_decoder_norm=rescale)
    if rescale:
        with torch.no_grad():
            sae.W_dec.mul_(torch.rand(D_SAE, 1) + 0.5)
    x = torch.randn(9, D_IN)
    dead = torch.zeros(D_SAE, dtype=torch.bool)
    dead[::3] = True  # 12 dead latents, k_aux = 6
    module = _module_with_dead(sae, dead, aux_relu=relu, rescale_acts_by_decoder_norm=rescale)
    out = module.losses(x)
    expected = _aux_reference(sae, x, dead, relu=relu)
    torch.testing.assert_close(out["aux"], expected, atol=1e-5, rtol=1e-5)
    out["loss"].backward()
    ours = {name: p.grad.clone() for name, p in sae.named_parameters()}
    sae.zero_grad()
    (_reference(sae, x, 0.0)[0] + _aux_reference(sae, x, dead, relu=relu)).backward()
    for name, p in sae.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_default_aux_loss_revives_dead_latents_with_negative_pre_activations():
    """Dead latents whose pre-activations are all negative: the ReLU variant decodes zeros, so its AuxK is the
    constant ||residual||^2 and gives them no gradient; the default (SAELens's) convention trains their encoder
    and decoder rows toward the residual."""
    sae = _sae("topk")
    dead = torch.zeros(D_SAE, dtype=torch.bool)
    dead[:12] = True
    with torch.no_grad():
        sae.b_enc[dead] = -100.0  # every pre-activation of the dead latents is negative
    x = torch.randn(9, D_IN)
    relu_out = _module_with_dead(sae, dead, aux_relu=True).losses(x)
    residual = (x - sae(x)) * sae.input_scale
    torch.testing.assert_close(relu_out["aux"], residual.pow(2).sum(-1).mean().detach())
    relu_out["aux"].backward()
    assert all(p.grad is None or not p.grad.any() for p in sae.parameters())
    out = _module_with_dead(sae, dead).losses(x)
    assert float(out["aux"]) != float(relu_out["aux"])
    out["aux"].backward()
    trained = (sae.W_enc.grad[dead] != 0).any(1) & (sae.W_dec.grad[dead] != 0).any(1)
    assert int(trained.sum()) >= D_IN // 2  # at least one token's k_aux = 6 dead latents get a signal
    assert not sae.W_enc.grad[~dead].any()  # AuxK touches only dead latents' encoder rows


def test_rescaled_sae_equals_the_unit_row_sae_it_folds_into(quiet_trainer):
    """rescale_acts_by_decoder_norm: (W_enc, b_enc, W_dec) computes what the unit-row SAE
    (||d|| W_enc, ||d|| b_enc, W_dec / ||d||) computes; training leaves the rows free."""
    sae = _sae("topk", rescale_acts_by_decoder_norm=True)
    with torch.no_grad():
        sae.W_dec.mul_(torch.rand(D_SAE, 1) + 0.5)
    norms = sae.W_dec.norm(dim=1).detach()
    folded = SparseAutoencoder.from_weights(
        sae.W_enc.detach() * norms[:, None], sae.b_enc.detach() * norms, sae.W_dec.detach() / norms[:, None],
        sae.b_dec.detach(), "topk", k=sae.k, input_scale=float(sae.input_scale),
    )  # fmt: skip
    x = torch.randn(9, D_IN)
    torch.testing.assert_close(sae(x), folded(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sae.decode(sae.encode(x)), folded(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="topk"):
        SparseAutoencoder(D_IN, D_SAE, "relu", rescale_acts_by_decoder_norm=True)
    with pytest.raises(ValueError, match="topk"):
        SparseAutoencoderModule(D_IN, architecture="relu", rescale_acts_by_decoder_norm=True)
    torch.manual_seed(0)
    module = SparseAutoencoderModule(
        D_IN, expansion=4, architecture="topk", k=4, lr=3e-3, rescale_acts_by_decoder_norm=True
    )
    quiet_trainer(max_steps=20).fit(module, _loader())
    assert (module.sae.W_dec.norm(dim=1) - 1).abs().max() > 1e-3  # rows not renormalised
