r"""Sparse autoencoders (SAEs) on residual-stream activations: the model, its three activations, and
:func:`geometric_median` (the decoder bias's starting point).

A sparse autoencoder reconstructs an activation :math:`x \in \mathbb{R}^{d}` from a few of
:math:`m = \text{expansion}\cdot d` learned directions:

.. math::
    f(x) = \sigma\big(W_{enc}(c\,x - b_{dec}) + b_{enc}\big), \qquad
    \hat x = \big(W_{dec}^\top f(x) + b_{dec}\big) / c,

with decoder rows :math:`d_i = W_{dec}[i]` of unit norm and :math:`c` a fixed input scale (SAELens'
``expected_average_only_in``: :math:`\mathbb{E}\lVert c\,x\rVert = \sqrt{d}`, so sparsity coefficients mean the
same at every model width). The activation :math:`\sigma` is the architecture's:

* ``"relu"`` (standard SAE): :math:`\sigma = \mathrm{ReLU}`.
* ``"jumprelu"`` (Rajamanoharan et al. 2024): :math:`\sigma(z)_i = z_i\,H(z_i - \theta_i)` with learned
  thresholds :math:`\theta`, trained through straight-through pseudo-derivatives with a rectangle kernel of
  bandwidth :math:`\varepsilon` (:func:`lightning_llm.kernels.jumprelu`).
* ``"topk"`` (Gao et al. 2024): :math:`\sigma = \mathrm{TopK}_k \circ \mathrm{ReLU}`.

``rescale_acts_by_decoder_norm`` (``"topk"`` only; SAELens's TopK training convention): the pre-activations are
multiplied by the decoder row norms before the top-k, :math:`z_i \lVert d_i\rVert`, and the activations divided by
them before decoding, so the SAE computes what the one with unit rows :math:`d_i / \lVert d_i\rVert` would: the
active set is chosen as with normalised rows while the rows themselves are left free (no renormalisation, see
:class:`lightning_llm.modules.SparseAutoencoderModule`). With unit rows it changes nothing.

The TopK encoder and its decoder run through the SAE ops of :mod:`lightning_llm.kernels`: only the :math:`k`
active latents are decoded (``sparse_decode``, Triton on CUDA) and the encoder's backward is sparse too. The
training objective and loop are :class:`lightning_llm.modules.SparseAutoencoderModule`'s.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.kernels import jumprelu, sparse_decode, topk_encode

__all__ = ["ARCHITECTURES", "Architecture", "SparseAutoencoder", "geometric_median"]

Architecture = Literal["relu", "jumprelu", "topk"]
ARCHITECTURES = ("relu", "jumprelu", "topk")
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
        rescale_acts_by_decoder_norm: ``"topk"`` only: select and decode as if the decoder rows were unit norm
            (module docstring); the activations returned by :meth:`encode` are the rescaled ones.
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
        rescale_acts_by_decoder_norm: bool = False,
    ) -> None:
        super().__init__()
        if architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {architecture!r}; choose one of {ARCHITECTURES}")
        if d_in < 1 or d_sae < 1:
            raise ValueError(f"d_in and d_sae must be >= 1, got d_in={d_in}, d_sae={d_sae}")
        if architecture == "topk" and not 1 <= k <= d_sae:
            raise ValueError(f"k must be in [1, d_sae={d_sae}], got {k}")
        if jumprelu_threshold <= 0 or jumprelu_bandwidth <= 0:
            raise ValueError("jumprelu_threshold and jumprelu_bandwidth must be positive")
        if rescale_acts_by_decoder_norm and architecture != "topk":
            raise ValueError(
                f"rescale_acts_by_decoder_norm applies to architecture='topk' only, got {architecture!r}"
            )
        self.rescale_acts_by_decoder_norm = bool(rescale_acts_by_decoder_norm)
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
            weight, bias = self.W_enc, self.b_enc
            if self.rescale_acts_by_decoder_norm:  # z_i ||d_i|| = (||d_i|| w_i) x + ||d_i|| b_i
                norms = self.W_dec.norm(dim=1)
                weight, bias = weight * norms[:, None], bias * norms
            values, indices = topk_encode(flat, weight, bias, self.k)
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
        """:math:`W_{dec}^\\top f + b_{dec}`; sparse (only the given latents) when ``indices`` is given.

        With ``rescale_acts_by_decoder_norm`` the activations are first divided by their rows' norms."""
        if self.rescale_acts_by_decoder_norm:
            norms = self.W_dec.norm(dim=1)
            acts = acts / (norms if indices is None else norms[indices])
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
            "rescale_acts_by_decoder_norm": self.rescale_acts_by_decoder_norm,
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
