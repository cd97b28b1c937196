"""Finding a decoder's layers and reading their outputs, for any Hugging Face causal LM (or a wrapper of one)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from lightning_llm.backbones.utils import eval_mode

__all__ = ["cache_kwarg", "decoder_layers", "find_layers", "layer_index", "layer_output_reader"]

#: Attribute paths tried, in order, to find the decoder layer list. The wrappers' prefixes come first-class so
#: a LightningModule (``.model``) or a PEFT model (``.base_model.model``) around an HF decoder is found too.
_LAYER_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers")
_WRAPPER_PREFIXES = ("", "model.", "base_model.model.", "model.base_model.model.")


def _get_path(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def find_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """``(backbone, layers)``: the module holding the decoder layer list, and the list."""
    tried = []
    for prefix in _WRAPPER_PREFIXES:
        for path in _LAYER_PATHS:
            full = prefix + path
            tried.append(full)
            layers = _get_path(model, full)
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                owner = _get_path(model, full.rsplit(".", 1)[0])
                return owner, layers
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}: none of {tried} is a non-empty "
        "nn.ModuleList. Pass a Hugging Face decoder (Llama/Qwen/Mistral: model.model.layers; GPT-2: "
        "transformer.h) or a module wrapping one as `.model`."
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a Hugging Face causal LM (``model.model.layers``, ``transformer.h``, ...).

    Also found through a wrapper holding the HF model as ``.model`` (a LightningModule) or a PEFT model.

    Raises:
        ValueError: no known layer list exists on ``model``.
    """
    return find_layers(model)[1]


def layer_index(layer: int, num_layers: int) -> int:
    """``layer`` as a non-negative index into ``num_layers`` decoder layers (negative counts from the end)."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    if not -num_layers <= layer < num_layers:
        raise ValueError(f"layer {layer} out of range for a model with {num_layers} decoder layers")
    return layer % num_layers


class _StopForward(Exception):
    """Raised by the capture hook once the wanted layer has run: the rest of the forward is not needed."""


@contextmanager
def layer_output_reader(model: nn.Module, layer: int) -> Iterator[Callable[..., Tensor]]:
    """Yield ``read(**model_inputs) -> h_layer``: a forward that stops after decoder layer ``layer``.

    ``read`` returns that layer's output hidden states (the module's layer convention) and skips the rest of the
    network. Inside the block the model is in eval mode and the hook is registered; both are undone on exit, also
    on an exception. Every reader of residual activations (steering vectors, SAE harvests, feature contexts)
    goes through it. Raises ``ValueError`` for a layer out of range.
    """
    layers = decoder_layers(model)
    index = layer_index(layer, len(layers))
    captured: list[Tensor] = []

    def capture(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output)
        raise _StopForward

    def read(**inputs: Any) -> Tensor:
        captured.clear()
        try:
            model(**inputs, use_cache=False)
        except _StopForward:
            pass
        return captured[0]

    handle = layers[index].register_forward_hook(capture)
    try:
        with eval_mode(model):
            yield read
    finally:
        handle.remove()


def cache_kwarg(model: nn.Module) -> str:
    """The KV-cache argument of ``model.forward``: ``cache`` from transformers 5.25 on (``past_key_values``
    stays a deprecated alias until 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
