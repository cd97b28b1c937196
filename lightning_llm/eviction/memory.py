r"""A latent memory of evicted tokens (docs/methods.md §11): evicted keys/values folded into a linear-attention state.

Per layer :math:`\ell` and KV head, every token the budgeted cache evicts is folded into

.. math::

    S \mathrel{+}= \phi(k)^\top v, \qquad z \mathrel{+}= \phi(k), \qquad \phi(x) = \mathrm{elu}(x) + 1,

with ``k`` the RoPE-rotated key. A query head ``h`` (reading KV head ``j(h)`` as in grouped-query attention)
with RoPE-rotated query ``q_t`` reads

.. math::

    r_{t,h} = \frac{\phi(q_t) S_{j(h)}}{\phi(q_t) \cdot z_{j(h)} + \varepsilon},
    \qquad g_{t,h} = \sigma(W^g_\ell h_t + b^g_\ell)_h,

the readout of :func:`lightning_llm.kernels.budgeted_attention` (same :func:`~lightning_llm.kernels.budgeted_attention.phi`
and ``ε``) and a token-dependent gate, where ``h_t`` is the layer's attention input. How it enters the head's
attention output :math:`o_{t,h}` (before ``o_proj``):

* ``mode="softmax"`` (default): the memory is one more slot of the attention softmax. With :math:`\ell_{t,s}` the
  scaled logits of the keys the forward attended to (the cache's ``attended``) and :math:`Z_t = \sum_s e^{\ell_{t,s}}`,
  the memory's mass is estimated as :math:`m_{t,h} = g_{t,h}\, e^{c_{\ell,h}}\, \phi(q_t)\cdot z_{j(h)}` (the
  linear-attention estimate of the evicted keys' :math:`\sum e^{\ell}`, up to a learned per-head scale :math:`e^{c}`), and

  .. math::

      o_{t,h} \leftarrow \frac{Z_t\, o_{t,h} + m_{t,h}\, r_{t,h}}{Z_t + m_{t,h}}
      = o_{t,h} + \sigma(\log m_{t,h} - \log Z_t)\,(r_{t,h} - o_{t,h}),

  so that a confident match among the kept keys (large :math:`Z_t`) outweighs the blurred readout. It needs the
  cache (``attach(model, cache=...)``; ``generate_with_budget`` passes it). One decode step of this is
  ``budgeted_attention(..., gate=σ(g)·e^c, memory_mode="softmax")`` with the state repeated per query head.
* ``mode="residual"``: :math:`o_{t,h} \mathrel{+}= g_{t,h}\, r_{t,h}` (the first form we built; on one backbone its
  gate opened where the kept keys already held the answer and lowered accuracy, see
  docs/methods.md §11).

The gate starts nearly closed (``σ(gate_bias) ≈ 0.05``) and is what :class:`~lightning_llm.modules.IndexMemModule`
trains (with the mass scale), by distilling the full-cache outputs. With nothing evicted there is no state and
nothing is added: the output is exactly the cache's. The readout a forward adds uses the state from before that
forward's own evictions (a token is never both attended to and read from memory in the same step).

Exact forms in the paper (arXiv 2605.25475) are unverified: ``φ``, ``ε``, the placement of the residual (head
outputs before ``o_proj``) and the token-dependent sigmoid gate are our reading.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from lightning_llm.eviction.base import BudgetedCache, check_model, rotated_queries
from lightning_llm.eviction.indexer import attention_input
from lightning_llm.kernels.budgeted_attention import memory_readout, phi

__all__ = ["LatentMemory"]


class LatentMemory(nn.Module):
    """Gated linear-attention memory of evicted tokens for every layer of a decoder.

    Use it as ``generate_with_budget(..., memory=memory)`` (which resets it, folds evictions in through
    :meth:`on_evict` and adds the readout inside :meth:`attach`), or by hand with a
    :class:`~lightning_llm.eviction.BudgetedCache` built with ``on_evict=memory.on_evict``.

    Args:
        num_layers: decoder layers.
        hidden_size: width of the hidden states (the gate's input).
        num_heads: query heads per layer.
        gate_bias: initial gate logit (``σ(-3) ≈ 0.05``); the gate weights start at zero.
        mode: ``"softmax"`` (default: the readout is one more softmax slot weighed against the attended mass) or
            ``"residual"`` (the gated readout is added); see the module docstring.
    """

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        num_heads: int,
        gate_bias: float = -3.0,
        mode: str = "softmax",
    ) -> None:
        super().__init__()
        if mode not in ("residual", "softmax"):
            raise ValueError(f"mode must be 'residual' or 'softmax', got {mode!r}")
        self.mode = mode
        self.num_heads = int(num_heads)
        if mode == "softmax":  # log e^c of the mass estimate, per layer and query head
            self.log_mass_scale = nn.Parameter(torch.zeros(num_layers, num_heads))
        self.gates = nn.ModuleList(nn.Linear(hidden_size, num_heads) for _ in range(num_layers))
        for gate in self.gates:
            nn.init.zeros_(gate.weight)
            nn.init.constant_(gate.bias, gate_bias)
        self._state: dict[int, tuple[Tensor, Tensor]] = {}
        self._snapshot: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self.evicted_tokens = 0

    @classmethod
    def for_model(cls, model: nn.Module, gate_bias: float = -3.0, mode: str = "softmax") -> LatentMemory:
        """A memory sized for ``model`` (an HF decoder)."""
        config = model.config.get_text_config(decoder=True)
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads, gate_bias, mode)

    def reset(self) -> None:
        """Forget every folded token (a new sequence)."""
        self._state, self._snapshot = {}, {}
        self.evicted_tokens = 0

    def state(self, layer_idx: int) -> tuple[Tensor, Tensor] | None:
        """``(S [B, Hkv, D, D], z [B, Hkv, D])`` of layer ``layer_idx`` in fp32, or ``None`` if nothing was evicted."""
        return self._state.get(layer_idx)

    @torch.no_grad()
    def on_evict(self, layer_idx: int, keys: Tensor, values: Tensor) -> None:
        """Fold evicted ``keys``/``values`` ``[B, Hkv, n, D]`` (RoPE applied) into layer ``layer_idx``'s state."""
        fk = phi(keys.float())
        s_new = torch.einsum("bhnf,bhnd->bhfd", fk, values.float())
        z_new = fk.sum(dim=2)
        prev = self._state.get(layer_idx)
        if prev is not None:
            s_new, z_new = prev[0] + s_new, prev[1] + z_new
        self._state[layer_idx] = (s_new, z_new)
        if layer_idx == 0:
            self.evicted_tokens += keys.shape[2]

    @contextlib.contextmanager
    def attach(self, model: nn.Module, cache=None) -> Iterator[LatentMemory]:
        """Hook ``model``'s attention modules so that each forward adds the gated readout to the head outputs.

        ``cache``: the :class:`~lightning_llm.eviction.BudgetedCache` the forwards use (required in ``"softmax"``
        mode, which reads the attended keys from it).
        """
        modules = check_model(model, needs_attention=True)
        if len(modules) != len(self.gates):
            raise ValueError(f"LatentMemory has {len(self.gates)} layers, the model {len(modules)}")
        if self.mode == "softmax" and cache is None:
            raise ValueError("LatentMemory(mode='softmax') needs the cache: attach(model, cache=cache)")
        self._cache = cache
        self._scaling = {idx: float(module.scaling) for idx, module in modules.items()}
        handles = []
        for idx, module in modules.items():
            handles.append(module.register_forward_pre_hook(self._capture, with_kwargs=True))
            handles.append(module.o_proj.register_forward_pre_hook(self._make_readout_hook(idx)))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._snapshot.clear()

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        idx = int(module.layer_idx)
        state = self._state.get(idx)
        if state is None:  # nothing evicted yet: no readout at all, the output stays exactly the cache's
            self._snapshot.pop(idx, None)
            return
        hidden = attention_input(module, args, kwargs)
        gate = torch.sigmoid(self.gates[idx](hidden.to(self.gates[idx].weight.dtype)))  # [B, T, Hq]
        self._snapshot[idx] = (rotated_queries(module, args, kwargs), gate, *state)

    def _make_readout_hook(self, idx: int):
        def hook(module: nn.Module, args: tuple):
            snap = self._snapshot.pop(idx, None)
            if snap is None:
                return None
            queries, gate, state, norm = snap
            heads = args[0]  # [B, T, Hq * D]
            read = memory_readout(queries, state, norm)  # [B, Hq, T, D]
            b, hq, t, d = read.shape
            if self.mode == "softmax":
                attended, new = self._cache.attended[idx]
                weight = self._slot_weight(idx, queries, attended, new, gate, norm)  # [B, Hq, T]
                out = heads.view(b, t, hq, d).transpose(1, 2).float()
                out = out + weight[..., None] * (read - out)
                return (out.transpose(1, 2).reshape(b, t, hq * d).to(heads.dtype), *args[1:])
            read = read * gate.transpose(1, 2)[..., None]
            return (heads + read.transpose(1, 2).reshape(b, t, hq * d).to(heads.dtype), *args[1:])

        return hook

    def _slot_weight(
        self, idx: int, queries: Tensor, keys: Tensor, new: int, gate: Tensor, norm: Tensor
    ) -> Tensor:
        """``σ(log m − log Z)`` ``[B, Hq, T]`` (``"softmax"`` mode): the memory slot's share of the softmax."""
        b, hq, t, d = queries.shape
        hkv = keys.shape[1]
        if t != new:
            raise RuntimeError(f"layer {idx}: {t} captured queries for {new} new tokens in the cache")
        log_z = BudgetedCache.attention_logits(queries, keys, self._scaling[idx]).logsumexp(dim=-1)
        fq = phi(queries.float()).reshape(b, hkv, hq // hkv, t, d)
        mass = torch.einsum("bhgtf,bhf->bhgt", fq, norm.float()).reshape(b, hq, t)
        log_m = mass.clamp_min(1e-30).log() + gate.transpose(1, 2).float().clamp_min(1e-30).log()
        log_m = log_m + self.log_mass_scale[idx].view(1, hq, 1)
        return torch.sigmoid(log_m - log_z)
