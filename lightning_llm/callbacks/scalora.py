r"""ScaLoRA: optimally column-scaled LoRA (arXiv 2510.23818).

In the paper's notation a LoRA layer is :math:`W = W_0 + A B^\top` with :math:`A \in \mathbb{R}^{m \times r}`,
:math:`B \in \mathbb{R}^{n \times r}` (here ``A = s · lora_B.weight`` and ``B = lora_A.weightᵀ``). Every
``interval`` optimizer steps ScaLoRA rescales the columns, :math:`\tilde A = A\,\mathrm{diag}(\alpha)`,
:math:`\tilde B = B\,\mathrm{diag}(\beta)`, and folds the difference into the frozen weight,

.. math::  W_0 \leftarrow W_0 + A B^\top - \tilde A \tilde B^\top,

so the network's output is unchanged but the next LoRA step — which moves ``W`` by
:math:`\Delta\tilde W = -\eta\,(G B\,\mathrm{diag}(\beta^2) B^\top + A\,\mathrm{diag}(\alpha^2) A^\top G)` to first
order, with :math:`G = \partial\ell/\partial W` — is as close as possible to the full fine-tuning step
:math:`\Delta W^* = -G/L`:

.. math::  \min_{\alpha,\beta}\ \|\Delta W^* - \Delta\tilde W\|_F .

:math:`\Delta\tilde W` is linear in :math:`v = [\alpha^2; \beta^2]`: it is :math:`-\eta\, S_A \mathrm{diag}(v) S_B^\top`
with :math:`S_A = [A,\ GB]` and :math:`S_B = [G^\top A,\ B]`. The normal equations give the closed form

.. math::  \big[(S_A^\top S_A) \odot (S_B^\top S_B)\big]\, v = \lambda / (L\eta), \qquad
           \lambda_k = s_{A,k}^\top G\, s_{B,k}, \qquad [\alpha; \beta] = \sqrt{v},

where :math:`\lambda = [\|G^\top a_k\|^2;\ \|G b_k\|^2]`. :math:`GB` and :math:`G^\top A` are (up to ``s``) the
LoRA gradients, so nothing of size ``m × n`` is formed: the cost per layer is a few ``(m + n) × 2r``
products and one ``2r × 2r`` solve. (The derivation is checked against a brute-force least-squares solve in
the tests.) If :math:`v` has a non-positive entry, one scalar pair :math:`(\alpha, \beta)` shared by all
columns is solved the same way (``fallback="scalar"``); if that fails too, the layer is left as is.

The factors' gradients and AdamW moments follow the chain rule: :math:`\partial\ell/\partial\tilde A =
G B\,\mathrm{diag}(\beta) = (\partial\ell/\partial A)\,\mathrm{diag}(\beta)`, so column ``k`` of ``A``'s gradient
and first moment are multiplied by :math:`\beta_k`, its second moment by :math:`\beta_k^2`, and symmetrically
``B``'s by :math:`\alpha_k`, :math:`\alpha_k^2`. No restart and no warm-up: training continues as if the
optimizer had always seen the rescaled factors.

Order. The rescale runs in ``on_before_optimizer_step``: after the backward pass (``G`` is the gradient of
the step about to be taken) and before gradient clipping and the AdamW update, so with ``interval=1`` every
step is the paper's exact column-optimal step. The paper describes the rescale as happening between steps;
this is the same point in time, seen from the next step's gradient.

Not in the paper, our choices (documented here, parameters below): ``lipschitz=None`` uses ``L = 10/η``
with the current learning rate ``η`` (``Lη = 10``, i.e. the target is a tenth of the full-parameter SGD
step). Since :math:`\alpha_k^2 \approx 1 / (\|a_k\|^2 L\eta)`, ``Lη`` effectively sets the column norms the
factors are brought back to (``≈ 1/√(Lη)``), and with Adam's fixed-size steps smaller factors learn faster.
On the rank-deficient regression of the tests and tutorial, ``Lη ∈ {1, 10, 100, 1000}`` at learning rates
1e-3 and 1e-2 all beat plain LoRA and ``Lη = 10`` was best at both. Columns whose factor or gradient is
exactly zero (``B = 0`` at initialisation) are left out of the solve and keep scale 1.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_llm.callbacks.update_rank import _UpdateRankTracker, log_stable_ranks
from lightning_llm.lora import DEFAULT_TARGET_MODULES, LoRALinear, lora_layers

__all__ = ["ScaLoRA", "apply_column_scales", "optimal_column_scales"]

#: ``Lη`` used when ``lipschitz`` is None (see the module docstring).
DEFAULT_LIPSCHITZ_LR = 10.0

_FIRST_MOMENTS = ("exp_avg", "momentum_buffer")
_SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")
_IGNORED_STATE = ("step",)


def _solve_nonnegative(gram: Tensor, rhs: Tensor) -> Tensor | None:
    """Least-squares solution of ``gram v = rhs`` in float64, or None unless every entry is positive."""
    v = torch.linalg.lstsq(gram.double().cpu(), rhs.double().cpu().unsqueeze(-1)).solution.squeeze(-1)
    if not torch.isfinite(v).all() or (v <= 0).any():
        return None
    return v


def _normal_equations(
    a: Tensor, b: Tensor, grad_b_side: Tensor, grad_a_side: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(M, λ, active)`` of one layer in float64 on the CPU: M is ``2r × 2r``, λ and ``active`` ``2r``."""
    s_a = torch.cat([a, grad_b_side], dim=1).double()
    s_b = torch.cat([grad_a_side, b], dim=1).double()
    gram = (s_a.T @ s_a) * (s_b.T @ s_b)
    lam = torch.cat([grad_a_side.double().pow(2).sum(0), grad_b_side.double().pow(2).sum(0)])
    # A zero factor column (B = 0 at initialisation) or a zero gradient column does not enter ΔW̃ at all.
    active = (s_a.norm(dim=0) > 0) & (s_b.norm(dim=0) > 0)
    return gram.cpu(), lam.cpu(), active.cpu()


def _solve_layer(
    gram: Tensor, lam: Tensor, active: Tensor, lipschitz_lr: float, fallback: str
) -> tuple[Tensor, Tensor, Literal["columns", "scalar", "skipped"]]:
    """Column scales from one layer's normal equations, with the scalar fallback."""
    r = gram.shape[0] // 2
    ones = torch.ones(r, dtype=torch.float64)
    if not active.any():
        return ones, ones.clone(), "skipped"
    idx = active.nonzero().squeeze(1)
    gram, lam = gram[idx][:, idx], lam[idx]
    v = _solve_nonnegative(gram, lam)
    how: Literal["columns", "scalar", "skipped"] = "columns"
    full = torch.ones(2 * r, dtype=torch.float64)
    if v is not None:
        full[idx] = v / lipschitz_lr
    elif fallback == "scalar":
        # One α for all A columns, one β for all B columns: group the unknowns, P^T M P u = P^T λ.
        group = (idx >= r).long()
        groups = group.unique()
        onehot = (group.unsqueeze(1) == groups.unsqueeze(0)).double()
        u = _solve_nonnegative(onehot.T @ gram @ onehot, onehot.T @ lam)
        if u is None:
            return ones, ones.clone(), "skipped"
        full[idx] = (onehot @ u) / lipschitz_lr
        how = "scalar"
    else:
        return ones, ones.clone(), "skipped"
    scales = full.sqrt()
    return scales[:r], scales[r:], how


@torch.no_grad()
def optimal_column_scales(
    a: Tensor,
    b: Tensor,
    grad_b_side: Tensor,
    grad_a_side: Tensor,
    lipschitz_lr: float,
    fallback: str = "scalar",
) -> tuple[Tensor, Tensor, Literal["columns", "scalar", "skipped"]]:
    r"""ScaLoRA's closed-form column scales :math:`(\alpha, \beta)` for one layer (paper notation).

    Args:
        a: ``A`` (``m × r``).
        b: ``B`` (``n × r``).
        grad_b_side: :math:`G B` (``m × r``), the gradient of ``A``.
        grad_a_side: :math:`G^\top A` (``n × r``), the gradient of ``B``.
        lipschitz_lr: the product :math:`L\eta`.
        fallback: ``"scalar"`` solves one shared pair when a column scale would be imaginary; ``"skip"``
            leaves the layer unscaled instead.

    Returns:
        ``(alpha, beta, how)``: float64 CPU vectors of length ``r`` and which solution was used.
    """
    gram, lam, active = _normal_equations(a, b, grad_b_side, grad_a_side)
    return _solve_layer(gram, lam, active, lipschitz_lr, fallback)


def _scale_state(state: dict[str, Any], scale: Tensor, dim: int) -> None:
    shape = [1, 1]
    shape[dim] = -1
    for key, value in state.items():
        if key in _FIRST_MOMENTS:
            value.mul_(scale.reshape(shape).to(value))
        elif key in _SECOND_MOMENTS:
            value.mul_(scale.reshape(shape).to(value).square())
        elif key not in _IGNORED_STATE:
            raise ValueError(
                f"ScaLoRA does not know how to transfer optimizer state {key!r}; supported: AdamW/Adam "
                "(exp_avg, exp_avg_sq, max_exp_avg_sq) and SGD momentum"
            )


@torch.no_grad()
def apply_column_scales(
    layer: LoRALinear, alpha: Tensor, beta: Tensor, optimizer: torch.optim.Optimizer | None = None
) -> None:
    r"""Rescale one layer's factors, fold the difference into ``W_0``, and carry gradients and moments over.

    ``alpha`` scales the columns of the paper's ``A`` (``lora_B.weight[:, k]``), ``beta`` those of ``B``
    (``lora_A.weight[k, :]``). Folding keeps :math:`W_0 + sBA` unchanged up to rounding in the base dtype.
    """
    lora_a, lora_b = layer.lora_A.weight, layer.lora_B.weight
    alpha_t = alpha.to(device=lora_b.device, dtype=torch.float32)
    beta_t = beta.to(device=lora_a.device, dtype=torch.float32)
    old_product = (lora_b.float() * (1.0 - alpha_t * beta_t)) @ lora_a.float()
    layer.base_layer.weight.add_(layer.scale * old_product.to(layer.base_layer.weight.dtype))
    layer.base_modified.fill_(True)
    lora_b.mul_(alpha_t.to(lora_b.dtype))
    lora_a.mul_(beta_t.to(lora_a.dtype).unsqueeze(1))
    # ∂ℓ/∂Ã = (∂ℓ/∂A) diag(β): lora_B's gradient takes β, lora_A's takes α (rows).
    if lora_b.grad is not None:
        lora_b.grad.mul_(beta_t.to(lora_b.grad.dtype))
    if lora_a.grad is not None:
        lora_a.grad.mul_(alpha_t.to(lora_a.grad.dtype).unsqueeze(1))
    if optimizer is not None:
        if lora_b in optimizer.state:
            _scale_state(optimizer.state[lora_b], beta_t, dim=1)
        if lora_a in optimizer.state:
            _scale_state(optimizer.state[lora_a], alpha_t, dim=0)


def _learning_rate(optimizer: torch.optim.Optimizer, param: Tensor) -> float:
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return float(group["lr"])
    raise ValueError("a LoRA factor is not in the optimizer (was it created before apply_lora?)")


class ScaLoRA(Callback):
    r"""Rescale every LoRA layer's columns optimally before each ``interval``-th optimizer step.

    See the module docstring for the equations. The paper reports ``interval=1`` as exact and ``10`` as
    nearly lossless; the rank of the accumulated update grows well past ``r`` (54 vs 4 on LLaMA3-8B, r = 8).

    Args:
        interval: rescale before every ``interval``-th optimizer step (1 = every step).
        lipschitz: the smoothness constant ``L`` of the target step ``−G/L``; ``None`` uses ``10/η`` with the
            current learning rate ``η`` (our choice, see the module docstring).
        fallback: ``"scalar"`` (paper) or ``"skip"`` when some column scale would be imaginary.
        rank_every: log ``stable_rank(W_t − W_0)`` per layer every this many optimizer steps (0: never; it
            keeps one fp32 CPU copy of the adapted weights and runs an SVD per layer).

    The rescaling folds part of the update into the base weights, so the adapter alone is no longer the trained
    model: a module's ``save_dir`` then holds the merged model and, by design, no PEFT adapter
    (``save_dir/adapter`` is not written; the log says so at save time).

    Logged: ``ScaLoRA/fallback_rate`` and ``ScaLoRA/skip_rate`` (cumulative fraction of layer rescales),
    ``ScaLoRA/scale_mean`` (mean of :math:`\alpha\beta` this step), ``ScaLoRA/stable_rank_mean`` and
    ``ScaLoRA/stable_rank/<layer>``.
    """

    def __init__(
        self,
        interval: int = 1,
        lipschitz: float | None = None,
        fallback: Literal["scalar", "skip"] = "scalar",
        rank_every: int = 50,
    ) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        if lipschitz is not None and lipschitz <= 0:
            raise ValueError(f"lipschitz must be positive, got {lipschitz}")
        if fallback not in ("scalar", "skip"):
            raise ValueError(f"fallback must be 'scalar' or 'skip', got {fallback!r}")
        if rank_every < 0:
            raise ValueError(f"rank_every must be >= 0, got {rank_every}")
        self.interval = interval
        self.lipschitz = lipschitz
        self.fallback = fallback
        self.rank_every = rank_every
        self._rank = _UpdateRankTracker(DEFAULT_TARGET_MODULES)
        self.optimizer_steps = 0
        self.counts = {"columns": 0, "scalar": 0, "skipped": 0}

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not lora_layers(pl_module):
            raise ValueError(
                "ScaLoRA needs a model with LoRA layers: pass lora=LoRAConfig(...) to the module"
            )
        if self.rank_every:
            self._rank.snapshot_if_empty(pl_module)

    @torch.no_grad()
    def rescale(self, pl_module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
        """Rescale all LoRA layers of ``pl_module`` from their current gradients; returns the ``αβ`` means.

        The ``2r × 2r`` systems of all layers whose columns are all active are solved in one batched call
        (per rank); the rest (zero columns at initialisation, infeasible solutions) go through the
        per-layer path with its fallback. Both give :func:`optimal_column_scales`'s answer.
        """
        systems: list[tuple[LoRALinear, Tensor, Tensor, Tensor, float]] = []
        for layer in lora_layers(pl_module).values():
            lora_a, lora_b = layer.lora_A.weight, layer.lora_B.weight
            if lora_a.grad is None or lora_b.grad is None:
                continue  # layer unused this step
            lr = _learning_rate(optimizer, lora_a)
            lipschitz_lr = DEFAULT_LIPSCHITZ_LR if self.lipschitz is None else self.lipschitz * lr
            if lipschitz_lr <= 0:  # lr = 0 (e.g. the first warm-up step): nothing to match
                self.counts["skipped"] += 1
                continue
            s = layer.scale
            gram, lam, active = _normal_equations(
                a=s * lora_b.float(),
                b=lora_a.float().T,
                grad_b_side=lora_b.grad.float() / s,
                grad_a_side=lora_a.grad.float().T,
            )
            systems.append((layer, gram, lam, active, lipschitz_lr))

        solved: dict[int, tuple[Tensor, Tensor, str]] = {}
        by_size: dict[int, list[int]] = {}
        for i, (_, gram, _, active, _) in enumerate(systems):
            if bool(active.all()):
                by_size.setdefault(gram.shape[0], []).append(i)
        for size, members in by_size.items():
            grams = torch.stack([systems[i][1] for i in members])
            lams = torch.stack([systems[i][2] for i in members]).unsqueeze(-1)
            v = torch.linalg.lstsq(grams, lams).solution.squeeze(-1)
            feasible = torch.isfinite(v).all(dim=1) & (v > 0).all(dim=1)
            for row, i in enumerate(members):
                if feasible[row]:
                    scales = (v[row] / systems[i][4]).sqrt()
                    solved[i] = (scales[: size // 2], scales[size // 2 :], "columns")

        products: list[float] = []
        for i, (layer, gram, lam, active, lipschitz_lr) in enumerate(systems):
            alpha, beta, how = solved.get(i) or _solve_layer(gram, lam, active, lipschitz_lr, self.fallback)
            self.counts[how] += 1
            if how != "skipped":
                apply_column_scales(layer, alpha, beta, optimizer)
                products.append(float((alpha * beta).mean()))
        return products

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        step = self.optimizer_steps
        self.optimizer_steps += 1
        if step % self.interval == 0:
            products = self.rescale(pl_module, optimizer)
            total = sum(self.counts.values())
            pl_module.log("ScaLoRA/fallback_rate", self.counts["scalar"] / max(total, 1), on_step=True)
            pl_module.log("ScaLoRA/skip_rate", self.counts["skipped"] / max(total, 1), on_step=True)
            if products:
                pl_module.log("ScaLoRA/scale_mean", sum(products) / len(products), on_step=True)
        if self.rank_every and step % self.rank_every == 0 and step > 0:
            log_stable_ranks(pl_module, "ScaLoRA", self._rank.stable_ranks(pl_module))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer_steps": self.optimizer_steps,
            "counts": dict(self.counts),
            **self._rank.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer_steps = state_dict["optimizer_steps"]
        self.counts = dict(state_dict["counts"])
        self._rank.load_state_dict(state_dict)
