r"""A latent memory of evicted tokens (METHODS §11): evicted keys/values folded into a linear-attention state.

Per layer :math:`\ell` and KV head, every token the budgeted cache evicts is folded into

.. math::

    S \mathrel{+}= \phi(k)^\top v, \qquad z \mathrel{+}= \phi(k), \qquad \phi(x) = \mathrm{elu}(x) + 1,

with ``k`` the RoPE-rotated key. A query head ``h`` (reading KV head ``j(h)`` as in grouped-query attention)
with RoPE-rotated query ``q_t`` then adds, gated, to its attention output (before ``o_proj``)

.. math::

    o_{t,h} \mathrel{+}= g_{t,h}\, \frac{\phi(q_t) S_{j(h)}}{\phi(q_t) \cdot z_{j(h)} + \varepsilon},
    \qquad g_{t,h} = \sigma(W^g_\ell h_t + b^g_\ell)_h,

the readout of :func:`lightning_llm.kernels.budgeted_attention` (same :func:`~lightning_llm.kernels.budgeted_attention.phi`
and ``ε``), where ``h_t`` is the layer's attention input. The gate starts nearly closed
(``σ(gate_bias) ≈ 0.05``) and is what :class:`~lightning_llm.modules.IndexMemModule` trains, by distilling the
full-cache outputs. With nothing evicted there is no state and nothing is added: the output is exactly the
cache's. The readout a forward adds uses the state from before that forward's own evictions (a token is never
both attended to and read from memory in the same step).

Exact forms in the paper (arXiv 2605.25475) are unverified: ``φ``, ``ε``, the placement of the residual (head
outputs before ``o_proj``) and the token-dependent sigmoid gate are our reading.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from lightning_llm.eviction.base import check_model, rotated_queries
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
    """

    def __init__(self, num_layers: int, hidden_size: int, num_heads: int, gate_bias: float = -3.0) -> None:
        super().__init__()
        self.num_heads = int(num_heads)
        self.gates = nn.ModuleList(nn.Linear(hidden_size, num_heads) for _ in range(num_layers))
        for gate in self.gates:
            nn.init.zeros_(gate.weight)
            nn.init.constant_(gate.bias, gate_bias)
        self._state: dict[int, tuple[Tensor, Tensor]] = {}
        self._snapshot: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self.evicted_tokens = 0

    @classmethod
    def for_model(cls, model: nn.Module, gate_bias: float = -3.0) -> LatentMemory:
        """A memory sized for ``model`` (an HF decoder)."""
        config = model.config.get_text_config(decoder=True)
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads, gate_bias)

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
    def attach(self, model: nn.Module) -> Iterator[LatentMemory]:
        """Hook ``model``'s attention modules so that each forward adds the gated readout to the head outputs."""
        modules = check_model(model, needs_attention=True)
        if len(modules) != len(self.gates):
            raise ValueError(f"LatentMemory has {len(self.gates)} layers, the model {len(modules)}")
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
            read = read * gate.transpose(1, 2)[..., None]
            b, hq, t, d = read.shape
            return (heads + read.transpose(1, 2).reshape(b, t, hq * d).to(heads.dtype), *args[1:])

        return hook
