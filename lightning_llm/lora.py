r"""LoRA layers in PEFT's layout, with merge/unmerge and PEFT-loadable adapters.

LoRA (Hu et al., 2021) freezes a linear layer's weight :math:`W_0 \in \mathbb{R}^{d_{out} \times d_{in}}` and
learns a rank-``r`` update:

.. math::

    y = x W_0^\top + b + s \cdot \big(\mathrm{dropout}(x)\, A^\top\big) B^\top, \qquad
    A \in \mathbb{R}^{r \times d_{in}},\; B \in \mathbb{R}^{d_{out} \times r},\;
    s = \alpha / r \;(\text{rsLoRA: } \alpha / \sqrt{r}).

``A`` and ``B`` are stored as ``lora_A.weight`` / ``lora_B.weight`` exactly as PEFT names them, ``A`` is
initialised like PEFT's default (Kaiming-uniform with ``a = √5``) and ``B`` at zero, so training starts at
the base model. :func:`save_adapter` writes ``adapter_config.json`` + ``adapter_model.safetensors`` that
``peft.PeftModel.from_pretrained`` loads unchanged.

ScaLoRA (:class:`lightning_llm.callbacks.ScaLoRA`) and merge-and-restart
(:class:`lightning_llm.callbacks.LoRARestart`) fold updates into :math:`W_0` during training; after that the
adapter alone no longer describes the model (its accumulated update is high rank), so :func:`save_adapter`
refuses and :func:`merge_lora` + ``save_pretrained`` saves the whole model instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from lightning_llm.kernels import lora_linear, use_triton

__all__ = [
    "LoRAConfig",
    "LoRALinear",
    "apply_lora",
    "disable_adapters",
    "fold_adapters",
    "iter_effective_weights",
    "load_adapter",
    "lora_layers",
    "merge_lora",
    "module_matches",
    "save_adapter",
    "stable_rank",
]

#: Projection names of Llama/Qwen/Mistral-style decoders (attention and MLP), PEFT's usual choice.
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's saved keys are the module path inside ``PeftModel`` (``base_model.model.<path>``) without the
# adapter name.
_PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAConfig:
    """Which layers get an adapter and how it is scaled.

    Args:
        r: rank of the update.
        alpha: scaling numerator; the branch is multiplied by ``alpha / r`` (``alpha / √r`` with rsLoRA).
        target_modules: names of ``nn.Linear`` modules to adapt, matched against the last component(s)
            of the module path (``"q_proj"`` matches ``model.layers.0.self_attn.q_proj``), or
            ``"all-linear"`` for every linear layer except the output head.
        dropout: dropout on the adapter's input (training only).
        use_rslora: rank-stabilised scaling ``alpha / √r`` (Kalajdzievski, 2023).
    """

    r: int = 8
    alpha: float = 16.0
    target_modules: list[str] | str = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    dropout: float = 0.0
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {self.r}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            self.target_modules = [self.target_modules]

    @property
    def scale(self) -> float:
        """The factor ``s`` multiplying the low-rank branch."""
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


class LoRALinear(nn.Module):
    r"""A frozen ``nn.Linear`` plus a trainable rank-``r`` branch: :math:`y = x W_0^\top + b + s (x A^\top) B^\top`.

    On CUDA the forward pass is :func:`lightning_llm.kernels.lora_linear` (one fused Triton kernel); on
    other devices, and with dropout active (the branch then takes a dropped-out copy of ``x``), it is the
    same formula in plain PyTorch, like PEFT's. ``merge()`` adds ``s B A`` into the base weight (inference with no overhead),
    ``unmerge()`` takes it out again.

    Attributes:
        base_layer: the wrapped linear layer (its parameters are frozen).
        lora_A: ``nn.Linear(in, r)``, weight ``(r, in)``.
        lora_B: ``nn.Linear(r, out)``, weight ``(out, r)``.
        scale: ``s``.
        base_modified: whether ScaLoRA or a restart has folded updates into ``base_layer.weight``.
    """

    def __init__(self, base_layer: nn.Linear, r: int, scale: float, dropout: float = 0.0) -> None:
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"LoRALinear wraps nn.Linear, got {type(base_layer).__name__}")
        self.base_layer = base_layer.requires_grad_(False)
        weight = base_layer.weight
        kw = {"device": weight.device, "dtype": weight.dtype}
        self.lora_A = nn.Linear(base_layer.in_features, r, bias=False, **kw)
        self.lora_B = nn.Linear(r, base_layer.out_features, bias=False, **kw)
        self.r = r
        self.scale = float(scale)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.disabled = False  # set by disable_adapters(): the layer is its base layer
        # A buffer, so a resumed checkpoint remembers that the base weight is no longer the pretrained one.
        self.register_buffer("base_modified", torch.zeros((), dtype=torch.bool))
        self.reset_lora_parameters()

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def weight(self) -> Tensor:
        """The frozen base weight (for code that reads ``module.weight``, e.g. dtype checks)."""
        return self.base_layer.weight

    @torch.no_grad()
    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """PEFT's default init: ``A`` Kaiming-uniform (``a = √5``, i.e. U(±1/√in)), ``B = 0``."""
        bound = 1.0 / math.sqrt(self.in_features)
        self.lora_A.weight.uniform_(-bound, bound, generator=generator)
        self.lora_B.weight.zero_()

    def delta_weight(self) -> Tensor:
        """``s B A``, the update the adapter adds to the base weight, in the base weight's dtype."""
        delta = self.scale * (self.lora_B.weight.float() @ self.lora_A.weight.float())
        return delta.to(self.base_layer.weight.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """Add ``s B A`` into the base weight; the branch is skipped until :meth:`unmerge`."""
        if not self.merged:
            self.base_layer.weight += self.delta_weight()
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract ``s B A`` from the base weight again (exact up to floating-point rounding)."""
        if self.merged:
            self.base_layer.weight -= self.delta_weight()
            self.merged = False

    def forward(self, x: Tensor) -> Tensor:
        base = self.base_layer
        if self.merged or self.disabled:
            return base(x)
        if use_triton(x) and not (self.training and isinstance(self.dropout, nn.Dropout)):
            return lora_linear(
                x, base.weight, self.lora_A.weight, self.lora_B.weight, self.scale, bias=base.bias
            )
        # Elsewhere the op would run this same formula as its reference, behind a custom op whose dispatch
        # and argument checks cost more than the matmuls of a small layer (measured 1.4x PEFT's step on CPU).
        return base(x) + self.scale * self.lora_B(self.lora_A(self.dropout(x)))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, scale={self.scale:g}"


def module_matches(name: str, targets: Sequence[str]) -> bool:
    """Whether module path ``name`` is one of ``targets`` or ends with ``.<target>`` (PEFT's rule)."""
    return any(name == t or name.endswith("." + t) for t in targets)


def _output_head_names(model: nn.Module) -> set[str]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {n for n, m in model.named_modules() if head is not None and m is head}


def apply_lora(model: nn.Module, config: LoRAConfig | None = None, **overrides: object) -> nn.Module:
    """Replace the targeted ``nn.Linear`` layers of ``model`` by :class:`LoRALinear`, in place.

    Every other parameter is frozen, so only the adapter factors train. Initialisation draws from the
    global RNG (seed it for reproducibility).

    Args:
        model: any module, typically an HF ``AutoModelForCausalLM``.
        config: a :class:`LoRAConfig`; keyword ``overrides`` (``r=16``...) build or update one.

    Returns:
        ``model`` (for chaining).

    Raises:
        ValueError: if nothing matches ``target_modules`` (the message lists the linear layers there are),
            if the output head is targeted, or if the model already has adapters.
    """
    config = LoRAConfig(**{**(asdict(config) if config else {}), **overrides})  # type: ignore[arg-type]
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("model already has LoRA layers; apply_lora is not cumulative")
    heads = _output_head_names(model)
    linear = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if config.target_modules == "all-linear":
        chosen = [n for n in linear if n not in heads]
    else:
        chosen = [n for n in linear if module_matches(n, config.target_modules)]
        if bad := [n for n in chosen if n in heads]:
            raise ValueError(f"LoRA on the output head {bad} is not supported (it is tied/fused); drop it")
    if not chosen:
        names = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ValueError(
            f"no nn.Linear matches target_modules={config.target_modules!r}; linear layers here: {names}"
        )
    too_wide = {n: (linear[n].in_features, linear[n].out_features) for n in chosen}
    too_wide = {n: w for n, w in too_wide.items() if config.r > min(w)}
    if too_wide:
        name, (d_in, d_out) = next(iter(too_wide.items()))
        raise ValueError(
            f"LoRA rank r={config.r} exceeds the width of {len(too_wide)} targeted layer(s), e.g. {name} "
            f"({d_in} -> {d_out}): a rank-r update of a layer is at most min(in, out) = {min(d_in, d_out)}; "
            "lower r or target other layers"
        )
    model.requires_grad_(False)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = LoRALinear(linear[name], config.r, config.scale, config.dropout)
        setattr(parent, child, layer.train(linear[name].training))  # keep the model's train/eval mode
    model.lora_config = config  # remembered for save_adapter
    return model


@contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Run a block with every adapter of ``model`` switched off: the model is its base model (PEFT's
    ``disable_adapter``; how a LoRA policy's reference model costs no second copy)."""
    layers = _require_layers(model)
    previous = {name: layer.disabled for name, layer in layers.items()}
    for layer in layers.values():
        layer.disabled = True
    try:
        yield model
    finally:
        for name, layer in layers.items():
            layer.disabled = previous[name]


@torch.no_grad()
def fold_adapters(model: nn.Module) -> None:
    """Add every adapter's update into its base weight and zero ``B``, in place: the model computes the same
    function (up to rounding of the merged weight), its adapters start again from zero, and the base is marked
    modified (the adapter alone no longer describes the model)."""
    for layer in _require_layers(model).values():
        if layer.merged:
            raise ValueError("fold_adapters needs unmerged adapters")
        layer.base_layer.weight += layer.delta_weight()
        layer.lora_B.weight.zero_()
        layer.base_modified.fill_(True)


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """All :class:`LoRALinear` modules of ``model`` by module path (empty if none)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def _require_layers(model: nn.Module) -> dict[str, LoRALinear]:
    layers = lora_layers(model)
    if not layers:
        raise ValueError("model has no LoRA layers (call apply_lora first)")
    return layers


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the plain ``nn.Linear`` back, in place.

    The result is an ordinary model (``save_pretrained`` writes a normal checkpoint).
    """
    for name, layer in _require_layers(model).items():
        layer.merge()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.base_layer)
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


def _peft_key(module_path: str, factor: str) -> str:
    return f"{_PEFT_PREFIX}{module_path}.{factor}.weight"


def save_adapter(model: nn.Module, directory: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """Write the adapter in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``peft.PeftModel.from_pretrained(base, directory)`` and :func:`load_adapter` both read it.

    Raises:
        ValueError: if updates were folded into the base weights (ScaLoRA, LoRARestart): the adapter is
            then not the whole update. Save ``merge_lora(model)`` with ``save_pretrained`` instead.
    """
    layers = _require_layers(model)
    if any(bool(layer.base_modified) for layer in layers.values()):
        raise ValueError(
            "updates were folded into the base weights (ScaLoRA / LoRARestart), so the adapter alone is not "
            "the trained model; save merge_lora(model) with save_pretrained instead"
        )
    if any(layer.merged for layer in layers.values()):
        raise ValueError("adapters are merged into the base weights; call unmerge() on them before saving")
    config: LoRAConfig = model.lora_config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, layer in layers.items():
        tensors[_peft_key(path, "lora_A")] = layer.lora_A.weight.detach().contiguous().cpu()
        tensors[_peft_key(path, "lora_B")] = layer.lora_B.weight.detach().contiguous().cpu()
    save_file(tensors, directory / _ADAPTER_WEIGHTS, metadata={"format": "pt"})
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None)
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "use_rslora": config.use_rslora,
        # The exact module paths, so PEFT adapts precisely the layers we did.
        "target_modules": sorted(layers),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    (directory / _ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2) + "\n")
    return directory


def load_adapter(model: nn.Module, directory: str | Path) -> nn.Module:
    """Apply and load an adapter saved by :func:`save_adapter` or by PEFT (``save_pretrained``), in place.

    Raises:
        FileNotFoundError: if the directory lacks ``adapter_config.json`` or the weights.
        ValueError: for a non-LoRA adapter, PEFT options this LoRA does not implement (``fan_in_fan_out``,
            ``use_dora``, per-layer ``rank_pattern`` / ``alpha_pattern``), or weights whose names/shapes do not
            fit ``model``.
    """
    directory = Path(directory)
    for name in (_ADAPTER_CONFIG, _ADAPTER_WEIGHTS):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} not found (not an adapter directory?)")
    raw = json.loads((directory / _ADAPTER_CONFIG).read_text())
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{directory / _ADAPTER_CONFIG}: peft_type {raw.get('peft_type')!r} is not LORA")
    for unsupported in ("fan_in_fan_out", "use_dora"):
        if raw.get(unsupported):
            raise ValueError(f"{directory / _ADAPTER_CONFIG}: {unsupported}=true is not supported")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if raw.get(pattern):
            raise ValueError(
                f"{directory / _ADAPTER_CONFIG}: {pattern}={raw[pattern]} is not supported: LoRALinear layers here "
                f"share one rank and one alpha (r={raw.get('r')}, lora_alpha={raw.get('lora_alpha')}); merge the "
                "adapter with PEFT (merge_and_unload) and load the merged model instead"
            )
    targets = raw["target_modules"]
    config = LoRAConfig(
        r=raw["r"],
        alpha=raw["lora_alpha"],
        target_modules=targets if isinstance(targets, str) else list(targets),
        dropout=raw.get("lora_dropout", 0.0),
        use_rslora=raw.get("use_rslora", False),
    )
    apply_lora(model, config)
    state = load_file(directory / _ADAPTER_WEIGHTS)
    layers = lora_layers(model)
    expected = {_peft_key(p, f): (layer, f) for p, layer in layers.items() for f in ("lora_A", "lora_B")}
    if missing := sorted(set(expected) - set(state)):
        raise ValueError(
            f"{directory / _ADAPTER_WEIGHTS}: missing {len(missing)} tensors, e.g. {missing[:3]}"
        )
    with torch.no_grad():
        for key, (layer, factor) in expected.items():
            target = getattr(layer, factor).weight
            if state[key].shape != target.shape:
                raise ValueError(f"{key}: shape {tuple(state[key].shape)} != model's {tuple(target.shape)}")
            target.copy_(state[key])
    return model


def stable_rank(matrix: Tensor) -> float:
    r"""Stable rank :math:`\|X\|_F^2 / \|X\|_2^2` (0 for the zero matrix): a smooth lower bound on the rank."""
    x = matrix.detach().float()
    top = torch.linalg.matrix_norm(x, ord=2)
    if top == 0:
        return 0.0
    return float(torch.linalg.matrix_norm(x) ** 2 / top**2)


def iter_effective_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(path, W_0 + s B A)`` for every LoRA layer: the weight the layer currently applies."""
    for path, layer in lora_layers(model).items():
        weight = layer.base_layer.weight.detach().float()
        yield path, weight if layer.merged else weight + layer.delta_weight().float()
