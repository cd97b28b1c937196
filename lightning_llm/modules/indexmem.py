r"""IndexMemModule: train a learned KV-eviction indexer and a latent memory of evicted tokens (docs/methods.md §11).

The backbone is frozen. Per layer, a :class:`~lightning_llm.eviction.LightningIndexer` learns to predict the
layer's attention distribution (averaged over query heads) from the layer's attention input, and a
:class:`~lightning_llm.eviction.LatentMemory` (gate and, in the default ``memory_mode="softmax"``, the per-head
scale of its mass) learns how much of the linear-attention readout of the evicted tokens to mix in. One training step on a batch of prompt + response sequences (``labels`` = -100 on the prompt, as the chat
SFT DataModules produce):

1. **Full cache** (no grad): one forward of the whole batch; the per-layer attention probabilities
   :math:`A_\ell` and attention inputs :math:`h_\ell`, and the teacher logits :math:`p`.
2. **Indexer loss**: :math:`\mathcal{L}_I = \frac{1}{L}\sum_\ell \mathrm{mean}_t\,
   \mathrm{KL}(\bar A_\ell(t,\cdot) \,\|\, \mathrm{softmax}_s I_\ell(t,s))` over the non-padding query rows.
3. **Memory distillation**: rows grouped by prompt length; each group's prompt is prefilled (no grad) through a
   :class:`~lightning_llm.eviction.BudgetedCache` with the current :class:`~lightning_llm.eviction.IndexerPolicy`
   at ``budget`` (or ``ceil(budget_ratio · prompt length)``), the evicted tokens folded into the memory; then the
   response is run in one teacher-forced forward over the kept cache with the memory readout, and
   :math:`\mathcal{L}_M = \mathrm{KL}(p \,\|\, p_{\text{budget+memory}})` on the response's positions.

The loss is :math:`\lambda_I \mathcal{L}_I + \lambda_M \mathcal{L}_M`. The teacher-forced response forward attends
to the prompt's kept set as it stood after prefill; token-by-token decoding (``generate_with_budget``) evicts again
at every step, so late response tokens see slightly fewer prompt tokens there than here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.backbones.inspect import cache_kwarg
from lightning_llm.eviction.base import BudgetedCache, check_model
from lightning_llm.eviction.indexer import IndexerPolicy, LightningIndexer, attention_input, indexer_kl
from lightning_llm.eviction.memory import LatentMemory
from lightning_llm.lm import adamw
from lightning_llm.modules.base import BackboneModule
from lightning_llm.types import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["IndexMemModule", "attention_target"]

_TARGETS = ("future", "current")
_CONFIG_FILE = "indexmem_config.json"
_WEIGHTS_FILE = "indexmem_weights.safetensors"


class IndexMemModule(BackboneModule):
    """A frozen decoder plus a trainable per-layer eviction indexer and latent-memory gate.

    After training, :meth:`policy` gives the :class:`~lightning_llm.eviction.IndexerPolicy` and :attr:`memory` the
    :class:`~lightning_llm.eviction.LatentMemory` to pass to
    :func:`~lightning_llm.eviction.generate_with_budget`.

    Args:
        model: ``"tiny"``, a Hugging Face id or a local directory (the backbone, frozen; loaded with eager
            attention so that its attention probabilities are available).
        budget: KV budget per layer used in the distillation prefill; ``None``: ``budget_ratio`` of each prompt.
        budget_ratio: fraction of the prompt kept when ``budget`` is ``None``; a list cycles through its ratios
            (step ``i``'s ``j``-th prompt-length group uses ``ratios[(i + j) % len]``), so that the memory gate
            learns for budgets where the indexer keeps what the answer needs and for budgets where it cannot.
        sinks, window: the policy's always-kept first / most recent tokens.
        indexer_heads, indexer_dim: indexer heads ``H_I`` and query/key dim ``d_I``.
        accumulate: :class:`~lightning_llm.eviction.IndexerPolicy` accumulates indexer mass over all queries
            (default: only the newest queries vote, which is what a ``"future"`` target is trained for).
        target: the indexer's training distribution, ``"future"`` (default: the attention mass each token seen so
            far will receive from now on) or ``"current"`` (the current query's attention); see
            :func:`attention_target`.
        observation_window: without ``accumulate``, how many of a forward's last queries vote (default 1: the
            newest query's predicted future mass).
        gate_bias: initial memory-gate logit.
        memory_mode: ``"softmax"`` (default: the readout as one more softmax slot weighed against the attended
            mass) or ``"residual"`` (the gated readout added; less reliable, see
            docs/methods.md §11); see :class:`~lightning_llm.eviction.LatentMemory`.
        indexer_weight, memory_weight: ``λ_I``, ``λ_M``; ``memory_weight=0`` trains the indexer alone.
        lr, weight_decay, betas: AdamW over the indexers and gates.
        save_dir: if set, :meth:`save_pretrained` writes the indexers and gates there at the end of ``fit`` (not
            by a ``fast_dev_run``).
        overwrite: let the export replace a ``save_dir`` that holds files another run wrote (or files with no
            export marker); otherwise such a ``save_dir`` stops the fit at its start.
        trust_remote_code: allow a checkpoint's own Python code. Off by default.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        budget: int | None = None,
        budget_ratio: float | list[float] = 0.25,
        sinks: int = 4,
        window: int = 8,
        indexer_heads: int = 4,
        indexer_dim: int = 16,
        accumulate: bool = False,
        observation_window: int = 1,
        target: str = "future",
        gate_bias: float = -3.0,
        memory_mode: str = "softmax",
        indexer_weight: float = 1.0,
        memory_weight: float = 1.0,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        save_dir: str | None = None,
        overwrite: bool = False,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        if budget is not None and budget < sinks + window:
            raise ValueError(f"budget ({budget}) must be >= sinks + window ({sinks} + {window})")
        ratios = [budget_ratio] if isinstance(budget_ratio, (int, float)) else list(budget_ratio)
        if not ratios or not all(0.0 < r <= 1.0 for r in ratios):
            raise ValueError(
                f"budget_ratio must be in (0, 1] (or a non-empty list of such), got {budget_ratio}"
            )
        if indexer_weight < 0 or memory_weight < 0 or indexer_weight + memory_weight == 0:
            raise ValueError("indexer_weight and memory_weight must be >= 0 and not both 0")
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if target not in _TARGETS:
            raise ValueError(f"target must be one of {_TARGETS}, got {target!r}")
        self.save_hyperparameters()
        self._init_tokenizer()

    @override
    def prepare_model(self, model: PreTrainedModel) -> PreTrainedModel:
        """The frozen backbone (eager attention, so its attention probabilities exist), and beside it the
        trainable indexers and memory gates sized from it."""
        hp = self.hparams
        model.set_attn_implementation("eager")
        model.requires_grad_(False)
        model.eval()
        check_model(model, needs_attention=True)
        config = model.config.get_text_config(decoder=True)
        self.indexers = nn.ModuleList(
            LightningIndexer(config.hidden_size, hp.indexer_heads, hp.indexer_dim)
            for _ in range(config.num_hidden_layers)
        )
        self.memory = LatentMemory.for_model(model, gate_bias=hp.gate_bias, mode=hp.memory_mode)
        return model

    @property
    def indexers(self) -> nn.ModuleList:
        """One :class:`~lightning_llm.eviction.LightningIndexer` per decoder layer (built with the model)."""
        self.configure_model()
        return self._modules["indexers"]

    @property
    def memory(self) -> LatentMemory:
        """The :class:`~lightning_llm.eviction.LatentMemory` (built with the model)."""
        self.configure_model()
        return self._modules["memory"]

    # ------------------------------------------------------------------------------------------- inference

    def policy(self, **overrides: Any) -> IndexerPolicy:
        """The trained :class:`~lightning_llm.eviction.IndexerPolicy` (``sinks``, ``window``, ``accumulate`` and
        ``observation_window`` from the hyperparameters unless overridden)."""
        keys = ("sinks", "window", "accumulate", "observation_window")
        kwargs = {k: self.hparams[k] for k in keys} | overrides
        return IndexerPolicy(self.indexers, **kwargs)

    def budget_for(self, prompt_length: int, ratio: float | None = None) -> int:
        """The KV budget for a prompt of ``prompt_length`` tokens: ``budget``, else ``ceil(ratio · length)`` (default
        ratio: the first of ``budget_ratio``), at least ``sinks + window``."""
        if self.hparams.budget is not None:
            return int(self.hparams.budget)
        floor = self.hparams.sinks + self.hparams.window
        ratio = self._ratios[0] if ratio is None else ratio
        return max(floor, math.ceil(ratio * prompt_length))

    @property
    def _ratios(self) -> list[float]:
        r = self.hparams.budget_ratio
        return [float(r)] if isinstance(r, (int, float)) else [float(x) for x in r]

    @override
    def train(self, mode: bool = True) -> IndexMemModule:
        super().train(mode)
        if self.model_built:
            self.model.eval()  # frozen: no dropout, whatever Lightning asks
        return self

    # ------------------------------------------------------------------------------------------- losses

    def _full_forward(
        self, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int = 0
    ) -> tuple[Tensor, list[Tensor], tuple]:
        """(logits of the last ``logits_to_keep`` positions, 0: all; attention inputs per layer; attentions)."""
        hiddens: dict[int, Tensor] = {}

        def capture(module, args, kwargs):
            hiddens[int(module.layer_idx)] = attention_input(module, args, kwargs)

        modules = check_model(self.model, needs_attention=True)
        handles = [m.register_forward_pre_hook(capture, with_kwargs=True) for m in modules.values()]
        try:
            with torch.no_grad():
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    output_attentions=True,
                    logits_to_keep=logits_to_keep,
                )
        finally:
            for h in handles:
                h.remove()
        return out.logits.float(), [hiddens[i] for i in sorted(hiddens)], out.attentions

    def indexer_loss(self, hiddens: list[Tensor], attentions: tuple, attention_mask: Tensor) -> Tensor:
        """``L_I``: mean over layers of the row-mean KL between the attention target and ``softmax(I)``."""
        valid = attention_mask.bool()
        losses = []
        for indexer, hidden, attn in zip(self.indexers, hiddens, attentions, strict=True):
            hidden = hidden.detach().to(indexer.key.weight.dtype)
            scores = indexer.scores(hidden, indexer.keys(hidden), causal_offset=0)
            # padding keys get no attention (their probability is 0), padding rows are masked out
            scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
            target = attention_target(attn.float().mean(dim=1), valid, self.hparams.target)
            losses.append(indexer_kl(scores, target, attention_mask))
        return torch.stack(losses).mean()

    def memory_loss(self, input_ids: Tensor, labels: Tensor, teacher_logits: Tensor) -> tuple[Tensor, int]:
        """``L_M`` (mean over response positions) and the number of positions it averages. ``teacher_logits`` are
        the full-cache logits of the last ``teacher_logits.shape[1]`` positions (at least every response's)."""
        offset = input_ids.shape[1] - teacher_logits.shape[1]
        starts = _response_starts(labels)
        total, count = teacher_logits.new_zeros(()), 0
        cache_kw = cache_kwarg(self.model)
        num_layers = len(self.indexers)
        for group, start in enumerate(sorted(set(starts.tolist()))):
            ratio = self._ratios[(self.global_step + group) % len(self._ratios)]
            if start <= 0:
                continue
            rows = (starts == start).nonzero().squeeze(-1)
            ids = input_ids[rows]
            valid = labels[rows, start:] != IGNORE_INDEX  # response tokens (not padding)
            # token t + 1 is predicted at position t: the first response token comes from the prefill's logits,
            # which the memory never changes (nothing was evicted before it), so only later ones are distilled
            targets = valid[:, 1:]
            if ids.shape[1] - start < 2 or not bool(targets.any()):
                continue
            policy = self.policy()
            cache = BudgetedCache(
                policy, self.budget_for(start, ratio), num_layers, on_evict=self.memory.on_evict
            )
            self.memory.reset()
            with cache.attach(self.model), self.memory.attach(self.model, cache=cache):
                with torch.no_grad():
                    self.model(
                        input_ids=ids[:, :start],
                        position_ids=torch.arange(start, device=ids.device).expand(len(rows), -1),
                        use_cache=True,
                        **{cache_kw: cache},
                    )
                cont = ids[:, start:-1]
                student = self.model(
                    input_ids=cont,
                    position_ids=torch.arange(start, ids.shape[1] - 1, device=ids.device).expand(
                        len(rows), -1
                    ),
                    use_cache=True,
                    **{cache_kw: cache},
                ).logits.float()
            self.memory.reset()
            teacher = teacher_logits[rows, start - offset : ids.shape[1] - 1 - offset]
            kl = F.kl_div(student.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="none")
            total = total + (kl.sum(-1) * targets).sum()
            count += int(targets.sum())
        return total / max(count, 1), count

    def _losses(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        input_ids, labels = batch["input_ids"], batch["labels"]
        attention_mask = batch.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hp = self.hparams
        # teacher logits only from the earliest response start on (the [tokens x vocab] tensor of the prompts is
        # never needed); one position when the memory is not trained
        starts = _response_starts(labels)
        first = int(starts[starts > 0].min()) if bool((starts > 0).any()) else input_ids.shape[1] - 1
        keep = input_ids.shape[1] - first if hp.memory_weight > 0 else 1
        logits, hiddens, attentions = self._full_forward(input_ids, attention_mask, logits_to_keep=keep)
        out = {"indexer": self.indexer_loss(hiddens, attentions, attention_mask)}
        loss = hp.indexer_weight * out["indexer"]
        if hp.memory_weight > 0:
            out["memory"], _ = self.memory_loss(input_ids, labels, logits)
            loss = loss + hp.memory_weight * out["memory"]
        # Every gate takes part in the graph even in a step that evicted nothing (DDP needs all parameters used).
        loss = loss + 0.0 * sum(p.sum() for p in self.memory.parameters())
        out["loss"] = loss
        return out

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        losses = self._losses(batch)
        bs = batch["input_ids"].shape[0]
        for name, value in losses.items():
            self.log(f"train/{name}", value.detach(), prog_bar=name == "loss", batch_size=bs, sync_dist=True)
        return losses["loss"]

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        with torch.no_grad():
            losses = self._losses(batch)
        bs = batch["input_ids"].shape[0]
        for name, value in losses.items():
            self.log(f"val/{name}", value, prog_bar=name == "loss", batch_size=bs, sync_dist=True)

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        trainable = nn.ModuleList([self.indexers, self.memory])
        return adamw(trainable, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas))

    @override
    def on_fit_start(self) -> None:
        super().on_fit_start()
        if any(p.requires_grad for p in self.model.parameters()):
            rank_zero_warn("IndexMemModule: backbone parameters require grad; they are not optimised")

    # ------------------------------------------------------------------------------------------- artefacts

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write the indexers and memory gates (safetensors) and their configuration (JSON); not the backbone."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        keep = (
            "budget",
            "budget_ratio",
            "sinks",
            "window",
            "indexer_heads",
            "indexer_dim",
            "accumulate",
            "observation_window",
            "target",
            "gate_bias",
            "memory_mode",
        )
        config = {k: self.hparams[k] for k in keep} | {"model": str(self.hparams.model)}
        (directory / _CONFIG_FILE).write_text(json.dumps(config, indent=2))
        state = {f"indexers.{k}": v for k, v in self.indexers.state_dict().items()}
        state |= {f"memory.{k}": v for k, v in self.memory.state_dict().items()}
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in state.items()}, str(directory / _WEIGHTS_FILE)
        )
        return directory

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, model: str | None = None, **kwargs: Any
    ) -> IndexMemModule:
        """Load what :meth:`save_pretrained` wrote onto ``model`` (default: the backbone it was trained on)."""
        directory = Path(directory)
        config = json.loads((directory / _CONFIG_FILE).read_text())
        backbone = model if model is not None else config.pop("model")
        config.pop("model", None)
        module = cls(backbone, **(config | kwargs))
        state = load_file(str(directory / _WEIGHTS_FILE))
        module.indexers.load_state_dict({k[9:]: v for k, v in state.items() if k.startswith("indexers.")})
        module.memory.load_state_dict({k[7:]: v for k, v in state.items() if k.startswith("memory.")})
        return module


def attention_target(attention: Tensor, valid: Tensor, target: str = "future") -> Tensor:
    r"""The indexer's training distribution per query row ``t`` over keys ``s ≤ t``, from the head-averaged attention
    ``A`` ``[B, T, T]`` (rows: queries) and the non-padding mask ``valid`` ``[B, T]``.

    ``"current"``: :math:`A(t, s)` (match the attention of query ``t`` itself). ``"future"``: the mass the tokens
    seen by ``t`` will receive from ``t`` and every later query, :math:`\propto \sum_{t' \ge t} A(t', s)` for
    ``s ≤ t`` -- what an eviction decision at time ``t`` needs to know.
    """
    if target == "current":
        return attention
    attention = attention * valid[:, :, None].to(attention.dtype)  # padding queries vote for nothing
    future = attention.flip(1).cumsum(1).flip(1)
    t = attention.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=attention.device).tril()
    future = future * causal
    return future / future.sum(-1, keepdim=True).clamp_min(1e-12)


def _response_starts(labels: Tensor) -> Tensor:
    """Index of each row's first labelled token (its prompt length); rows without labels get 0."""
    labelled = labels != IGNORE_INDEX
    first = labelled.int().argmax(dim=1)
    return torch.where(labelled.any(dim=1), first, torch.zeros_like(first))
