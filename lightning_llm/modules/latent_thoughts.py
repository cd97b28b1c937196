r"""LT-Tuning: latent thoughts with Context-Prediction Fusion (arXiv 2602.10229), and Coconut as its α = 1 case.

A ``<thinking>`` token marks a latent step. At a position whose input token is ``<thinking>``, the model does not
read that token's embedding; it reads a *latent* built from the previous position's output:

.. math::

    q = \operatorname{top-}p\big(\operatorname{softmax}(\ell_{t-1} / T)\big)\ \text{with } q_{\langle thinking\rangle} = 0,
    \qquad e_{\text{pred}} = q^\top E,
    \qquad e_t = \alpha\, h_{t-1} + (1 - \alpha)\, e_{\text{pred}}

where :math:`h_{t-1}` is the last hidden state (after the final norm), :math:`\ell_{t-1} = W h_{t-1}` its logits
and :math:`E` the input embedding matrix. With α = 1 this is Coconut's continuous thought (the hidden state fed
back as the next input); the authors' fusion stage uses α = 0.6, T = 1, top-p 0.9 (``configs/example_config.yaml``).

At inference the switch is the authors' (``model.py``, ``LT_Tuning_Model.generate``): greedy decoding, and a
step is latent exactly when the argmax of the last logits is ``<thinking>``. There is no confidence threshold
at inference: *confidence-driven insertion* is how the training data is built
(:class:`~lightning_llm.callbacks.LatentThoughtsCurriculum`), which teaches the model to emit ``<thinking>``
where it was unsure. A latent span ends when the argmax is anything else.

Training runs the decoder **segment by segment** over a KV cache, cutting before every column that holds a
``<thinking>`` token, so a latent is computed from the hidden state of the same forward pass and gradients flow
back through the whole chain of latents (as Coconut's multi-pass training does).

Latent *collapse* is the failure the fusion is meant to prevent: with α = 1 consecutive latents drift towards
one direction. :func:`latent_collapse` measures it as the mean pairwise cosine and the effective rank
(Roy & Vetterli: :math:`\exp H(\sigma / \lVert\sigma\rVert_1)`) of each sequence's chain of latents.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from lightning_llm.backbones import eval_mode
from lightning_llm.backbones.inspect import cache_kwarg
from lightning_llm.kernels import fused_linear_logprobs
from lightning_llm.lm import check_fused_compatible, global_mean, labels_to_mask
from lightning_llm.modules.causal_lm import CausalLMModule

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "LatentGeneration",
    "LatentThoughtsModule",
    "check_fusion",
    "fuse_latent",
    "latent_collapse",
    "top_p_distribution",
]

THINKING_TOKEN = "<thinking>"


def top_p_distribution(
    logits: Tensor, *, temperature: float = 1.0, top_p: float = 0.9, exclude: int | None = None
) -> Tensor:
    """``softmax(logits / T)`` restricted to its nucleus, renormalised.

    The nucleus is the authors' (``model.py``, ``LT_Tuning_Model._soft_fusion_embedding``): the tokens, most
    likely first, whose *cumulative* probability is at most ``top_p``, i.e. the largest such prefix (not the
    smallest prefix of mass ≥ ``top_p`` that sampling libraries use). The most likely token is always kept, so
    the result is a distribution even when it alone exceeds ``top_p``. ``exclude`` (the ``<thinking>`` id) gets
    probability 0 *before* the nucleus is taken: a latent predicts the next real token, never another latent.
    """
    check_fusion(0.0, temperature, top_p)
    scaled = logits.float() / temperature
    if exclude is not None:
        scaled = scaled.clone()
        scaled[..., exclude] = float("-inf")
    probs = scaled.softmax(dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token if the mass up to and including it is at most top_p; the top token is always kept.
        keep_sorted = sorted_probs.cumsum(dim=-1) <= top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def fuse_latent(
    hidden: Tensor,
    logits: Tensor,
    embedding_weight: Tensor,
    *,
    alpha: float,
    temperature: float = 1.0,
    top_p: float = 0.9,
    thinking_id: int | None = None,
    match_embedding_norm: bool = False,
) -> Tensor:
    r"""Context-Prediction Fusion :math:`e = \alpha h + (1-\alpha)\, q^\top E` for hidden states ``[..., H]``.

    Args:
        hidden: Last hidden states :math:`h` (after the final norm), ``[..., H]``.
        logits: Their logits :math:`\ell`, ``[..., V]``.
        embedding_weight: The input embedding matrix :math:`E`, ``[V, H]``.
        alpha: Weight of the context part; 1 returns ``hidden`` unchanged (Coconut).
        temperature, top_p: Of :func:`top_p_distribution`.
        thinking_id: Token excluded from :math:`q`.
        match_embedding_norm: Rescale :math:`h` to the mean norm of the embedding rows before fusing (only
            when α < 1). **Our reading, not the paper's text**: the paper does not say how the two parts are
            scaled. In a model whose input embeddings are much smaller than its post-norm hidden states (the
            tiny backbone: 0.23 vs 11.3) the prediction part is otherwise ~1 % of the latent and the fusion
            degenerates to α = 1.
    """
    check_fusion(alpha, temperature, top_p)
    if alpha == 1.0:
        return hidden
    q = top_p_distribution(logits, temperature=temperature, top_p=top_p, exclude=thinking_id)
    predicted = q.to(embedding_weight.dtype) @ embedding_weight
    if match_embedding_norm:
        target = embedding_weight.detach().float().norm(dim=-1).mean()
        hidden = hidden * (target / hidden.float().norm(dim=-1, keepdim=True).clamp(min=1e-6)).to(
            hidden.dtype
        )
    return alpha * hidden + (1.0 - alpha) * predicted.to(hidden.dtype)


def check_fusion(alpha: float, temperature: float, top_p: float) -> None:
    """Clear errors for fusion settings, raised where they are set rather than deep inside a training step."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def latent_collapse(latents: Tensor, mask: Tensor | None = None) -> dict[str, float]:
    """Collapse statistics of chains of latents ``[N, K, H]`` (``mask[N, K]`` marks real ones).

    For each chain with at least two latents: the mean pairwise cosine similarity of its latents, and the
    effective rank ``exp(entropy(σ / Σσ))`` of its ``[k, H]`` matrix (1 = all latents parallel, k = all
    orthogonal with equal norms). Returns the means over chains, and the number of chains used.
    """
    if latents.ndim != 3:
        raise ValueError(f"latents must be [N, K, H], got shape {tuple(latents.shape)}")
    if mask is None:
        mask = torch.ones(latents.shape[:2], dtype=torch.bool, device=latents.device)
    cosines, ranks = [], []
    for chain, keep in zip(latents.float(), mask.bool(), strict=True):
        chain = chain[keep]
        k = chain.shape[0]
        if k < 2:
            continue
        unit = F.normalize(chain, dim=-1)
        sims = unit @ unit.T
        cosines.append(((sims.sum() - sims.diagonal().sum()) / (k * (k - 1))).item())
        sigma = torch.linalg.svdvals(chain)
        p = sigma / sigma.sum().clamp(min=1e-12)
        ranks.append(torch.exp(-(p * p.clamp(min=1e-12).log()).sum()).item())
    if not cosines:
        return {"mean_cosine": float("nan"), "effective_rank": float("nan"), "chains": 0}
    return {
        "mean_cosine": sum(cosines) / len(cosines),
        "effective_rank": sum(ranks) / len(ranks),
        "chains": len(cosines),
    }


class LatentGeneration(dict):
    """What :meth:`LatentThoughtsModule.generate_latent` returns (a dict, so it pickles and prints plainly).

    Keys: ``texts`` (decoded explicit tokens), ``explicit_tokens`` and ``latent_steps`` (counts per row),
    ``latents`` (per row, a ``[k, H]`` tensor of the fed latents).
    """


class LatentThoughtsModule(CausalLMModule):
    r"""SFT of a causal LM whose ``<thinking>`` positions read fused latents (LT-Tuning; Coconut at α = 1).

    The loss is :class:`CausalLMModule`'s masked next-token NLL, computed on the hidden states of
    :meth:`latent_forward`. Two regimes:

    - **LT-Tuning** (``num_latents=None``): ``<thinking>`` is an ordinary trained target, so the model learns
      *when* to think; at inference it switches dynamically: whenever its argmax is ``<thinking>`` the fused
      latent is fed back instead (:meth:`generate_latent`). :class:`~lightning_llm.callbacks.LatentThoughtsCurriculum`
      builds such data and moves α through the three stages.
    - **Coconut** (``num_latents=k``, with α = 1): the data holds ``k`` ``<thinking>`` placeholders; their
      targets are not trained (a latent has no token label), and generation forces ``k`` latent steps first.

    ``<thinking>`` must encode as one token of the model's tokenizer (it is added when missing); a tokenizer that
    splits it is refused at construction, since its data would hold no latent position. The DataModule takes the
    model's tokenizer (another one is refused at setup by the DataModule's tokenizer check).

    Args:
        alpha: Fusion weight α of the context part (1 = Coconut; 0.6 is the authors' fusion stage).
        temperature: T of the prediction part's softmax.
        top_p: Nucleus of the prediction part.
        match_embedding_norm: See :func:`fuse_latent` (our reading, off by default: the paper's formula as
            written). On the tiny backbone the prediction part is then ~1 % of the latent; with it on, the
            two parts have equal scale, but in our runs the fused latents collapsed *more* (tutorial 10).
        num_latents: Coconut mode: the fixed number of latent steps forced at the start of each response.
        max_latent_steps: Optional cap on latent steps per response in dynamic generation (a model that keeps
            predicting ``<thinking>`` then has to answer). ``None`` (default): no cap, as in the authors'
            ``generate``; ``max_new_tokens`` still bounds the response.
        **kwargs: The arguments of :class:`CausalLMModule` (model, lr, ...).
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        alpha: float = 0.6,
        temperature: float = 1.0,
        top_p: float = 0.9,
        match_embedding_norm: bool = False,
        num_latents: int | None = None,
        max_latent_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        if num_latents is not None and num_latents < 1:
            raise ValueError(f"num_latents must be >= 1 or None, got {num_latents}")
        if max_latent_steps is not None and max_latent_steps < 0:
            raise ValueError(f"max_latent_steps must be >= 0, got {max_latent_steps}")
        check_fusion(alpha, temperature, top_p)
        self.thinking_id = self._ensure_thinking_token()
        self._latent_stats: list[Tensor] = []

    def _ensure_thinking_token(self) -> int:
        """The ``<thinking>`` id; added to a tokenizer that lacks it (the model's embeddings follow when it is built).
        A tokenizer that knows the tag but does not encode it as that one token is refused."""
        tokenizer = self.tokenizer
        token_id = tokenizer.convert_tokens_to_ids(THINKING_TOKEN)
        if token_id is None or token_id == tokenizer.unk_token_id:
            tokenizer.add_tokens([THINKING_TOKEN], special_tokens=False)
            token_id = tokenizer.convert_tokens_to_ids(THINKING_TOKEN)
        # configure_model resizes the embeddings to the tokenizer (mean_resizing: the new row is drawn from a
        # normal with the other rows' mean and covariance)
        for text in (THINKING_TOKEN, f"x {THINKING_TOKEN} y{THINKING_TOKEN}"):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids.count(token_id) != text.count(THINKING_TOKEN):
                raise ValueError(
                    f"{type(self).__name__}: the latent tag {THINKING_TOKEN!r} is not a single token of the "
                    f"tokenizer of {self.hparams.model!r}: it has id {token_id}, but {text!r} encodes to {ids}, so "
                    "training data would hold no latent position. Use a tokenizer where the tag is an added "
                    "token (one the tokenizer lacks is added at construction)"
                )
        return int(token_id)

    # ----------------------------------------------------------------------------------------- forward

    @override
    def prepare_model(self, model: PreTrainedModel) -> PreTrainedModel:
        """:class:`CausalLMModule`'s policy, refused when its logits are not ``hidden @ W.T`` (latent decoding
        applies the head weight itself)."""
        check_fused_compatible(model)
        return super().prepare_model(model)

    def _logits(self, hidden: Tensor) -> Tensor:
        """Logits of hidden states (the LM head is a plain linear map: checked at construction)."""
        return hidden @ self.model.get_output_embeddings().weight.T

    def _fuse(self, hidden: Tensor) -> Tensor:
        hp = self.hparams
        if hp.alpha == 1.0:
            return hidden
        head = self.model.get_output_embeddings().weight
        return fuse_latent(
            hidden,
            hidden @ head.T,
            self.model.get_input_embeddings().weight,
            alpha=hp.alpha,
            temperature=hp.temperature,
            top_p=hp.top_p,
            thinking_id=self.thinking_id,
            match_embedding_norm=hp.match_embedding_norm,
        )

    def latent_forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Last hidden states ``[B, T, H]`` with fused latents at ``<thinking>`` positions, and those latents.

        One decoder call per segment between ``<thinking>`` columns, over a KV cache; a sequence without
        ``<thinking>`` is one plain forward. Expects right padding (SFT batches). Returns ``(hidden, latents)``
        with ``latents[B, T, H]`` zero outside ``<thinking>`` positions.
        """
        from transformers import DynamicCache

        decoder = self.model.get_decoder()
        embed = self.model.get_input_embeddings()
        is_latent = input_ids == self.thinking_id
        is_latent[:, 0] = False  # a latent needs a previous position
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        embeds = embed(input_ids)
        columns = is_latent.any(dim=0).nonzero().flatten().tolist()
        bounds = [0, *columns, input_ids.shape[1]]
        cache = DynamicCache()
        cache_arg = cache_kwarg(decoder)
        hiddens: list[Tensor] = []
        latents = torch.zeros_like(embeds)
        for start, end in itertools.pairwise(bounds):
            if start == end:
                continue
            segment = embeds[:, start:end]
            if start in columns:
                # This column's latent comes from the previous position's output in this same pass.
                fused = self._fuse(hiddens[-1][:, -1])
                rows = is_latent[:, start]
                first = torch.where(rows[:, None], fused, segment[:, 0])
                latents[:, start] = torch.where(rows[:, None], fused, torch.zeros_like(fused))
                segment = torch.cat([first[:, None], segment[:, 1:]], dim=1)
            out = decoder(
                inputs_embeds=segment,
                attention_mask=attention_mask[:, :end],
                position_ids=positions[:, start:end],
                use_cache=True,
                **{cache_arg: cache},
            )
            hiddens.append(out.last_hidden_state)
        return torch.cat(hiddens, dim=1), latents

    def _targets(self, batch: dict[str, Tensor]) -> Tensor:
        mask = labels_to_mask(batch["input_ids"], batch["labels"])
        if self.hparams.num_latents is not None:
            # Coconut: a latent position has no token to predict.
            mask = mask & (batch["input_ids"] != self.thinking_id)
        return mask

    @override
    def _loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        hidden, latents = self.latent_forward(batch["input_ids"], batch.get("attention_mask"))
        select = self._targets(batch)[:, 1:]
        logprobs, _ = fused_linear_logprobs(
            hidden[:, :-1][select],
            self.model.get_output_embeddings().weight,
            batch["input_ids"][:, 1:][select],
            chunk_size=self.hparams.logprob_chunk_size,
        )
        if not self.training:
            self._record_latents(batch["input_ids"], latents)
        count = torch.tensor(float(logprobs.numel()), device=logprobs.device)
        return global_mean(-logprobs.sum(), count, self._trainer)

    def _record_latents(self, input_ids: Tensor, latents: Tensor) -> None:
        mask = input_ids == self.thinking_id
        mask[:, 0] = False
        if mask.sum(dim=1).max() < 2:
            return
        width = int(mask.sum(dim=1).max())
        chains = torch.zeros(input_ids.shape[0], width, latents.shape[-1])
        keep = torch.zeros(input_ids.shape[0], width, dtype=torch.bool)
        for row in range(input_ids.shape[0]):
            picked = latents[row][mask[row]].detach().float().cpu()
            chains[row, : len(picked)] = picked
            keep[row, : len(picked)] = True
        stats = latent_collapse(chains, keep)
        if stats["chains"]:
            self._latent_stats.append(torch.tensor([stats["mean_cosine"], stats["effective_rank"], 1.0]))

    @override
    def on_validation_epoch_start(self) -> None:
        self._latent_stats = []

    @override
    def on_validation_epoch_end(self) -> None:
        if not self._latent_stats:
            return
        mean = torch.stack(self._latent_stats).mean(dim=0).to(self.device)
        # Per-rank means, averaged over ranks: every rank logs the same value.
        self.log("val/latent_cosine", mean[0], sync_dist=True)
        self.log("val/latent_effective_rank", mean[1], sync_dist=True)
        self._latent_stats = []

    # -------------------------------------------------------------------------------------- generation

    @torch.no_grad()
    def generate_latent(
        self, input_ids: Tensor, attention_mask: Tensor, *, max_new_tokens: int = 32
    ) -> LatentGeneration:
        """Greedy decoding with latent steps, from left-padded prompts.

        At each step the last position's logits decide: with ``num_latents=k`` the first ``k`` steps are
        latent (Coconut); otherwise a step is latent when the argmax is ``<thinking>`` (the authors' rule) and,
        if ``max_latent_steps`` is set, the row has taken fewer latent steps than that (past the cap the best
        non-``<thinking>`` token is taken). A latent step feeds the fused embedding of the same position's
        hidden state and logits back and emits no text. Latent steps count towards ``max_new_tokens``.
        """
        from transformers import DynamicCache

        hp = self.hparams
        decoder = self.model.get_decoder()
        embed = self.model.get_input_embeddings()
        cache_arg = cache_kwarg(decoder)
        stops = torch.tensor(self.stop_token_ids, dtype=torch.long, device=input_ids.device)
        batch = input_ids.shape[0]
        with eval_mode(self.model):
            cache = DynamicCache()
            mask = attention_mask.clone()
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            out = decoder(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{cache_arg: cache},
            )
            hidden = out.last_hidden_state[:, -1]
            next_pos = positions[:, -1] + 1
            tokens: list[list[int]] = [[] for _ in range(batch)]
            latents: list[list[Tensor]] = [[] for _ in range(batch)]
            done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
            for step in range(max_new_tokens):
                logits = self._logits(hidden)
                if hp.num_latents is not None:
                    latent = torch.full_like(done, step < hp.num_latents)
                    logits[:, self.thinking_id] = float("-inf")
                else:
                    taken = torch.tensor([len(chain) for chain in latents], device=done.device)
                    latent = logits.argmax(-1) == self.thinking_id
                    if hp.max_latent_steps is not None:
                        latent = latent & (taken < hp.max_latent_steps)
                    logits[:, self.thinking_id] = float("-inf")
                latent = latent & ~done
                choice = logits.argmax(-1)
                fused = self._fuse(hidden)
                step_embeds = torch.where(latent[:, None], fused, embed(choice))
                for row in range(batch):
                    if done[row]:
                        continue
                    if latent[row]:
                        latents[row].append(fused[row].float().cpu())
                    else:
                        tokens[row].append(int(choice[row]))
                        if bool(torch.isin(choice[row], stops)):
                            done[row] = True
                if bool(done.all()):
                    break
                mask = torch.cat([mask, (~done).long()[:, None]], dim=1)
                out = decoder(
                    inputs_embeds=step_embeds[:, None],
                    attention_mask=mask,
                    position_ids=next_pos[:, None],
                    use_cache=True,
                    **{cache_arg: cache},
                )
                hidden = out.last_hidden_state[:, -1]
                next_pos = next_pos + 1
        width = self.model.get_input_embeddings().weight.shape[1]
        return LatentGeneration(
            texts=self.tokenizer.batch_decode(tokens, skip_special_tokens=True),
            explicit_tokens=[len(row) for row in tokens],
            latent_steps=[len(chain) for chain in latents],
            latents=[torch.stack(chain) if chain else torch.zeros(0, width) for chain in latents],
        )

    @override
    @torch.no_grad()
    def generate_ids(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> list[str]:
        """Greedy latent decoding (:meth:`generate_latent`); sampling is not supported for latent models."""
        if temperature > 0:
            raise ValueError("LatentThoughtsModule generates greedily; temperature must be 0")
        return self.generate_latent(input_ids, attention_mask, max_new_tokens=max_new_tokens)["texts"]

    # ---------------------------------------------------------------------------------- curriculum API

    def set_fusion(
        self, *, alpha: float, temperature: float | None = None, top_p: float | None = None
    ) -> None:
        """Change α (and T, top-p) mid-training, as the curriculum does; kept in ``hparams`` so checkpoints
        restore the stage's fusion."""
        hp = self.hparams
        temperature = hp.temperature if temperature is None else temperature
        top_p = hp.top_p if top_p is None else top_p
        check_fusion(alpha, temperature, top_p)
        hp.alpha, hp.temperature, hp.top_p = float(alpha), float(temperature), float(top_p)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["latent_fusion"] = {k: float(self.hparams[k]) for k in ("alpha", "temperature", "top_p")}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        fusion = checkpoint.get("latent_fusion")
        if fusion:
            self.set_fusion(**fusion)
