"""ScaLoRA's closed form, the rescale's invariants (output, chain rule, moments), rank growth, restarts, resume."""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_llm.callbacks import LoRARestart, ScaLoRA, UpdateRankMonitor
from lightning_llm.callbacks.lora_restart import restart_lora_layer
from lightning_llm.callbacks.scalora import apply_column_scales, optimal_column_scales
from lightning_llm.datamodules import ChatSFTDataModule
from lightning_llm.lora import LoRAConfig, LoRALinear, apply_lora, lora_layers, stable_rank
from lightning_llm.modules import CausalLMModule


def _brute_force_v(a, b, g, lipschitz_lr, groups=None):
    """argmin_v ‖−G/L + η(Σ_k v_k a_k a_kᵀG + Σ_k v_{r+k} G b_k b_kᵀ)‖ by least squares on vec(·), scaled by 1/η."""
    r = a.shape[1]
    terms = [torch.outer(a[:, k], g.T @ a[:, k]) for k in range(r)]
    terms += [torch.outer(g @ b[:, k], b[:, k]) for k in range(r)]
    design = torch.stack([t.reshape(-1) for t in terms], dim=1)
    if groups is not None:  # shared unknowns: sum the columns of each group
        design = torch.stack([design[:, groups == j].sum(1) for j in groups.unique()], dim=1)
    # With η folded into v: min ‖G/L − Σ v_k' T_k‖ where v' = ηv, and L = lipschitz_lr / η.
    target = g.reshape(-1, 1)
    return torch.linalg.lstsq(design, target).solution.squeeze(1) / lipschitz_lr


@pytest.mark.parametrize(
    ("m", "n", "r", "seed"), [(7, 5, 3, 0), (12, 9, 4, 1), (6, 11, 2, 2), (16, 16, 5, 3)]
)
def test_closed_form_equals_brute_force(m, n, r, seed):
    gen = torch.Generator().manual_seed(seed)
    a, b, g = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((m, r), (n, r), (m, n)))
    lipschitz_lr = 2.5
    alpha, beta, how = optimal_column_scales(a, b, g @ b, g.T @ a, lipschitz_lr)
    if how == "columns":
        expected = _brute_force_v(a, b, g, lipschitz_lr)
        torch.testing.assert_close(torch.cat([alpha, beta]).square(), expected, rtol=1e-8, atol=1e-10)
    else:
        assert how == "scalar"
        groups = torch.arange(2 * r) >= r
        expected = _brute_force_v(a, b, g, lipschitz_lr, groups=groups.long())
        torch.testing.assert_close(alpha.square(), expected[0].expand(r), rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(beta.square(), expected[1].expand(r), rtol=1e-8, atol=1e-10)


def test_both_solutions_are_exercised_and_the_closed_form_never_forms_m_by_n():
    """Over random draws both branches occur, and the column solution is exactly the brute-force optimum."""
    kinds = set()
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        a, b, g = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((8, 3), (6, 3), (8, 6)))
        kinds.add(optimal_column_scales(a, b, g @ b, g.T @ a, 1.0)[2])
    assert kinds == {"columns", "scalar"}


def test_fallback_skip_and_zero_columns():
    gen = torch.Generator().manual_seed(5)
    a, b = (
        torch.randn(8, 3, generator=gen, dtype=torch.float64),
        torch.randn(6, 3, generator=gen, dtype=torch.float64),
    )
    # Find a G where the column solution is infeasible, then check "skip" leaves scales at 1.
    for seed in range(100):
        g = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        if optimal_column_scales(a, b, g @ b, g.T @ a, 1.0)[2] != "columns":
            break
    alpha, beta, how = optimal_column_scales(a, b, g @ b, g.T @ a, 1.0, fallback="skip")
    assert how == "skipped" and torch.equal(alpha, torch.ones(3)) and torch.equal(beta, torch.ones(3))
    # A = 0 (B = 0 in PEFT's layout, as at initialisation): only β is solved; α stays 1.
    zero_a = torch.zeros_like(a)
    alpha, beta, how = optimal_column_scales(zero_a, b, g @ b, g.T @ zero_a, 1.0)
    assert torch.equal(alpha, torch.ones(3, dtype=torch.float64)) and how in ("columns", "scalar")
    assert torch.isfinite(beta).all() and (beta > 0).all()


def _tiny_lora(tiny_backbone, seed=0, r=3):
    model = copy.deepcopy(tiny_backbone[0]).train()
    torch.manual_seed(seed)
    apply_lora(model, r=r, alpha=6, target_modules=["q_proj", "v_proj", "down_proj"])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.weight.copy_(0.1 * torch.randn(layer.lora_B.weight.shape, generator=gen))
    return model


def _loss(model, seed=0):
    ids = torch.randint(3, 1000, (2, 13), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).loss


def _adam_steps(model, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for i in range(steps):
        opt.zero_grad()
        _loss(model, seed=i).backward()
        opt.step()
    opt.zero_grad()
    _loss(model, seed=99).backward()
    return opt


def test_rescale_keeps_outputs_and_follows_the_chain_rule(tiny_backbone):
    model = _tiny_lora(tiny_backbone)
    opt = _adam_steps(model)
    ids = torch.randint(3, 1000, (2, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    moments = {
        p: (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
        for layer in lora_layers(model).values()
        for p in (layer.lora_A.weight, layer.lora_B.weight)
    }
    factors = {
        n: (layer.lora_A.weight.clone(), layer.lora_B.weight.clone())
        for n, layer in lora_layers(model).items()
    }
    callback = ScaLoRA(rank_every=0)
    products = callback.rescale(model, opt)
    assert len(products) == 12 and callback.counts["columns"] + callback.counts["scalar"] == 12
    assert any(abs(p - 1.0) > 1e-3 for p in products), "the test needs scales that actually change something"

    # 1. The network output is unchanged (the difference went into W0).
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-5, rtol=0)

    # 2. The transferred gradients are the gradients of the rescaled model (chain rule), recomputed here.
    transferred = {p: p.grad.clone() for p in moments}
    for p in moments:
        p.grad = None
    _loss(model, seed=99).backward()
    for p in moments:
        torch.testing.assert_close(transferred[p], p.grad, atol=1e-6, rtol=1e-4)

    # 3. Moments: column k of lora_B (the paper's A) scales by β_k (β_k² for the second moment), row k of
    #    lora_A by α_k — the factor its gradient was multiplied by.
    for name, layer in lora_layers(model).items():
        old_a, old_b = factors[name]
        beta = layer.lora_A.weight[:, 0] / old_a[:, 0]  # lora_A rows were scaled by β
        alpha = layer.lora_B.weight[0] / old_b[0]  # lora_B columns were scaled by α
        m_b, v_b = moments[layer.lora_B.weight]
        torch.testing.assert_close(
            opt.state[layer.lora_B.weight]["exp_avg"], m_b * beta, rtol=1e-5, atol=1e-12
        )
        torch.testing.assert_close(
            opt.state[layer.lora_B.weight]["exp_avg_sq"], v_b * beta**2, rtol=1e-5, atol=1e-12
        )
        m_a, v_a = moments[layer.lora_A.weight]
        torch.testing.assert_close(
            opt.state[layer.lora_A.weight]["exp_avg"], m_a * alpha[:, None], rtol=1e-5, atol=1e-12
        )
        torch.testing.assert_close(
            opt.state[layer.lora_A.weight]["exp_avg_sq"], v_a * alpha[:, None] ** 2, rtol=1e-5, atol=1e-12
        )
        assert bool(layer.base_modified)


def test_unknown_optimizer_state_is_refused(tiny_backbone):
    model = _tiny_lora(tiny_backbone)
    layer = next(iter(lora_layers(model).values()))
    opt = torch.optim.Adagrad([layer.lora_A.weight, layer.lora_B.weight])
    _loss(model).backward()
    opt.step()
    with pytest.raises(ValueError, match="optimizer state 'sum'"):
        apply_column_scales(layer, torch.full((3,), 2.0), torch.full((3,), 0.5), opt)


def _regression(steps, method, interval=1, r=3, d=32, seed=0):
    """Fit a full-rank linear map with a rank-r adapter; returns (final loss, W − W0)."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(d, d, generator=gen) / math.sqrt(d)
    target = w0 + torch.randn(d, d, generator=gen) / math.sqrt(d)
    x = torch.randn(2048, d, generator=gen)
    y = x @ target.T
    torch.manual_seed(seed)
    base = torch.nn.Linear(d, d, bias=False)
    base.weight.data.copy_(w0)
    layer = LoRALinear(base, r=r, scale=2.0)
    model = torch.nn.Sequential(layer)
    opt = torch.optim.AdamW([layer.lora_A.weight, layer.lora_B.weight], lr=1e-2, weight_decay=0.0)
    callback = ScaLoRA(interval=interval, rank_every=0)
    for step in range(steps):
        idx = torch.randint(0, x.shape[0], (128,))
        opt.zero_grad()
        ((model(x[idx]) - y[idx]) ** 2).mean().backward()
        if method == "scalora" and step % interval == 0:
            callback.rescale(model, opt)
        opt.step()
        if method == "restart" and (step + 1) % interval == 0:
            restart_lora_layer(layer, opt)
    with torch.no_grad():
        loss = float(((model(x) - y) ** 2).mean())
        update = base.weight + layer.delta_weight() - w0
    return loss, update


def test_accumulated_update_rank_exceeds_r():
    r = 3
    _, lora_update = _regression(150, "lora", r=r)
    _, scalora_update = _regression(150, "scalora", r=r)
    assert torch.linalg.matrix_rank(lora_update) <= r
    assert torch.linalg.matrix_rank(scalora_update) > 3 * r
    assert stable_rank(scalora_update) > r + 1 > stable_rank(lora_update)


def _datamodule():
    return ChatSFTDataModule(task="arithmetic", num_train=64, num_val=8, batch_size=8, max_length=64, seed=3)


def _lora():
    return LoRAConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"])


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])


def test_scalora_in_trainer_logs_and_resumes_exactly(tiny_backbone, tmp_path, quiet_trainer):
    L.seed_everything(0)
    full = _Losses()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = quiet_trainer(
        max_steps=6, callbacks=[ScaLoRA(rank_every=2), full, ckpt], enable_checkpointing=True
    )
    module = CausalLMModule(lr=1e-2, lora=_lora())
    trainer.fit(module, _datamodule())
    logged = trainer.callback_metrics
    assert {"ScaLoRA/fallback_rate", "ScaLoRA/skip_rate", "ScaLoRA/stable_rank_mean"} <= set(logged)
    assert any(k.startswith("ScaLoRA/stable_rank/model.model.layers.0") for k in logged)
    path = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    torch.load(path, weights_only=True)  # callback state is tensors and numbers only

    L.seed_everything(123)
    resumed = _Losses()
    quiet_trainer(max_steps=6, callbacks=[ScaLoRA(rank_every=2), resumed]).fit(
        CausalLMModule(lr=1e-2, lora=_lora()), _datamodule(), ckpt_path=str(path)
    )
    assert sorted(resumed.losses) == [4, 5, 6]
    for step, loss in resumed.losses.items():
        assert loss == full.losses[step], (step, loss, full.losses[step])


def test_scalora_needs_lora(tiny_backbone, quiet_trainer):
    with pytest.raises(ValueError, match="LoRA layers"):
        quiet_trainer(max_steps=1, callbacks=[ScaLoRA()]).fit(CausalLMModule(), _datamodule())


def test_scalora_runs_under_manual_optimisation(tiny_backbone, quiet_trainer):
    """GRPOModule steps its optimizer by hand; Lightning still calls on_before_optimizer_step."""
    from lightning_llm.datamodules import PromptDataModule
    from lightning_llm.modules import GRPOModule

    callback = ScaLoRA(rank_every=0)
    module = GRPOModule(group_size=2, max_new_tokens=4, lr=1e-3, lora=_lora())
    data = PromptDataModule(task="arithmetic", num_train=8, num_val=2, batch_size=2, seed=0)
    quiet_trainer(max_steps=2, callbacks=[callback]).fit(module, data)
    # 8 adapted layers (4 blocks × q, v) on each of the 2 steps (skipped where all rewards tie: zero gradient)
    assert callback.optimizer_steps == 2 and sum(callback.counts.values()) == 2 * 8


def test_lora_restart_merges_and_resets(tiny_backbone, quiet_trainer):
    L.seed_everything(0)
    restart = LoRARestart(interval=2)
    monitor = UpdateRankMonitor(every=1)
    module = CausalLMModule(lr=1e-2, lora=_lora())
    base_before = {n: layer.base_layer.weight.clone() for n, layer in lora_layers(module.model).items()}
    quiet_trainer(max_steps=4, callbacks=[restart, monitor]).fit(module, _datamodule())
    assert restart.restarts == 2 and restart.optimizer_steps == 4
    optimizer = module.trainer.optimizers[0]
    for name, layer in lora_layers(module.model).items():
        assert torch.count_nonzero(layer.lora_B.weight) == 0  # just restarted
        assert layer.lora_B.weight not in optimizer.state  # moments dropped
        assert not torch.equal(layer.base_layer.weight, base_before[name])
    assert [step for step, _ in monitor.history] == [1, 2, 3, 4]
    ranks = monitor.history[-1][1]
    assert len(ranks) == 8 and all(v > 0 for v in ranks.values())
    assert not restart._handles  # hooks removed at the end of fit


def test_batched_rescale_equals_per_layer_solutions(tiny_backbone):
    """``ScaLoRA.rescale`` solves all layers' systems in one batched call; it must match the per-layer path."""
    model = _tiny_lora(tiny_backbone, r=4)
    opt = _adam_steps(model)
    expected = {}
    for name, layer in lora_layers(model).items():
        s = layer.scale
        lora_a, lora_b = layer.lora_A.weight, layer.lora_B.weight
        alpha, beta, how = optimal_column_scales(
            s * lora_b, lora_a.T, lora_b.grad / s, lora_a.grad.T, lipschitz_lr=10.0
        )
        expected[name] = (lora_a * beta.float()[:, None], lora_b * alpha.float(), how)
    callback = ScaLoRA(rank_every=0)
    callback.rescale(model, opt)
    hows = [how for *_, how in expected.values()]
    assert callback.counts["columns"] == hows.count("columns") > 0
    assert callback.counts["scalar"] == hows.count("scalar")
    for name, layer in lora_layers(model).items():
        torch.testing.assert_close(layer.lora_A.weight, expected[name][0], rtol=1e-6, atol=0)
        torch.testing.assert_close(layer.lora_B.weight, expected[name][1], rtol=1e-6, atol=0)


def test_scalora_export_says_it_writes_no_adapter(tiny_backbone, tmp_path, quiet_trainer, caplog):
    """By design (the rescaling folds updates into the base weights): save_dir holds the merged model only, and
    the log says why there is no save_dir/adapter."""
    import logging

    save_dir = tmp_path / "model"
    module = CausalLMModule(lr=1e-2, lora=_lora(), save_dir=str(save_dir))
    with caplog.at_level(logging.INFO):
        quiet_trainer(max_steps=2, callbacks=[ScaLoRA(rank_every=0)]).fit(module, _datamodule())
    assert (save_dir / "model.safetensors").is_file() and not (save_dir / "adapter").exists()
    assert f"no LoRA adapter is written to {save_dir / 'adapter'}" in caplog.text
    assert "ScaLoRA" in caplog.text
