r"""Activation steering: add a vector to the residual stream at the output of decoder layer(s).

A steering vector :math:`v_\ell` for layer :math:`\ell` changes that layer's output hidden state,

.. math::
    h_\ell(x)_t \;\leftarrow\; h_\ell(x)_t + m\, v_\ell \qquad \text{for every steered position } t,

with multiplier :math:`m`. Vectors are trained from contrast pairs :math:`(x^+_i, x^-_i)` by reading the
residual after layer :math:`\ell` at each text's last (non-pad) token,

.. math::
    v^{\text{diffmean}}_\ell = \frac{1}{N}\sum_i \big(h_\ell(x^+_i) - h_\ell(x^-_i)\big),

or, repeng-style, the first principal direction :math:`w` of the differences rescaled to the mean difference's
projection, :math:`v^{\text{pca}}_\ell = \langle \bar d, w\rangle\, w` (sign so that :math:`\langle v, \bar d\rangle \ge 0`).

Layer convention (the same everywhere in this module): *layer* :math:`\ell` is the 0-based index into the
decoder's layer list (:func:`decoder_layers`), and :math:`h_\ell` is the **output of that layer**, read and
written by a forward hook on it. That equals Hugging Face's ``output_hidden_states[ℓ + 1]`` for every layer but
the last (HF applies the final norm to its last entry; the hook sees the un-normed output). So a vector trained
at layer :math:`\ell` by :func:`train_steering_vector` is added at exactly the place it was read by
:class:`ActivationSteering`. ``steering-vectors``' ``layer_type="decoder_block"`` uses the same indexing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.backbones.inspect import decoder_layers, find_layers, layer_index, layer_output_reader

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ActivationSteering", "decoder_layers", "last_token_hidden", "train_steering_vector"]

#: Names the cache has in a forward's keyword arguments across transformers versions / architectures.
_CACHE_KWARGS = ("past_key_values", "cache", "past_key_value", "layer_past")
_POSITIONS = ("prompt", "all")


def _cache_length(kwargs: Mapping[str, Any]) -> int:
    """Tokens already in the KV cache of this forward call (0: a prompt pass or no cache at all)."""
    for name in _CACHE_KWARGS:
        cache = kwargs.get(name)
        if cache is None:
            continue
        if hasattr(cache, "get_seq_length"):
            return int(cache.get_seq_length())
        if isinstance(cache, (tuple, list)) and cache and cache[0] is not None:  # legacy tuple-of-tuples
            return int(cache[0][0].shape[-2])
    return 0


class ActivationSteering(Callback):
    r"""Add :math:`m\,v_\ell` to the output hidden states of decoder layer(s) :math:`\ell` while attached.

    Two ways to use it:

    * **context manager**: ``with ActivationSteering(v, layer=2, multiplier=4.0).attach(model): model.generate(...)``.
      :meth:`attach` binds the model and returns ``self``; entering registers the hooks, leaving removes them,
      also when the block raises. :meth:`register` / :meth:`remove` do the same by hand.
    * **Lightning callback**: hooks are registered on the ``LightningModule`` (whose ``.model`` is the HF
      decoder) at the start of validation / test / predict and removed at its end or on an exception, so
      ``trainer.validate`` / ``predict`` run steered. Only hooks are added; no parameter or buffer changes,
      and after removal the model computes exactly what it did before. Inside ``trainer.fit`` only the
      validation loop is steered, not the training steps. Under DDP each rank hooks its own replica; there is
      no global state.

    Args:
        vectors: one vector (added at every layer in ``layer``) or ``{layer: vector}``. A vector is ``[hidden]``
            (the same for every row) or ``[batch, hidden]`` (row ``b`` of every forward's batch gets its own
            vector, e.g. a per-sample sweep in one ``generate`` call; the batch size must match). Cast to the
            hidden states' dtype and device when added.
        layer: the 0-based decoder layer(s) (see the module docstring for the convention); negative indices
            count from the end. Must be ``None`` or equal to the dict's keys when ``vectors`` is a dict.
        multiplier: :math:`m`.
        positions: ``"all"`` steers every position of every forward pass, generated tokens included;
            ``"prompt"`` steers only forward passes with an empty KV cache, i.e. the prompt pass of
            ``generate`` (and every position of a plain forward), leaving incremental decode steps untouched.
            With ``generate(use_cache=False)`` every step is a full re-forward, hence steered.
    """

    def __init__(
        self,
        vectors: Mapping[int, Tensor] | Tensor,
        layer: int | Sequence[int] | None = None,
        multiplier: float = 1.0,
        positions: Literal["prompt", "all"] = "all",
    ) -> None:
        if positions not in _POSITIONS:
            raise ValueError(f"positions must be one of {_POSITIONS}, got {positions!r}")
        self.vectors = self._normalise_vectors(vectors, layer)
        self.multiplier = float(multiplier)
        self.positions = positions
        self._model: nn.Module | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._steer_this_pass = True
        self._cast: dict[tuple[int, torch.dtype, torch.device, float], Tensor] = {}

    @staticmethod
    def _normalise_vectors(
        vectors: Mapping[int, Tensor] | Tensor, layer: int | Sequence[int] | None
    ) -> dict[int, Tensor]:
        if isinstance(vectors, Tensor):
            if layer is None:
                raise ValueError("a single steering vector needs `layer` (an int or a list of ints)")
            layers = [layer] if isinstance(layer, int) else list(layer)
            if not layers:
                raise ValueError("`layer` is an empty list")
            out = {int(i): vectors for i in layers}
        elif isinstance(vectors, Mapping):
            out = {int(i): v for i, v in vectors.items()}
            if not out:
                raise ValueError("`vectors` is an empty dict")
            if layer is not None:
                layers = [layer] if isinstance(layer, int) else list(layer)
                if sorted(layers) != sorted(out):
                    raise ValueError(f"layer={layer} disagrees with the dict's layers {sorted(out)}")
        else:
            raise TypeError(f"vectors must be a Tensor or a dict of Tensors, got {type(vectors).__name__}")
        for i, v in out.items():
            if not isinstance(v, Tensor) or v.ndim not in (1, 2):
                raise ValueError(
                    f"steering vector for layer {i} must be [hidden] or [batch, hidden], got "
                    f"{tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__}"
                )
        return {i: v.detach() for i, v in out.items()}

    # ------------------------------------------------------------------ binding and hooks

    def attach(self, model: nn.Module) -> ActivationSteering:
        """Bind ``model`` for use as a context manager; returns ``self`` (hooks are added on ``__enter__``)."""
        if self._handles:
            raise RuntimeError("already registered; remove() before attaching another model")
        self._model = model
        return self

    def __enter__(self) -> ActivationSteering:
        if self._model is None:
            raise RuntimeError("no model bound: use `with steering.attach(model):`")
        self.register(self._model)
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @property
    def active(self) -> bool:
        """Whether hooks are currently registered."""
        return bool(self._handles)

    def register(self, model: nn.Module) -> None:
        """Register the hooks on ``model`` (an HF decoder or a module wrapping one as ``.model``)."""
        if self._handles:
            raise RuntimeError("hooks already registered; call remove() first")
        backbone, layers = find_layers(model)
        hidden = getattr(
            getattr(model, "config", None) or getattr(backbone, "config", None), "hidden_size", None
        )
        resolved = {}
        for i, v in self.vectors.items():
            j = layer_index(i, len(layers))
            if hidden is not None and v.shape[-1] != hidden:
                raise ValueError(
                    f"steering vector for layer {i} has size {v.shape[-1]}, the model's hidden size is {hidden}"
                )
            resolved[j] = v
        self._cast.clear()
        self._steer_this_pass = True
        try:
            if self.positions == "prompt":
                # The backbone sees the cache on every forward; one pre-hook decides for all layers of that pass.
                self._handles.append(
                    backbone.register_forward_pre_hook(self._on_backbone_call, with_kwargs=True)
                )
            for j, v in resolved.items():
                # prepend: run before any hook already on the layer (transformers 5 records
                # ``output_hidden_states`` with one), so recorded hidden states are the steered ones, as in v4.
                self._handles.append(layers[j].register_forward_hook(self._make_hook(j, v), prepend=True))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Remove every hook (idempotent). The model is then exactly as before :meth:`register`."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._cast.clear()

    def _on_backbone_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._steer_this_pass = _cache_length(kwargs) == 0

    def _vector_for(self, layer: int, vector: Tensor, like: Tensor) -> Tensor:
        if like.shape[-1] != vector.shape[-1]:
            raise ValueError(
                f"steering vector for layer {layer} has size {vector.shape[-1]}, the hidden states have "
                f"{like.shape[-1]}"
            )
        if vector.ndim == 2 and (like.ndim != 3 or like.shape[0] != vector.shape[0]):
            raise ValueError(
                f"per-row steering vectors for layer {layer} are [{vector.shape[0]}, hidden], the hidden states "
                f"{tuple(like.shape)}"
            )
        key = (layer, like.dtype, like.device, self.multiplier)  # the multiplier may be changed between calls
        if key not in self._cast:  # cast once per dtype/device, not once per decode step
            cast = (self.multiplier * vector.to(device=like.device, dtype=torch.float32)).to(like.dtype)
            self._cast[key] = (
                cast[:, None, :] if cast.ndim == 2 else cast
            )  # [batch, 1, hidden]: every position
        return self._cast[key]

    def _make_hook(self, layer: int, vector: Tensor) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not self._steer_this_pass:
                return None
            hidden = output[0] if isinstance(output, tuple) else output
            steered = hidden + self._vector_for(layer, vector, hidden)
            return (steered, *output[1:]) if isinstance(output, tuple) else steered

        return hook

    # ------------------------------------------------------------------ Lightning hooks

    def _start(self, pl_module: L.LightningModule) -> None:
        if self._handles:  # e.g. validation inside fit after a manual register: keep the existing hooks
            return
        self.register(pl_module)

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(pl_module)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.remove()

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(pl_module)

    @override
    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.remove()

    @override
    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(pl_module)

    @override
    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.remove()

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.remove()


# ---------------------------------------------------------------------------------------------- reading


@torch.no_grad()
def last_token_hidden(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    layer: int,
    batch_size: int = 16,
) -> Tensor:
    r"""``[N, hidden]`` float32 output of decoder layer ``layer`` at each text's last non-pad token.

    :math:`h_\ell(x)_{T_x}` in the module's convention (the layer's output, read by a forward hook; equal to
    HF's ``hidden_states[layer + 1]`` except at the last layer). Texts are tokenized as given (the tokenizer's
    own special-token rule), batched with the tokenizer's padding side; the last real token is found from the
    attention mask and position ids are computed from it, so left and right padding give the same states.
    The forward stops after ``layer``. The model's train/eval mode is restored afterwards.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not texts:
        raise ValueError("no texts")
    device = next(model.parameters()).device
    rows = []
    with layer_output_reader(model, layer) as read:
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(list(texts[start : start + batch_size]), return_tensors="pt", padding=True)
            mask = enc["attention_mask"].to(device)
            if bool((mask.sum(-1) == 0).any()):
                raise ValueError("a text tokenizes to no tokens")
            # Positions count real tokens only: under left padding HF would otherwise shift them.
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            hidden = read(
                input_ids=enc["input_ids"].to(device), attention_mask=mask, position_ids=position_ids
            )
            last = (mask * torch.arange(mask.shape[1], device=device)).argmax(-1)
            rows.append(hidden[torch.arange(hidden.shape[0], device=device), last].float())
    return torch.cat(rows)


def _pca_vector(differences: Tensor) -> Tensor:
    r""":math:`\langle \bar d, w\rangle w`, :math:`w` the first right singular vector of the (uncentred) differences.

    Uncentred on purpose: centring would remove the shared shift that *is* the concept, leaving the direction
    of largest spread around it. The sign of :math:`w` is irrelevant after the projection.
    """
    mean = differences.mean(0)
    _, _, vh = torch.linalg.svd(differences.double(), full_matrices=False)
    w = vh[0].to(differences.dtype)
    return (mean @ w) * w


def train_steering_vector(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    pairs: Sequence[tuple[str, str]],
    layer: int,
    method: Literal["diffmean", "pca"] = "diffmean",
    batch_size: int = 16,
) -> Tensor:
    r"""A ``[hidden]`` float32 steering vector for decoder layer ``layer`` from ``(positive, negative)`` texts.

    With :math:`d_i = h_\ell(x^+_i) - h_\ell(x^-_i)` read by :func:`last_token_hidden`:

    * ``"diffmean"``: :math:`v = \bar d = \frac1N \sum_i d_i`;
    * ``"pca"``: :math:`v = \langle \bar d, w\rangle w` with :math:`w` the first principal direction of the
      uncentred :math:`d_i` (repeng's ``pca_diff`` idea), i.e. sign-aligned with and scaled to the mean
      difference's projection on it.

    The vector is meant for ``ActivationSteering(v, layer=layer)``: it is read and added at the same place.
    """
    if method not in ("diffmean", "pca"):
        raise ValueError(f"method must be 'diffmean' or 'pca', got {method!r}")
    if not pairs:
        raise ValueError("no contrast pairs")
    positives = [p for p, _ in pairs]
    negatives = [n for _, n in pairs]
    differences = last_token_hidden(model, tokenizer, positives, layer, batch_size) - last_token_hidden(
        model, tokenizer, negatives, layer, batch_size
    )
    if method == "diffmean":
        return differences.mean(0)
    return _pca_vector(differences)
