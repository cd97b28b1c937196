r"""Sparse autoencoders on residual-stream activations (FAST, arXiv 2506.07691, and the usual architectures).

A sparse autoencoder (SAE) reconstructs an activation :math:`x \in \mathbb{R}^{d}` from a few of
:math:`m = \text{expansion}\cdot d` learned directions:

.. math::
    f(x) = \sigma\big(W_{enc}(c\,x - b_{dec}) + b_{enc}\big), \qquad
    \hat x = \big(W_{dec}^\top f(x) + b_{dec}\big) / c,

with decoder rows :math:`d_i = W_{dec}[i]` of unit norm and :math:`c` a fixed input scale (SAELens'
``expected_average_only_in``: :math:`\mathbb{E}\lVert c\,x\rVert = \sqrt{d}`, so sparsity coefficients mean the
same at every model width). Training minimises, per token and averaged over the batch (in the scaled space),

.. math::
    \mathcal{L} = \lVert c\,x - c\,\hat x\rVert_2^2 + \lambda_t\,\mathcal{S}(f),

with the sparsity term of the architecture:

* ``"relu"`` (standard SAE): :math:`\sigma = \mathrm{ReLU}`, :math:`\mathcal{S} = \sum_i f_i \lVert d_i\rVert_2`
  (L1), FAST's :math:`\lambda = 5`.
* ``"jumprelu"`` (Rajamanoharan et al. 2024): :math:`\sigma(z)_i = z_i\,H(z_i - \theta_i)`, :math:`\mathcal{S} =
  \sum_i H(z_i - \theta_i)` (L0), trained through straight-through pseudo-derivatives with a rectangle kernel of
  bandwidth :math:`\varepsilon` (:func:`lightning_llm.kernels.jumprelu`); FAST's :math:`\lambda = 0.01`,
  :math:`\varepsilon = 0.001`, :math:`\theta_0 = 0.001`.
* ``"topk"`` (Gao et al. 2024): :math:`\sigma = \mathrm{TopK}_k \circ \mathrm{ReLU}`, no sparsity term, plus the
  AuxK loss :math:`\alpha_{aux}\lVert e - \hat e\rVert^2` where :math:`e = c x - c\hat x` (detached) and
  :math:`\hat e` is the decoding of the top-:math:`k_{aux}` *dead* latents (:math:`k_{aux} = d/2`,
  :math:`\alpha_{aux} = 1/32`, scaled down by :math:`\min(1, n_{dead}/k_{aux})` as in SAELens).

:math:`\lambda_t` ramps linearly from 0 over ``sparsity_warmup_steps`` (the sparsity-coefficient warm-up).
:math:`b_{dec}` starts at the geometric median of a sample of (scaled) activations (:func:`geometric_median`);
decoder rows are renormalised after every optimiser step, and the gradient component parallel to each row is
removed before it, so the step is taken on the sphere. Optimiser: Adam with linear warm-up and cosine decay,
FAST's 7e-5 → 7e-6 (``lr``, ``min_lr_ratio=0.1``).

The TopK encoder and its decoder run through the SAE ops of :mod:`lightning_llm.kernels`: only the :math:`k`
active latents are decoded (``sparse_decode``, Triton on CUDA) and the encoder's backward is sparse too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.kernels import jumprelu, sparse_decode, topk_encode
from lightning_llm.metrics.sae import DeltaLoss, ExplainedVariance, MeanL0, SequenceMSE
from lightning_llm.modules.causal_lm import warmup_cosine

__all__ = ["SparseAutoencoder", "SparseAutoencoderModule", "geometric_median"]

Architecture = Literal["relu", "jumprelu", "topk"]
_ARCHITECTURES = ("relu", "jumprelu", "topk")
_CONFIG_FILE = "sae_config.json"
_WEIGHTS_FILE = "sae_weights.safetensors"


def geometric_median(points: Tensor, *, max_iter: int = 100, tol: float = 1e-6, eps: float = 1e-8) -> Tensor:
    r"""The point minimising :math:`\sum_n \lVert p_n - y\rVert_2` (Weiszfeld's algorithm, in fp64).

    Starts at the mean and iterates :math:`y \leftarrow \sum_n w_n p_n / \sum_n w_n` with
    :math:`w_n = 1/\max(\lVert p_n - y\rVert, \epsilon)` until the step is below ``tol`` times the points' scale.
    Robust to outliers where the mean is not, which is why SAE decoders start their bias there (the
    activations of the first token, an attention sink, can be orders of magnitude larger than the rest).

    Args:
        points: ``[N, d]``.

    Returns:
        ``[d]`` in ``points``' dtype.
    """
    if points.dim() != 2 or points.shape[0] == 0:
        raise ValueError(f"points must have shape [N, d] with N >= 1, got {tuple(points.shape)}")
    p = points.double()
    y = p.mean(0)
    scale = p.norm(dim=1).mean().clamp_min(eps)
    for _ in range(max_iter):
        w = 1.0 / (p - y).norm(dim=1).clamp_min(eps)
        new = (w[:, None] * p).sum(0) / w.sum()
        done = (new - y).norm() <= tol * scale
        y = new
        if done:
            break
    return y.to(points.dtype)


class SparseAutoencoder(nn.Module):
    r"""The SAE itself (see the module docstring for the equations); a plain ``nn.Module``.

    ``encode(x) -> f`` (dense, ``[..., d_sae]``), ``decode(f) -> x̂`` and ``forward(x) -> x̂`` all work on *raw*
    activations: the input scale :math:`c` is applied inside, so an SAE can be spliced into a model, steered
    along or analysed without knowing it. Parameters use ``nn.Linear``'s layout: ``W_enc [d_sae, d_in]``,
    ``W_dec [d_sae, d_in]`` (row :math:`i` is feature :math:`i`'s direction).

    Args:
        d_in: activation width :math:`d`.
        d_sae: number of latents :math:`m`.
        architecture: ``"relu"``, ``"jumprelu"`` or ``"topk"``.
        k: active latents per token (``"topk"`` only).
        jumprelu_threshold: initial threshold :math:`\theta_0` (``"jumprelu"``; stored as ``log θ``).
        jumprelu_bandwidth: straight-through bandwidth :math:`\varepsilon` (``"jumprelu"``).
        seed: seed of the initial decoder directions (``W_enc`` starts as ``W_dec``).
    """

    def __init__(
        self,
        d_in: int,
        d_sae: int,
        architecture: Architecture = "topk",
        *,
        k: int = 32,
        jumprelu_threshold: float = 0.001,
        jumprelu_bandwidth: float = 0.001,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if architecture not in _ARCHITECTURES:
            raise ValueError(f"unknown architecture {architecture!r}; choose one of {_ARCHITECTURES}")
        if d_in < 1 or d_sae < 1:
            raise ValueError(f"d_in and d_sae must be >= 1, got d_in={d_in}, d_sae={d_sae}")
        if architecture == "topk" and not 1 <= k <= d_sae:
            raise ValueError(f"k must be in [1, d_sae={d_sae}], got {k}")
        if jumprelu_threshold <= 0 or jumprelu_bandwidth <= 0:
            raise ValueError("jumprelu_threshold and jumprelu_bandwidth must be positive")
        self.d_in, self.d_sae, self.architecture, self.k = d_in, d_sae, architecture, k
        self.bandwidth = float(jumprelu_bandwidth)
        generator = torch.Generator().manual_seed(seed)
        directions = torch.randn(d_sae, d_in, generator=generator)
        directions /= directions.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(directions)
        self.W_enc = nn.Parameter(directions.clone())
        self.b_enc = nn.Parameter(torch.zeros(d_sae))
        self.b_dec = nn.Parameter(torch.zeros(d_in))
        if architecture == "jumprelu":
            self.log_threshold = nn.Parameter(torch.full((d_sae,), math.log(jumprelu_threshold)))
        # c: raw activations are multiplied by it on the way in and divided on the way out.
        self.register_buffer("input_scale", torch.ones(()))

    # ------------------------------------------------------------------------------- the scaled space

    def pre_activations(self, x_scaled: Tensor) -> Tensor:
        """:math:`z = W_{enc}(c x - b_{dec}) + b_{enc}` for already scaled input, ``[..., d_sae]``."""
        return nn.functional.linear(x_scaled - self.b_dec, self.W_enc, self.b_enc)

    def threshold(self) -> Tensor:
        """JumpReLU thresholds :math:`\\theta = e^{\\log\\theta}` (``"jumprelu"`` only)."""
        return self.log_threshold.exp()

    def encode_scaled(self, x_scaled: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(acts, indices, l0)`` in the scaled space.

        ``"topk"``: ``acts`` are the ``[..., k]`` values and ``indices`` their latents (sparse); otherwise
        ``acts`` is dense ``[..., d_sae]`` and ``indices`` None. ``l0`` is JumpReLU's per-token
        straight-through L0 (None for the others).
        """
        if self.architecture == "topk":
            flat = x_scaled.reshape(-1, self.d_in) - self.b_dec
            values, indices = topk_encode(flat, self.W_enc, self.b_enc, self.k)
            return (
                values.reshape(*x_scaled.shape[:-1], self.k),
                indices.reshape(*x_scaled.shape[:-1], self.k),
                None,
            )
        z = self.pre_activations(x_scaled)
        if self.architecture == "relu":
            return torch.relu(z), None, None
        acts, l0 = jumprelu(z, self.threshold(), self.bandwidth)
        return acts, None, l0

    def decode_scaled(self, acts: Tensor, indices: Tensor | None = None) -> Tensor:
        """:math:`W_{dec}^\\top f + b_{dec}`; sparse (only the given latents) when ``indices`` is given."""
        if indices is None:
            return acts @ self.W_dec + self.b_dec
        flat = sparse_decode(
            acts.reshape(-1, acts.shape[-1]), indices.reshape(-1, indices.shape[-1]), self.W_dec
        )
        return flat.reshape(*acts.shape[:-1], self.d_in) + self.b_dec

    # ---------------------------------------------------------------------------- the raw interface

    def encode(self, x: Tensor) -> Tensor:
        """Dense feature activations ``[..., d_sae]`` of raw activations ``x [..., d_in]``."""
        acts, indices, _ = self.encode_scaled(x * self.input_scale)
        if indices is None:
            return acts
        return torch.zeros(*acts.shape[:-1], self.d_sae, dtype=acts.dtype, device=acts.device).scatter(
            -1, indices, acts
        )

    def decode(self, f: Tensor) -> Tensor:
        """Raw reconstruction from dense feature activations ``[..., d_sae]``."""
        return self.decode_scaled(f) / self.input_scale

    @override
    def forward(self, x: Tensor) -> Tensor:
        """Raw reconstruction :math:`\\hat x` of raw activations (sparse decode for ``"topk"``)."""
        acts, indices, _ = self.encode_scaled(x * self.input_scale)
        return self.decode_scaled(acts, indices) / self.input_scale

    # ------------------------------------------------------------------------------- maintenance

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Project decoder rows back to the unit sphere."""
        self.W_dec.div_(self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12))

    @torch.no_grad()
    def remove_parallel_gradient(self) -> None:
        """Drop the part of ``W_dec.grad`` along each row, so a step moves along the sphere (SAELens does too)."""
        if self.W_dec.grad is None:
            return
        grad, rows = self.W_dec.grad, self.W_dec
        # Divided by ||d||² rather than assuming 1: rows are unit norm only to rounding.
        grad.sub_(
            (grad * rows).sum(1, keepdim=True) / rows.pow(2).sum(1, keepdim=True).clamp_min(1e-24) * rows
        )

    @classmethod
    def from_weights(
        cls,
        W_enc: Tensor,
        b_enc: Tensor,
        W_dec: Tensor,
        b_dec: Tensor,
        architecture: Architecture = "relu",
        *,
        threshold: Tensor | None = None,
        input_scale: float = 1.0,
        **kwargs: Any,
    ) -> SparseAutoencoder:
        """An SAE with given weights (e.g. another library's, or a hand-built one), copied as they are.

        ``W_enc`` and ``W_dec`` are ``[d_sae, d_in]`` (transpose SAELens' ``W_enc``); decoder rows are not
        renormalised. ``threshold`` (``[d_sae]``, positive) is required for ``"jumprelu"``; ``kwargs`` go to the
        constructor (``k``, ``jumprelu_bandwidth``).
        """
        if W_enc.shape != W_dec.shape or W_enc.dim() != 2:
            raise ValueError(
                f"W_enc and W_dec must both be [d_sae, d_in], got {tuple(W_enc.shape)}, {tuple(W_dec.shape)}"
            )
        d_sae, d_in = W_dec.shape
        if tuple(b_enc.shape) != (d_sae,) or tuple(b_dec.shape) != (d_in,):
            raise ValueError(
                f"b_enc must be [{d_sae}] and b_dec [{d_in}], got {tuple(b_enc.shape)}, {tuple(b_dec.shape)}"
            )
        if (architecture == "jumprelu") != (threshold is not None):
            raise ValueError("threshold is required for architecture='jumprelu' and only applies to it")
        sae = cls(d_in, d_sae, architecture, **kwargs)
        with torch.no_grad():
            for name, value in (("W_enc", W_enc), ("b_enc", b_enc), ("W_dec", W_dec), ("b_dec", b_dec)):
                getattr(sae, name).copy_(value)
            if threshold is not None:
                sae.log_threshold.copy_(threshold.log())
            sae.input_scale.fill_(input_scale)
        return sae

    # ---------------------------------------------------------------------------------- artefacts

    def config(self) -> dict[str, Any]:
        """Constructor arguments (JSON-serialisable), enough to rebuild this SAE."""
        return {
            "d_in": self.d_in,
            "d_sae": self.d_sae,
            "architecture": self.architecture,
            "k": self.k,
            "jumprelu_bandwidth": self.bandwidth,
        }

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``sae_config.json`` and ``sae_weights.safetensors`` (the input scale included)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / _CONFIG_FILE).write_text(json.dumps(self.config(), indent=2))
        save_file(
            {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()},
            str(directory / _WEIGHTS_FILE),
        )
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> SparseAutoencoder:
        """Load what :meth:`save_pretrained` wrote (safetensors, no pickle)."""
        directory = Path(directory)
        config_path, weights_path = directory / _CONFIG_FILE, directory / _WEIGHTS_FILE
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found: not a directory written by save_pretrained")
        config = json.loads(config_path.read_text())
        sae = cls(**config)
        sae.load_state_dict(load_file(str(weights_path)))
        return sae


class SparseAutoencoderModule(L.LightningModule):
    r"""Train a :class:`SparseAutoencoder` on activation batches (``{"activations": [B, d_in]}``).

    Pair it with :class:`~lightning_llm.datamodules.ActivationDataModule` (``mode="sequential"`` is FAST,
    ``"block"`` the block-training baseline). At the start of ``fit`` the input scale :math:`c` and
    :math:`b_{dec}` (geometric median) are set from ``datamodule.sample_activations(n)`` when the DataModule has
    it, else from the first training batch; a resumed run restores them from the checkpoint instead.

    Validation takes the DataModule's per-dialogue batches (``activations [b, T, d]``, ``attention_mask``,
    ``special_mask``, ``input_ids``) and logs ``val/mse`` (per-sequence MSE, FAST's), ``val/mse_special`` (special
    tokens only) and their ``log2`` versions, ``val/explained_variance``, ``val/l0``, and, when the DataModule
    exposes its frozen ``backbone`` and ``layer``, ``val/delta_loss`` (relative change of the LM loss with the
    reconstruction spliced in) and ``val/ce_recovered``. Training logs the loss terms, ``train/l0`` and
    ``train/dead_fraction`` (latents silent for the last ``dead_window_tokens`` tokens).

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
        if architecture not in _ARCHITECTURES:
            raise ValueError(f"unknown architecture {architecture!r}; choose one of {_ARCHITECTURES}")
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

    def losses(self, x: Tensor, *, with_l0: bool = True) -> dict[str, Tensor]:
        """Loss terms for raw activations ``x [N, d_in]`` (see the module docstring); ``loss`` is their sum.

        Also ``l0`` (active latents per token, detached) unless ``with_l0=False``, and updates the dead-latent
        counters from which latents fired in this batch.
        """
        sae, hp = self.sae, self.hparams
        x_scaled = x.to(sae.W_dec.dtype) * sae.input_scale
        acts, indices, l0 = sae.encode_scaled(x_scaled)
        recon = sae.decode_scaled(acts, indices)
        out: dict[str, Tensor] = {"mse": (recon - x_scaled).pow(2).sum(-1).mean()}
        if hp.architecture == "relu":
            out["sparsity"] = self.sparsity_coefficient() * (acts * sae.W_dec.norm(dim=1)).sum(-1).mean()
        elif hp.architecture == "jumprelu":
            out["sparsity"] = self.sparsity_coefficient() * l0.mean()
        else:
            out["aux"] = self._aux_loss(x_scaled, recon, hp.aux_coefficient)
        out["loss"] = sum(out.values())
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
        """AuxK: the top-``d/2`` dead latents reconstruct the (detached) residual; zero without dead latents."""
        dead = (self.tokens_since_fired >= self.hparams.dead_window_tokens).nonzero().squeeze(1)
        if coefficient == 0 or dead.numel() == 0:
            return recon.new_zeros(())
        sae = self.sae
        k_aux = min(sae.d_in // 2 or 1, dead.numel())
        scale = min(dead.numel() / max(1, sae.d_in // 2), 1.0)
        residual = (x_scaled - recon).detach()
        values, positions = topk_encode(x_scaled - sae.b_dec, sae.W_enc[dead], sae.b_enc[dead], k_aux)
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
        out = self.losses(x, with_l0=log)
        if (
            log
        ):  # self.log costs ~0.3 ms a call, a tenth of a small SAE's step; loggers only write these steps
            batch_size = x.shape[0]
            for name, value in out.items():
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
        self.sae.remove_parallel_gradient()

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
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
        """The trained SAE in safetensors (:meth:`SparseAutoencoder.save_pretrained`)."""
        return self.sae.save_pretrained(directory)


class _ValidationMetrics(nn.Module):
    """FAST's evaluation: per-sequence MSE (all tokens, special tokens), explained variance, L0, Delta Loss."""

    def __init__(self) -> None:
        super().__init__()
        self.mse = SequenceMSE()
        self.mse_special = SequenceMSE(special_only=True)
        self.explained_variance = ExplainedVariance()
        self.l0 = MeanL0()
        self.delta = DeltaLoss(layer=0)  # the layer is the DataModule's, set before each update

    def update(self, x: Tensor, x_hat: Tensor, f: Tensor, mask: Tensor, special: Tensor | None) -> None:
        self.mse.update(x, x_hat, mask)
        if special is not None:
            self.mse_special.update(x, x_hat, mask, special)
        self.explained_variance.update(x, x_hat, mask)
        self.l0.update(f, mask)

    def compute(self) -> dict[str, Tensor]:
        """The metrics that saw data this epoch (``log2_*`` are FAST's reporting scale)."""
        out: dict[str, Tensor] = {}
        for name in ("mse", "mse_special"):
            metric = getattr(self, name)
            if metric.update_count:
                out[name] = metric.compute()
                out[f"log2_{name}"] = torch.log2(out[name])
        if self.l0.update_count:
            out["explained_variance"] = self.explained_variance.compute()
            out["l0"] = self.l0.compute()
        if self.delta.update_count:
            delta = self.delta.compute()
            out["delta_loss"], out["ce_recovered"] = delta["delta_loss"], delta["ce_recovered"]
        return out

    def reset(self) -> None:
        for metric in (self.mse, self.mse_special, self.explained_variance, self.l0, self.delta):
            metric.reset()


def _activations(batch: dict[str, Tensor] | Tensor) -> Tensor:
    if isinstance(batch, Tensor):
        return batch
    if "activations" not in batch:
        raise KeyError(f"an SAE batch needs an 'activations' tensor; got keys {sorted(batch)}")
    return batch["activations"]
