"""The frozen reference policy of KL-regularised objectives (DPO, GRPO with ``beta > 0``)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from torch import nn

from lightning_llm.backbones import load_model
from lightning_llm.lm import is_fsdp
from lightning_llm.lora import disable_adapters, lora_layers

__all__ = ["ReferencePolicy"]

Kind = Literal["adapters-off", "loaded", "snapshot"]


class ReferencePolicy:
    r""":math:`\pi_{ref}`: the policy's base with its LoRA adapters switched off (no second copy, as PEFT and TRL
    do), or a frozen copy — loaded from a backbone name, or snapshotted from the policy as it stands.

    It is deliberately not a submodule of the LightningModule, so it is never written into checkpoints:
    :meth:`state` records how it was made and :meth:`restore` rebuilds it from that. An adapters-off reference is
    rebuilt exactly from the checkpoint's own base weights, a loaded one by loading again; only a snapshot of
    weights that exist nowhere else (a fully fine-tuned policy after a warm-up) has to carry its weights.
    """

    def __init__(self) -> None:
        self.kind: Kind | None = None
        self.source: str | None = None
        self._copy: nn.Module | None = None

    @property
    def ready(self) -> bool:
        return self.kind is not None

    def use_adapters_off(self, policy: nn.Module) -> None:
        """The reference is ``policy`` with its adapters off; its base weights must stay fixed from now on."""
        if not lora_layers(policy):
            raise ValueError("an adapters-off reference needs a LoRA policy")
        self.kind, self.source, self._copy = "adapters-off", None, None

    def load(self, name: str, *, dtype: Any = None, trust_remote_code: bool = False) -> None:
        """The reference is the backbone ``name``, loaded and frozen."""
        model = load_model(name, dtype=dtype, trust_remote_code=trust_remote_code)
        self.kind, self.source, self._copy = "loaded", name, _freeze(model)

    def snapshot(self, policy: nn.Module, build: Callable[[], nn.Module] | None = None) -> None:
        """The reference is a frozen copy of ``policy`` as it is now.

        An FSDP-sharded policy cannot be deep-copied: its full weights are gathered (a collective: every rank calls
        this) into ``build()``, a freshly loaded model of the same architecture, kept whole on every rank.
        """
        if is_fsdp(policy):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            if build is None:
                raise ValueError(
                    "snapshotting an FSDP-sharded policy needs `build` (a fresh model to copy into)"
                )
            full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))
            clone = build()
            clone.load_state_dict(full)
        else:
            clone = copy.deepcopy(policy)
        self.kind, self.source, self._copy = "snapshot", None, _freeze(clone)

    @contextmanager
    def model(self, policy: nn.Module) -> Iterator[nn.Module]:
        """The reference network, on ``policy``'s device, for a ``no_grad`` scoring pass."""
        if self.kind is None:
            raise RuntimeError("the reference policy has not been set")
        if self.kind == "adapters-off":
            with disable_adapters(policy):
                yield policy
            return
        device = next(policy.parameters()).device
        if next(self._copy.parameters()).device != device:
            self._copy.to(device)
        yield self._copy

    def state(self) -> dict[str, Any]:
        """What rebuilds the reference on resume (a snapshot carries its weights)."""
        state: dict[str, Any] = {"kind": self.kind, "source": self.source}
        if self.kind == "snapshot":
            state["weights"] = {k: v.detach().cpu() for k, v in self._copy.state_dict().items()}
        return state

    def restore(
        self,
        state: dict[str, Any],
        policy: nn.Module,
        *,
        dtype: Any = None,
        trust_remote_code: bool = False,
        build: Callable[[], nn.Module] | None = None,
    ) -> None:
        """Rebuild from :meth:`state` for ``policy`` (whose weights the checkpoint has already restored)."""
        kind = state.get("kind")
        if kind == "adapters-off":
            self.use_adapters_off(policy)
        elif kind == "loaded":
            self.load(state["source"], dtype=dtype, trust_remote_code=trust_remote_code)
        elif kind == "snapshot":
            # a fresh model to load the stored weights into (a sharded policy cannot be deep-copied)
            self._copy = _freeze(build() if build is not None else copy.deepcopy(policy))
            self._copy.load_state_dict(state["weights"])
            self.kind, self.source = "snapshot", None
        elif kind is not None:
            raise ValueError(f"unknown reference kind {kind!r} in the checkpoint")


def _freeze(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model
