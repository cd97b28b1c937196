r"""Training sparse autoencoders on residual-stream activations (FAST, arXiv 2506.07691, and the usual
architectures): the LightningModule. The SAE itself is :class:`lightning_llm.sae.SparseAutoencoder`.

Training minimises, per token and averaged over the batch (in the scaled space :math:`c\,x` of
:mod:`lightning_llm.sae`),

.. math::
    \mathcal{L} = \lVert c\,x - c\,\hat x\rVert_2^2 + \lambda_t\,\mathcal{S}(f),

with the sparsity term of the architecture:

* ``"relu"``: :math:`\mathcal{S} = \sum_i f_i \lVert d_i\rVert_2` (L1), FAST's :math:`\lambda = 5`.
* ``"jumprelu"``: :math:`\mathcal{S} = \sum_i H(z_i - \theta_i)` (L0, straight-through); FAST's
  :math:`\lambda = 0.01`, :math:`\varepsilon = 0.001`, :math:`\theta_0 = 0.001`.
* ``"topk"``: no sparsity term, plus the AuxK loss :math:`\alpha_{aux}\lVert e - \hat e\rVert^2` where
  :math:`e = c x - c\hat x` (detached) and :math:`\hat e = \sum_{i \in A} z_i d_i` (no bias) decodes the
  top-:math:`k_{aux}` *dead* latents :math:`A` by pre-activation :math:`z` (:math:`k_{aux} = d/2`,
  :math:`\alpha_{aux} = 1/32`, scaled down by :math:`\min(1, n_{dead}/k_{aux})` as in SAELens). By default the
  pre-activations enter as they are, negative ones included (SAELens's convention, ``aux_relu=False``);
  ``aux_relu=True`` applies a ReLU before the top-k, which zeroes the loss and its gradient whenever the dead
  latents' pre-activations are all negative -- the usual state of a dead latent -- so they get no revival
  signal.

:math:`\lambda_t` ramps linearly from 0 over ``sparsity_warmup_steps`` (the sparsity-coefficient warm-up).
:math:`b_{dec}` starts at the geometric median of a sample of (scaled) activations
(:func:`~lightning_llm.sae.geometric_median`); decoder rows are renormalised after every optimiser step, and the
gradient component parallel to each row is removed before it, so the step is taken on the sphere (with
``rescale_acts_by_decoder_norm``, SAELens's TopK convention, the rows are left free instead and the SAE rescales
by their norms; see :mod:`lightning_llm.sae`). Optimiser: Adam
with linear warm-up and cosine decay, FAST's 7e-5 → 7e-6 (``lr``, ``min_lr_ratio=0.1``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.kernels import sparse_decode, topk_encode
from lightning_llm.metrics.sae import DeltaLoss, ExplainedVariance, MeanL0, SequenceMSE
from lightning_llm.modules.causal_lm import warmup_cosine
from lightning_llm.sae import ARCHITECTURES, Architecture, SparseAutoencoder, geometric_median

__all__ = ["SparseAutoencoderModule"]


class SparseAutoencoderModule(L.LightningModule):
    r"""Train a :class:`~lightning_llm.sae.SparseAutoencoder` on activation batches (``{"activations": [B, d_in]}``).

    Pair it with :class:`~lightning_llm.datamodules.ActivationDataModule` (``mode="sequential"`` is FAST,
    ``"block"`` the block-training baseline). At the start of ``fit`` the input scale :math:`c` and
    :math:`b_{dec}` (geometric median) are set from ``datamodule.sample_activations(n)`` when the DataModule has
    it, else from the first training batch; a resumed run restores them from the checkpoint instead.

    Validation takes the DataModule's per-dialogue batches (``activations [b, T, d]``, ``attention_mask``,
    ``special_mask``, ``input_ids``) and logs ``val/mse`` (per-sequence MSE, FAST's), ``val/mse_special`` (special
    tokens only), ``val/mse_ordinary`` (the other real tokens) and their ``log2`` versions,
    ``val/explained_variance`` with its ``_special`` and ``_ordinary`` parts, ``val/l0``, and, when the DataModule
    exposes its frozen ``backbone`` and ``layer``, ``val/delta_loss`` (relative change of the LM loss with the
    reconstruction spliced in) and ``val/ce_recovered``. Special tokens are the DataModule's ``special_mask``
    (the tokenizer's special ids: ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``...); they are reported
    apart from ordinary tokens because their norms are far larger and dominate any pooled figure. Training logs
    the loss terms, ``train/mse_special`` and ``train/mse_ordinary`` (per-token squared error in the scaled space,
    when the batch has a ``special_mask``), ``train/l0`` and ``train/dead_fraction`` (latents silent for the last
    ``dead_window_tokens`` tokens).

    Args:
        d_in: activation width; ``None`` takes ``datamodule.d_in`` at setup (recorded in the hyperparameters, so
            checkpoints reload without the DataModule).
        expansion: ``d_sae = expansion · d_in``.
        architecture: ``"relu"`` (L1), ``"jumprelu"`` (L0, straight-through) or ``"topk"`` (+ AuxK).
        k: active latents per token for ``"topk"``.
        l1_coefficient: :math:`\lambda` of ``"relu"`` (FAST: 5).
        l0_coefficient: :math:`\lambda` of ``"jumprelu"`` (FAST: 0.01).
        jumprelu_threshold: :math:`\theta_0` (FAST: 0.001).
        jumprelu_bandwidth: :math:`\varepsilon` (FAST: 0.001).
        aux_coefficient: :math:`\alpha_{aux}` of ``"topk"`` (1/32).
        aux_relu: ReLU the dead latents' pre-activations before AuxK's top-k. Default False, SAELens's
            convention: with all-negative dead pre-activations (the usual case) the ReLU makes AuxK zero and
            gives dead latents no gradient toward the residual; without it the least negative ones are pushed
            to explain the residual. True is this library's earlier behaviour.
        rescale_acts_by_decoder_norm: ``"topk"`` only: SAELens's TopK training convention -- decoder rows are
            not renormalised (nor their gradients projected) and the SAE selects and decodes through
            :math:`z_i\lVert d_i\rVert` (:class:`~lightning_llm.sae.SparseAutoencoder`). Default False: unit
            rows, renormalised after every step.
        dead_window_tokens: a latent that has not fired for this many training tokens is dead (AuxK, logging).
        lr: Adam peak learning rate (FAST: 7e-5).
        min_lr_ratio: cosine floor as a fraction of ``lr`` (FAST: 7e-6 / 7e-5 = 0.1).
        warmup_steps: linear learning-rate warm-up steps.
        sparsity_warmup_steps: steps over which :math:`\lambda` ramps from 0 to its value.
        betas: Adam betas.
        normalize_activations: scale inputs so :math:`\mathbb{E}\lVert c x\rVert = \sqrt{d}`; False keeps c = 1.
        init_sample_tokens: activations used to set :math:`c` and :math:`b_{dec}` at the start of fit.
        compute_delta_loss: splice the SAE into the DataModule's backbone during validation.
        seed: seed of the SAE's initial directions.
    """

    def __init__(
        self,
        d_in: int | None = None,
        *,
        expansion: int = 8,
        architecture: Architecture = "topk",
        k: int = 32,
        l1_coefficient: float = 5.0,
        l0_coefficient: float = 0.01,
        jumprelu_threshold: float = 0.001,
        jumprelu_bandwidth: float = 0.001,
        aux_coefficient: float = 1 / 32,
        aux_relu: bool = False,
        rescale_acts_by_decoder_norm: bool = False,
        dead_window_tokens: int = 1_000_000,
        lr: float = 7e-5,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 0,
        sparsity_warmup_steps: int = 0,
        betas: tuple[float, float] = (0.9, 0.999),
        normalize_activations: bool = True,
        init_sample_tokens: int = 4096,
        compute_delta_loss: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {architecture!r}; choose one of {ARCHITECTURES}")
        if expansion < 1:
            raise ValueError(f"expansion must be >= 1, got {expansion}")
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        for name, value in (
            ("l1_coefficient", l1_coefficient),
            ("l0_coefficient", l0_coefficient),
            ("aux_coefficient", aux_coefficient),
            ("warmup_steps", warmup_steps),
            ("sparsity_warmup_steps", sparsity_warmup_steps),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if rescale_acts_by_decoder_norm and architecture != "topk":
            raise ValueError(
                f"rescale_acts_by_decoder_norm applies to architecture='topk' only, got {architecture!r}"
            )
        if dead_window_tokens < 1 or init_sample_tokens < 1:
            raise ValueError("dead_window_tokens and init_sample_tokens must be >= 1")
        self.save_hyperparameters()
        self.sae: SparseAutoencoder | None = None
        if d_in is not None:
            self._build(d_in)

    def _build(self, d_in: int) -> None:
        hp = self.hparams
        self.sae = SparseAutoencoder(
            d_in,
            hp.expansion * d_in,
            hp.architecture,
            k=hp.k,
            jumprelu_threshold=hp.jumprelu_threshold,
            jumprelu_bandwidth=hp.jumprelu_bandwidth,
            seed=hp.seed,
            rescale_acts_by_decoder_norm=hp.rescale_acts_by_decoder_norm,
        )
        # Training tokens since each latent last fired; a checkpointed buffer, so dead-latent state resumes.
        self.register_buffer("tokens_since_fired", torch.zeros(self.sae.d_sae, dtype=torch.long))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        self._metrics = _ValidationMetrics()

    # --------------------------------------------------------------------------------- setup

    @override
    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        data_d_in = getattr(datamodule, "d_in", None)
        if self.sae is None:
            if data_d_in is None:
                raise ValueError(
                    "SparseAutoencoderModule(d_in=None) takes d_in from the DataModule, but it has no `d_in`; "
                    "pass d_in explicitly"
                )
            self.hparams.d_in = int(data_d_in)
            self._build(int(data_d_in))
        elif data_d_in is not None and int(data_d_in) != self.sae.d_in:
            raise ValueError(
                f"the SAE has d_in={self.sae.d_in} but the DataModule's activations have width {data_d_in}"
            )

    @override
    def on_fit_start(self) -> None:
        if bool(self.initialized):  # resumed: c and b_dec come from the checkpoint
            return
        sample = self._init_sample()
        sae = self.sae
        with torch.no_grad():
            if self.hparams.normalize_activations:
                mean_norm = sample.norm(dim=-1).mean().clamp_min(1e-12)
                sae.input_scale.fill_(math.sqrt(sae.d_in) / float(mean_norm))
            sae.b_dec.copy_(geometric_median(sample * sae.input_scale))
            self.initialized.fill_(True)
        # Every DDP rank sees the same sample (the DataModule's is seeded), so the replicas stay identical.

    def _init_sample(self) -> Tensor:
        n = self.hparams.init_sample_tokens
        datamodule = getattr(self.trainer, "datamodule", None)
        if hasattr(datamodule, "sample_activations"):
            sample = datamodule.sample_activations(n)
        else:
            batch = next(iter(self.trainer.fit_loop._data_source.dataloader()))
            sample = batch["activations"].reshape(-1, self.sae.d_in)[:n]
        return sample.to(self.device, torch.float32)

    # ------------------------------------------------------------------------------- training

    def sparsity_coefficient(self) -> float:
        """:math:`\\lambda_t`: the architecture's coefficient, ramped linearly over ``sparsity_warmup_steps``."""
        hp = self.hparams
        base = {"relu": hp.l1_coefficient, "jumprelu": hp.l0_coefficient, "topk": 0.0}[hp.architecture]
        if hp.sparsity_warmup_steps > 0:
            base *= min(1.0, (self.global_step + 1) / hp.sparsity_warmup_steps)
        return base

    def losses(
        self, x: Tensor, *, with_l0: bool = True, special_mask: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Loss terms for raw activations ``x [N, d_in]`` (see the module docstring); ``loss`` is their sum.

        Also ``l0`` (active latents per token, detached) unless ``with_l0=False``, and updates the dead-latent
        counters from which latents fired in this batch. With ``special_mask [N]`` (bool), also the detached
        ``mse_special`` and ``mse_ordinary`` (mean per-token squared error of each kind, NaN for a kind absent
        from the batch); they are not part of ``loss``.
        """
        sae, hp = self.sae, self.hparams
        x_scaled = x.to(sae.W_dec.dtype) * sae.input_scale
        acts, indices, l0 = sae.encode_scaled(x_scaled)
        recon = sae.decode_scaled(acts, indices)
        token_error = (recon - x_scaled).pow(2).sum(-1)
        out: dict[str, Tensor] = {"mse": token_error.mean()}
        if hp.architecture == "relu":
            out["sparsity"] = self.sparsity_coefficient() * (acts * sae.W_dec.norm(dim=1)).sum(-1).mean()
        elif hp.architecture == "jumprelu":
            out["sparsity"] = self.sparsity_coefficient() * l0.mean()
        else:
            out["aux"] = self._aux_loss(x_scaled, recon, hp.aux_coefficient)
        out["loss"] = sum(out.values())
        if special_mask is not None:
            with torch.no_grad():
                special = special_mask.reshape(-1).to(device=token_error.device, dtype=torch.bool)
                error = token_error.detach()
                out["mse_special"] = error[special].mean()
                out["mse_ordinary"] = error[~special].mean()
        with torch.no_grad():
            if indices is None:  # dense activations, all >= 0
                fired = acts.amax(0) > 0
                count = (acts > 0).sum(-1) if with_l0 else None
            else:  # sparse: count from the k values, mark latents with a bincount (no [N, d_sae] mask)
                active = acts > 0
                fired = torch.bincount(indices[active], minlength=sae.d_sae) > 0
                count = active.sum(-1)
            if with_l0:
                out["l0"] = count.float().mean()
        self._update_dead(fired, x.shape[0])
        return out

    def _aux_loss(self, x_scaled: Tensor, recon: Tensor, coefficient: float) -> Tensor:
        r"""AuxK: the top-``d/2`` dead latents reconstruct the (detached) residual; zero without dead latents.

        Top-k over the dead latents' raw pre-activations (``aux_relu=False``) or their ReLU (``True``); with
        ``rescale_acts_by_decoder_norm`` over :math:`z_i\lVert d_i\rVert`, decoded divided by the norms, as
        SAELens does."""
        dead = (self.tokens_since_fired >= self.hparams.dead_window_tokens).nonzero().squeeze(1)
        if coefficient == 0 or dead.numel() == 0:
            return recon.new_zeros(())
        sae = self.sae
        k_aux = min(sae.d_in // 2 or 1, dead.numel())
        scale = min(dead.numel() / max(1, sae.d_in // 2), 1.0)
        residual = (x_scaled - recon).detach()
        weight, bias = sae.W_enc[dead], sae.b_enc[dead]
        if sae.rescale_acts_by_decoder_norm:
            norms = sae.W_dec[dead].norm(dim=1)
            weight, bias = weight * norms[:, None], bias * norms
        if self.hparams.aux_relu:
            values, positions = topk_encode(x_scaled - sae.b_dec, weight, bias, k_aux)
        else:
            pre = nn.functional.linear(x_scaled - sae.b_dec, weight, bias)
            values, positions = pre.topk(k_aux, dim=-1, sorted=False)
        if sae.rescale_acts_by_decoder_norm:
            values = values / norms[positions]
        aux_recon = sparse_decode(values, dead[positions], sae.W_dec)
        return coefficient * scale * (aux_recon - residual).pow(2).sum(-1).mean()

    @torch.no_grad()
    def _update_dead(self, fired: Tensor, tokens: int) -> None:
        """``fired [d_sae]`` bool: latents active on some token of this batch (on any rank under DDP)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            fired = fired.int()
            torch.distributed.all_reduce(fired)
            fired = fired.bool()
            tokens *= torch.distributed.get_world_size()
        self.tokens_since_fired.add_(tokens).masked_fill_(fired, 0)

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        x = _activations(batch).reshape(-1, self.sae.d_in)
        log = self._log_this_step()
        special = batch.get("special_mask") if log and isinstance(batch, dict) else None
        out = self.losses(x, with_l0=log, special_mask=special)
        if (
            log
        ):  # self.log costs ~0.3 ms a call, a tenth of a small SAE's step; loggers only write these steps
            batch_size = x.shape[0]
            for name, value in out.items():
                if name in ("mse_special", "mse_ordinary") and not torch.isfinite(value):
                    continue  # no token of that kind in this batch
                self.log(f"train/{name}", value.detach(), batch_size=batch_size, prog_bar=name == "loss")
            dead = (self.tokens_since_fired >= self.hparams.dead_window_tokens).float().mean()
            self.log("train/dead_fraction", dead, batch_size=batch_size)
            self.log("train/sparsity_coefficient", self.sparsity_coefficient(), batch_size=batch_size)
        return out["loss"]

    def _log_this_step(self) -> bool:
        """Lightning's own rule for writing step metrics: every ``log_every_n_steps`` steps (and fast_dev_run)."""
        if self._trainer is None:
            return True
        trainer = self.trainer
        return bool(trainer.fast_dev_run) or (self.global_step + 1) % max(1, trainer.log_every_n_steps) == 0

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.sae.rescale_acts_by_decoder_norm:  # SAELens's TopK convention leaves the rows free
            self.sae.remove_parallel_gradient()

    @override
    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # Part of the step (not on_train_batch_end, which Lightning calls after the callbacks'): a checkpoint
        # written at the batch end, as ModelCheckpoint and InterruptCheckpoint write it, holds the renormalised rows.
        if not self.sae.rescale_acts_by_decoder_norm:
            self.sae.normalize_decoder()

    # ------------------------------------------------------------------------------ validation

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    @override
    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: dict[str, Tensor], stage: str) -> None:
        x = _activations(batch)
        if x.dim() == 2:  # a flat batch of tokens: treat it as one sequence per token
            x = x[:, None]
        mask = batch.get("attention_mask", torch.ones(x.shape[:2], device=x.device)).bool()
        special = batch.get("special_mask")
        f = self.sae.encode(x)
        x_hat = self.sae.decode(f)
        self._metrics.update(x, x_hat, f, mask, special)
        if self.hparams.compute_delta_loss and "input_ids" in batch:
            datamodule = getattr(self.trainer, "datamodule", None)
            backbone, layer = getattr(datamodule, "backbone", None), getattr(datamodule, "layer", None)
            if backbone is not None and layer is not None:
                self._metrics.delta.layer = int(layer)
                self._metrics.delta.update(
                    backbone.to(self.device), self.sae, batch["input_ids"], batch["attention_mask"]
                )

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_metrics("val")

    @override
    def on_test_epoch_end(self) -> None:
        self._log_metrics("test")

    def _log_metrics(self, stage: str) -> None:
        for name, value in self._metrics.compute().items():
            self.log(f"{stage}/{name}", value, sync_dist=False)
        self._metrics.reset()

    # ------------------------------------------------------------------------------ optimisation

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.Adam(self.sae.parameters(), lr=hp.lr, betas=tuple(hp.betas))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, total, hp.warmup_steps, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def save_pretrained(self, directory: str | Path) -> Path:
        """The trained SAE in safetensors (:meth:`~lightning_llm.sae.SparseAutoencoder.save_pretrained`)."""
        return self.sae.save_pretrained(directory)


class _ValidationMetrics(nn.Module):
    """FAST's evaluation: per-sequence MSE and explained variance, each over all, special and ordinary tokens;
    L0, Delta Loss."""

    def __init__(self) -> None:
        super().__init__()
        self.mse = SequenceMSE()
        self.mse_special = SequenceMSE(special_only=True)
        self.mse_ordinary = SequenceMSE(ordinary_only=True)
        self.explained_variance = ExplainedVariance()
        self.explained_variance_special = ExplainedVariance()
        self.explained_variance_ordinary = ExplainedVariance()
        self.l0 = MeanL0()
        self.delta = DeltaLoss(layer=0)  # the layer is the DataModule's, set before each update

    def update(self, x: Tensor, x_hat: Tensor, f: Tensor, mask: Tensor, special: Tensor | None) -> None:
        self.mse.update(x, x_hat, mask)
        self.explained_variance.update(x, x_hat, mask)
        if special is not None:
            self.mse_special.update(x, x_hat, mask, special)
            self.mse_ordinary.update(x, x_hat, mask, special)
            special = special.to(device=mask.device, dtype=torch.bool)
            self.explained_variance_special.update(x, x_hat, mask & special)
            self.explained_variance_ordinary.update(x, x_hat, mask & ~special)
        self.l0.update(f, mask)

    def compute(self) -> dict[str, Tensor]:
        """The metrics that saw data this epoch (``log2_*`` are FAST's reporting scale)."""
        out: dict[str, Tensor] = {}
        for name in ("mse", "mse_special", "mse_ordinary"):
            metric = getattr(self, name)
            if metric.update_count:
                out[name] = metric.compute()
                out[f"log2_{name}"] = torch.log2(out[name])
        for name in ("explained_variance", "explained_variance_special", "explained_variance_ordinary"):
            if getattr(self, name).update_count:
                out[name] = getattr(self, name).compute()
        if self.l0.update_count:
            out["l0"] = self.l0.compute()
        if self.delta.update_count:
            delta = self.delta.compute()
            out["delta_loss"], out["ce_recovered"] = delta["delta_loss"], delta["ce_recovered"]
        return out

    def reset(self) -> None:
        for metric in (
            self.mse,
            self.mse_special,
            self.mse_ordinary,
            self.explained_variance,
            self.explained_variance_special,
            self.explained_variance_ordinary,
            self.l0,
            self.delta,
        ):
            metric.reset()


def _activations(batch: dict[str, Tensor] | Tensor) -> Tensor:
    if isinstance(batch, Tensor):
        return batch
    if "activations" not in batch:
        raise KeyError(f"an SAE batch needs an 'activations' tensor; got keys {sorted(batch)}")
    return batch["activations"]
