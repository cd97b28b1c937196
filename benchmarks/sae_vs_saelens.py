"""Sparse autoencoder training: ``lightning_llm`` (``SparseAutoencoderModule`` under Lightning) vs SAELens.

Both libraries train the same SAE on the same activations in one process, side by side:

* **data**: residual-stream activations of the embedded tiny Llama backbone (fp32, eval mode) at the *output*
  of decoder block ``--layer`` (HF ``hidden_states[layer + 1]``), every token of chat-templated dialogues of
  the arithmetic task, harvested by ``lightning_llm.datamodules.activations.ActivationDataModule`` (one
  dialogue per sequence, ``mode="sequential"``, exactly ``steps x batch_size`` training tokens through its
  seeded mixing buffer). One epoch of its ``train_dataloader`` is materialised once, in order; a plain
  ``DataLoader`` over those batches (``batch_size=None``, no shuffling, no workers) feeds ours, and SAELens's
  ``SAETrainer`` gets an iterator over *the same loader* as its data provider, so both train on identical
  batches in identical order (checked: digests of what each side actually received). Held-out activations
  (final metrics): the real tokens of the DataModule's validation dialogues, which never occur in training.
* **SAE**: ``d_in`` = the backbone width, ``d_sae = --expansion x d_in``, fp32, CPU; ``"topk"`` (k = ``--k``,
  AuxK with alpha = 1/32 and k_aux = d_in / 2, dead after ``--dead-window-steps`` silent steps) and ``"relu"``
  (standard SAE, L1 = ``--l1-coefficient`` x sum_i f_i ||d_i||, SAELens's ``"standard"``).
* **init** (identical on both sides): decoder rows = our ``SparseAutoencoder`` directions (seeded Gaussian
  rows of unit norm), ``W_enc = W_dec^T``, ``b_enc = 0``, ``b_dec`` = the geometric median of the scaled first
  batch (our rule; SAELens's ``SAETrainer`` starts it at zero, so it is copied in before ``fit``). SAELens is
  built with ``decoder_init_norm=None`` and then given these tensors (checked: same held-out MSE and L0).
* **normalisation**: SAELens's ``"expected_average_only_in"`` on both, estimated from the same tokens (the
  first batch): ours ``normalize_activations=True, init_sample_tokens=batch_size`` (our module reads the first
  training batch), SAELens ``n_batches_for_norm_estimate=1`` with its data provider yielding that batch first
  (checked: equal factors). SAELens folds the factor into its weights after ``fit``; ours keeps it as a
  buffer; both ``encode``/``decode`` raw activations.
* **optimisation**: ``torch.optim.Adam`` (betas 0.9, 0.999, eps 1e-8), the same constant learning rate (ours:
  ``min_lr_ratio=1, warmup_steps=0``, which makes its warm-up/cosine schedule constant; SAELens
  ``"constant"``), gradient-norm clipping at 1.0 on both (SAELens always clips at 1.0; ours through
  Lightning's ``gradient_clip_val=1.0``), no sparsity warm-up, ``--steps`` optimiser steps of
  ``--batch-size`` tokens.
* **no** wandb, checkpoints, evaluators, validation, logger, progress bar (SAELens's tqdm bar is disabled with
  ``TQDM_DISABLE=1``), model summary.

Remaining differences (by design of each library; recorded in the JSON ``notes``):

* decoder norm: ours keeps decoder rows at unit norm (the gradient component along each row is removed before
  the step and rows are renormalised after it); SAELens TopK uses ``rescale_acts_by_decoder_norm=True`` (its
  default: pre-activations are multiplied by the row norm and activations divided by it in the decoder, so the
  function only depends on the row directions) and does not renormalise; SAELens standard leaves rows free
  (their norm is in the L1 term, as in ours);
* dead-latent bookkeeping: SAELens counts steps, ours tokens; ours gets
  ``dead_window_tokens = (dead_window_steps + 1) x batch_size`` so both declare a latent dead after the same
  number of silent steps (SAELens tests ``> window``, ours ``>= window``);
* ours logs its loss terms, L0 and dead fraction through ``self.log`` every step (Lightning's result
  collection, no logger attached); SAELens updates its firing statistics every step too;
* the measured call: ours ``trainer.fit(module, loader)`` includes Lightning's startup (``setup``, optimiser
  construction, ``on_fit_start``: the input scale and the geometric median of ``b_dec``, the loop machinery);
  SAELens's ``trainer.fit()`` includes its norm estimate (one batch) and the final folding of the scale into
  the weights, while its ``b_dec`` median was computed before the call (its trainer has no such step).

Measurement: per architecture, a short untimed warm-up fit of each variant (``--warmup-steps`` steps), then
``--reps`` repetitions, each with a fresh SAE, in alternating order. Timed: exactly ``trainer.fit`` (ours) /
``trainer.fit()`` (SAELens), wall clock (the headline: steps x batch_size / seconds, median over repetitions)
and process CPU time; and, within each fit, the interval between consecutive batch requests (one optimiser
step; its median is the *steady-state* step time, which leaves out startup and is robust to other jobs on a
shared machine). After every fit, ONE evaluation function (``_evaluate``: ``x_hat = decode(encode(x))``
through each SAE's own ``encode``/``decode`` on raw held-out activations) gives the MSE per token (sum over
``d_in``, mean over tokens, raw activation units), the explained variance, L0 (non-zero latents per token) and
the latents that never fire. ``ours_bare`` (not in the summary) runs our module's own ``losses`` + backward +
the same gradient projection, clipping, Adam step and decoder renormalisation in a hand-written loop, which
separates Lightning's share of our time from the SAE math. ``--profile`` adds, per architecture:
torch.profiler op tables of both fits, our bare loop split by phase, our fit with timers on the module's
methods (``losses``, ``self.log``, ``backward``, hooks) and a cProfile of our fit.

Summary rows per architecture: whole-fit tokens/s and steady-state tokens/s (higher is better), held-out MSE
(lower is better; for ``relu`` read it together with L0, which the L1 penalty sets differently on each side).
L0 and the rest are in the payload only (for ``topk`` L0 = k on both by construction).

Usage (from the repository root)::

    python benchmarks/sae_vs_saelens.py                  # topk and relu, 200 steps of 1024 tokens, 5 reps
    python benchmarks/sae_vs_saelens.py --quick           # smoke run, prints, writes nothing
    python benchmarks/sae_vs_saelens.py --archs topk --steps 500 --profile

Writes ``benchmarks/results/sae_vs_saelens.json`` (``--no-write`` to skip; ``--quick`` never writes) and exits
1 if the two sides' batches, input scales or initial SAEs differ.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import itertools
import json
import math
import os
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")  # before SAELens imports tqdm: no progress bar on either side

import torch
from _common import machine_info, package_versions, summary_row, utc_now, write_result

NAME = "sae_vs_saelens"
ARCHS = ("topk", "relu")
SAELENS_ARCH = {"topk": "topk", "relu": "standard"}
INIT_TOL = 1e-5  # relative |MSE_ours - MSE_saelens| of the two initial SAEs on held-out data

MEASUREMENT = {
    "time": "per architecture: one untimed warm-up fit per variant, then --reps repetitions in alternating "
    "order, each with a freshly built SAE (and, for ours, a fresh lightning.Trainer); perf_counter and "
    "process_time around exactly trainer.fit(module, train_dataloaders=loader) (ours: includes Lightning's "
    "startup, setup, configure_optimizers, on_fit_start with the input scale and the geometric median of "
    "b_dec) and SAETrainer.fit() (SAELens: includes its one-batch norm estimate and the final folding of the "
    "scale into the weights). tokens_per_s = steps * batch_size / wall seconds, median over repetitions (all "
    "recorded); cpu.tokens_per_s the same with process CPU time (one torch thread)",
    "steady_state": "within each fit, perf_counter at every batch request (the dataset's __getitem__, reached "
    "by Lightning's loop and by SAELens's data provider alike): the median interval is one optimiser step "
    "without startup and without the occasional step slowed by other jobs; tokens_per_s = batch_size / the "
    "median over repetitions of those medians",
    "quality": "after every timed fit, one shared function (_evaluate) on the held-out activations, through "
    "each SAE's own encode()/decode() on raw activations: mse = mean over tokens of sum over d_in of "
    "(x_hat - x)^2 in raw activation units; explained_variance = 1 - mse / mean ||x - mean(x)||^2; l0 = mean "
    "number of non-zero latents per token; dead = latents that fire on no held-out token. Reported: the median "
    "over repetitions",
    "ours_bare": "our module's losses() + backward + remove_parallel_gradient + clip_grad_norm_(1.0) + Adam "
    "step + zero_grad + scheduler step + normalize_decoder in a hand-written loop (no Lightning, no self.log), "
    "timed like the fits (its init is done by hand before the timer starts): the SAE-math share of our time",
}


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS))
    parser.add_argument("--layer", type=int, default=1, help="0-based decoder block whose output is read")
    parser.add_argument("--expansion", type=int, default=8, help="d_sae = expansion * d_in")
    parser.add_argument("--k", type=int, default=32, help="active latents per token (topk)")
    parser.add_argument("--l1-coefficient", type=float, default=5.0, help="L1 coefficient (relu/standard)")
    parser.add_argument("--aux-coefficient", type=float, default=1 / 32, help="AuxK coefficient (topk)")
    parser.add_argument(
        "--dead-window-steps", type=int, default=1000, help="silent steps before a latent is dead (AuxK)"
    )
    parser.add_argument("--batch-size", type=int, default=1024, help="tokens per optimiser step")
    parser.add_argument("--steps", type=int, default=200, help="optimiser steps per fit")
    parser.add_argument("--lr", type=float, default=4e-4, help="constant Adam learning rate")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per library and architecture")
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps of the untimed warm-up fits")
    parser.add_argument("--heldout-dialogues", type=int, default=600, help="validation dialogues (held out)")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 steps, 1 rep, never writes")
    parser.add_argument(
        "--profile", action="store_true", help="also profile ours (torch.profiler + cProfile)"
    )
    parser.add_argument("--profile-steps", type=int, default=100, help="steps of the profiled fit")
    parser.add_argument(
        "--profile-repeats", type=int, default=3, help="runs per profiled measurement (the fastest is kept)"
    )
    parser.add_argument(
        "--no-write", action="store_true", help="print the result instead of writing the JSON"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.reps, args.warmup_steps, args.heldout_dialogues = 20, 1, 2, 100
        args.profile_steps = min(args.profile_steps, 20)
        args.no_write = True
    if args.steps < 1 or args.reps < 1 or args.warmup_steps < 1 or args.batch_size < 1:
        parser.error("--steps, --reps, --warmup-steps and --batch-size must be >= 1")
    return args


# -------------------------------------------------------------------------------------------------- data


def _harvest(args: argparse.Namespace) -> dict[str, Any]:
    """Training batches (in training order) and held-out tokens from :class:`ActivationDataModule`.

    The DataModule harvests the output of block ``layer`` for every token of each chat-templated dialogue (one
    dialogue per sequence, ``mode="sequential"``) and serves exactly ``steps x batch_size`` training tokens
    through its seeded mixing buffer; one epoch of its loader is materialised here, so every fit of either
    library replays the very same batches. Held-out tokens: the real tokens of its validation dialogues.
    """
    from lightning_llm.datamodules.activations import ActivationDataModule

    needed = args.steps * args.batch_size
    dialogues = math.ceil(needed / 20)  # ~25 tokens per arithmetic dialogue
    dm = ActivationDataModule(
        model="tiny",
        layer=args.layer,
        mode="sequential",
        task="arithmetic",
        num_train=dialogues,
        num_val=args.heldout_dialogues,
        max_length=args.max_length,
        num_tokens=needed,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    dm.prepare_data()
    dm.setup("fit")
    train = torch.cat([batch["activations"] for batch in dm.train_dataloader()])
    heldout = torch.cat([b["activations"][b["attention_mask"].bool()] for b in dm.val_dataloader()])
    return {
        "train": train.float().contiguous(),
        "heldout": heldout.float().contiguous(),
        "dialogues": {"train": dialogues, "heldout": args.heldout_dialogues},
        "source": "lightning_llm.datamodules.activations.ActivationDataModule(model='tiny', "
        f"layer={args.layer}, mode='sequential', task='arithmetic', num_tokens={needed}, "
        f"batch_size={args.batch_size}, buffer_size=65536 (default), seed={args.seed}): one epoch of its "
        "train_dataloader materialised in order; held-out = real tokens of its val_dataloader",
    }


class _Batches(torch.utils.data.Dataset):
    """Item ``i`` is ``{"activations": tokens[i*B:(i+1)*B]}``; a loader with ``batch_size=None`` collates nothing."""

    def __init__(self, tokens: torch.Tensor, batch_size: int) -> None:
        self.tokens, self.batch_size = tokens, batch_size
        self.stamps: list[float] = []  # perf_counter at every batch request (both libraries go through here)

    def __len__(self) -> int:
        return len(self.tokens) // self.batch_size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.stamps.append(time.perf_counter())
        return {"activations": self.tokens[i * self.batch_size : (i + 1) * self.batch_size]}


class _Clock:
    """Wall and process CPU time of one fit, and the intervals between its batch requests (one per step)."""

    def __init__(self, loader: torch.utils.data.DataLoader) -> None:
        self.dataset = loader.dataset

    def __enter__(self) -> _Clock:
        self.dataset.stamps.clear()
        self.cpu = time.process_time()
        self.wall = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu
        stamps = self.dataset.stamps
        self.intervals = [b - a for a, b in itertools.pairwise(stamps)]

    def result(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall,
            "cpu_s": self.cpu,
            "median_step_s": statistics.median(self.intervals) if self.intervals else float("nan"),
            "batch_requests": len(self.intervals) + 1,
        }


def _loader(tokens: torch.Tensor, batch_size: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(_Batches(tokens, batch_size), batch_size=None, shuffle=False)


def _provider(loader: torch.utils.data.DataLoader, record: list[torch.Tensor] | None = None) -> Iterator[Any]:
    """SAELens's data provider: the loader's first batch (its norm estimate), then the loader's batches, epoch
    after epoch (as Lightning does with ``max_steps`` beyond one epoch)."""
    first = next(iter(loader))["activations"]
    yield first
    for batch in itertools.chain.from_iterable(itertools.repeat(loader)):
        if record is not None:
            record.append(batch["activations"])
        yield batch["activations"]


def _digest(batches: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for b in batches:
        h.update(b.numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------- SAEs


def _ours_module(args: argparse.Namespace, arch: str, d_in: int) -> Any:
    from lightning_llm.modules.sae import SparseAutoencoderModule

    return SparseAutoencoderModule(
        d_in,
        expansion=args.expansion,
        architecture=arch,
        k=args.k,
        l1_coefficient=args.l1_coefficient,
        aux_coefficient=args.aux_coefficient,
        dead_window_tokens=(args.dead_window_steps + 1) * args.batch_size,
        lr=args.lr,
        min_lr_ratio=1.0,  # warm-up/cosine schedule with floor 1 = constant
        warmup_steps=0,
        sparsity_warmup_steps=0,
        betas=(0.9, 0.999),
        normalize_activations=True,
        init_sample_tokens=args.batch_size,  # the first training batch
        compute_delta_loss=False,
        seed=args.seed,
    )


def _trainer(steps: int, callbacks: list[Any] | None = None) -> Any:
    import lightning as L

    return L.Trainer(
        callbacks=callbacks or [],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=steps,
        gradient_clip_val=1.0,  # SAELens clips the gradient norm at 1.0 in every step
        gradient_clip_algorithm="norm",
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )


def _init_state(args: argparse.Namespace, arch: str, first_batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """The shared initial SAE: our seeded directions, W_enc = W_dec^T, b_enc = 0, b_dec = geometric median, c."""
    from lightning_llm.modules.sae import geometric_median

    sae = _ours_module(args, arch, first_batch.shape[1]).sae
    sample = first_batch[: args.batch_size].float()
    scale = math.sqrt(sae.d_in) / float(sample.norm(dim=-1).mean().clamp_min(1e-12))
    return {
        "W_dec": sae.W_dec.detach().clone(),  # [d_sae, d_in], unit rows
        "W_enc": sae.W_enc.detach().clone(),  # [d_sae, d_in] (ours), = W_dec at init
        "b_enc": sae.b_enc.detach().clone(),
        "b_dec": geometric_median(sample * scale),
        "scale": torch.tensor(scale),
    }


def _saelens_sae(args: argparse.Namespace, arch: str, d_in: int, init: dict[str, torch.Tensor]) -> Any:
    from sae_lens import (
        StandardTrainingSAE,
        StandardTrainingSAEConfig,
        TopKTrainingSAE,
        TopKTrainingSAEConfig,
    )

    common = dict(
        d_in=d_in,
        d_sae=args.expansion * d_in,
        dtype="float32",
        device="cpu",
        apply_b_dec_to_input=True,
        normalize_activations="expected_average_only_in",
        decoder_init_norm=None,
    )
    if arch == "topk":
        sae = TopKTrainingSAE(
            TopKTrainingSAEConfig(
                **common,
                k=args.k,
                aux_loss_coefficient=args.aux_coefficient,
                rescale_acts_by_decoder_norm=True,
                use_sparse_activations=False,
            )
        )
    else:
        sae = StandardTrainingSAE(
            StandardTrainingSAEConfig(
                **common, l1_coefficient=args.l1_coefficient, lp_norm=1.0, l1_warm_up_steps=0
            )
        )
    with torch.no_grad():
        sae.W_dec.copy_(init["W_dec"])
        sae.W_enc.copy_(init["W_enc"].T)
        sae.b_enc.copy_(init["b_enc"])
        sae.b_dec.copy_(init["b_dec"])
    return sae


def _saelens_trainer(args: argparse.Namespace, sae: Any, provider: Iterator[Any], steps: int) -> Any:
    from sae_lens import LoggingConfig, SAETrainer
    from sae_lens.config import SAETrainerConfig

    cfg = SAETrainerConfig(
        total_training_samples=steps * args.batch_size,
        train_batch_size_samples=args.batch_size,
        lr=args.lr,
        lr_end=args.lr,
        lr_scheduler_name="constant",
        lr_warm_up_steps=0,
        lr_decay_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        device="cpu",
        autocast=False,
        dead_feature_window=args.dead_window_steps,
        feature_sampling_window=max(2000, steps + 1),  # its window log builds a wandb.Histogram: keep it out
        n_checkpoints=0,
        checkpoint_path=None,
        save_final_checkpoint=False,
        logger=LoggingConfig(log_to_wandb=False),
        n_batches_for_norm_estimate=1,
    )
    return SAETrainer(cfg=cfg, sae=sae, data_provider=provider, evaluator=None, save_checkpoint_fn=None)


# -------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def _evaluate(
    encode: Callable[[torch.Tensor], torch.Tensor],
    decode: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    chunk: int = 4096,
) -> dict[str, float]:
    """THE metric function, applied to both trained SAEs: raw-unit reconstruction error, L0, dead latents."""
    sq_err, l0, fired = 0.0, 0.0, None
    for start in range(0, len(x), chunk):
        xc = x[start : start + chunk]
        f = encode(xc)
        x_hat = decode(f)
        sq_err += float((x_hat - xc).pow(2).sum())
        active = f != 0
        l0 += float(active.sum())
        fired = active.any(0) if fired is None else fired | active.any(0)
    n = len(x)
    mse = sq_err / n
    variance = float((x - x.mean(0)).pow(2).sum(-1).mean())
    return {
        "mse": mse,
        "explained_variance": 1.0 - mse / variance,
        "l0": l0 / n,
        "dead_latents": int((~fired).sum()),
        "tokens": n,
    }


def _eval_ours(module: Any, x: torch.Tensor) -> dict[str, float]:
    sae = module.sae.eval()
    return _evaluate(sae.encode, sae.decode, x)


def _eval_saelens(sae: Any, x: torch.Tensor) -> dict[str, float]:
    sae.eval()
    return _evaluate(sae.encode, sae.decode, x)


# --------------------------------------------------------------------------------------------- the fits


def _fit_ours(
    args: argparse.Namespace, arch: str, loader: Any, steps: int, recorder: Any = None
) -> tuple[float, Any]:
    import lightning as L

    L.seed_everything(args.seed, verbose=False)
    module = _ours_module(args, arch, loader.dataset.tokens.shape[1])
    trainer = _trainer(steps, [] if recorder is None else [recorder])
    with _Clock(loader) as clock:
        trainer.fit(module, train_dataloaders=loader)
    if trainer.global_step != steps:
        raise RuntimeError(f"ours ran {trainer.global_step} steps, expected {steps}")
    return clock.result(), module


def _fit_saelens(
    args: argparse.Namespace,
    arch: str,
    loader: Any,
    init: dict[str, torch.Tensor],
    steps: int,
    record: list[torch.Tensor] | None = None,
) -> tuple[float, Any]:
    import lightning as L

    L.seed_everything(args.seed, verbose=False)
    sae = _saelens_sae(args, arch, loader.dataset.tokens.shape[1], init)
    trainer = _saelens_trainer(args, sae, _provider(loader, record), steps)
    with _Clock(loader) as clock:
        trained = trainer.fit()
    if trainer.n_training_steps != steps:
        raise RuntimeError(f"SAELens ran {trainer.n_training_steps} steps, expected {steps}")
    return clock.result(), trained


def _fit_ours_bare(
    args: argparse.Namespace, arch: str, loader: Any, init: dict[str, torch.Tensor], steps: int
):
    """Our module's SAE math without Lightning: the same per-step work as its training_step + hooks, by hand."""
    import lightning as L

    from lightning_llm.modules.causal_lm import warmup_cosine

    L.seed_everything(args.seed, verbose=False)
    module = _ours_module(args, arch, loader.dataset.tokens.shape[1])
    sae = module.sae
    with torch.no_grad():  # what on_fit_start does, here outside the timer
        sae.input_scale.fill_(float(init["scale"]))
        sae.b_dec.copy_(init["b_dec"])
        module.initialized.fill_(True)
    optimizer = torch.optim.Adam(sae.parameters(), lr=args.lr, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, steps, 0, 1.0))
    module.train()
    with _Clock(loader) as clock:
        batches = itertools.chain.from_iterable(itertools.repeat(loader))
        for _, batch in zip(range(steps), batches, strict=False):
            out = module.losses(batch["activations"])
            out["loss"].backward()
            sae.remove_parallel_gradient()
            torch.nn.utils.clip_grad_norm_(sae.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            sae.normalize_decoder()
    return clock.result(), module


# ---------------------------------------------------------------------------------------------- checks


def _initial_check(args: argparse.Namespace, arch: str, init: dict[str, torch.Tensor], heldout: torch.Tensor):
    """The two untrained SAEs (scale and b_dec as each fit would set them) agree on held-out data."""
    module = _ours_module(args, arch, heldout.shape[1])
    with torch.no_grad():
        module.sae.input_scale.fill_(float(init["scale"]))
        module.sae.b_dec.copy_(init["b_dec"])
    theirs = _saelens_sae(args, arch, heldout.shape[1], init)
    theirs.fold_activation_norm_scaling_factor(float(init["scale"]))
    ours_m, theirs_m = _eval_ours(module, heldout), _eval_saelens(theirs, heldout)
    rel = abs(ours_m["mse"] - theirs_m["mse"]) / max(abs(ours_m["mse"]), 1e-30)
    return {
        "ours": ours_m,
        "saelens": theirs_m,
        "relative_mse_diff": rel,
        "l0_equal": ours_m["l0"] == theirs_m["l0"],
        "tolerance": INIT_TOL,
        "equal": rel <= INIT_TOL and abs(ours_m["l0"] - theirs_m["l0"]) <= 1e-3,
    }


def _recorder() -> Any:
    """A callback that keeps the batches ours trains on and the SAE's state right before the first step."""
    import lightning as L

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.batches: list[torch.Tensor] = []
            self.start: dict[str, torch.Tensor] = {}

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:  # after our on_fit_start
            sae = pl_module.sae
            self.start = {
                "input_scale": sae.input_scale.detach().clone(),
                "b_dec": sae.b_dec.detach().clone(),
                "W_dec": sae.W_dec.detach().clone(),
            }

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.batches.append(batch["activations"].clone())

    return Recorder()


def _data_and_init_check(
    args: argparse.Namespace, arch: str, loader: Any, init: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Short fits of both sides that record what they train on: the same batches in the same order, and the
    same input scale and b_dec at the start (SAELens's own ActivationScaler estimate vs our on_fit_start)."""
    from sae_lens.training.activation_scaler import ActivationScaler

    steps = min(args.steps, 5)
    seen_theirs: list[torch.Tensor] = []
    _fit_saelens(args, arch, loader, init, steps, record=seen_theirs)
    recorder = _recorder()
    _fit_ours(args, arch, loader, steps, recorder=recorder)
    expected = [b["activations"] for _, b in zip(range(steps), loader, strict=False)]
    digests = {
        "loader": _digest(expected),
        "ours": _digest(recorder.batches),
        "saelens": _digest(seen_theirs[:steps]),
    }
    scaler = ActivationScaler()
    scaler.estimate_scaling_factor(
        d_in=loader.dataset.tokens.shape[1], data_provider=iter([expected[0]]), n_batches_for_norm_estimate=1
    )
    ours_scale = float(recorder.start["input_scale"])
    scale_rel = abs(ours_scale - scaler.scaling_factor) / scaler.scaling_factor
    b_dec_diff = float((recorder.start["b_dec"] - init["b_dec"]).abs().max())
    w_dec_diff = float((recorder.start["W_dec"] - init["W_dec"]).abs().max())
    return {
        "batches": {"steps": steps, "digests": digests, "identical": len(set(digests.values())) == 1},
        "input_scale": {
            "ours_on_fit_start": ours_scale,
            "saelens_activation_scaler": scaler.scaling_factor,
            "relative_diff": scale_rel,
            "equal": scale_rel <= 1e-5,
        },
        "b_dec_max_abs_diff_ours_vs_given_to_saelens": b_dec_diff,
        "W_dec_max_abs_diff_ours_vs_given_to_saelens": w_dec_diff,
        "init_equal": b_dec_diff <= 1e-5 and w_dec_diff == 0.0,
    }


# --------------------------------------------------------------------------------------------- profile


def _op_table(prof: Any, steps: int, top: int = 20) -> dict[str, Any]:
    """torch.profiler key averages: the top ops by self CPU time, and the totals of our custom SAE ops."""
    averages = prof.key_averages()
    ops = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "sum_of_self_cpu_ms_per_step": sum(e.self_cpu_time_total for e in averages) / 1e3 / steps,
        "top_ops_by_self_cpu": [
            {
                "op": e.key,
                "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                "cpu_total_ms_per_step": e.cpu_time_total / 1e3 / steps,
                "calls_per_step": e.count / steps,
            }
            for e in ops[:top]
        ],
        "lightning_llm_custom_ops": {
            e.key: {
                "cpu_total_ms_per_step": e.cpu_time_total / 1e3 / steps,
                "calls_per_step": e.count / steps,
            }
            for e in averages
            if e.key.startswith("lightning_llm::")
        },
    }


def _phases_ours_bare(
    args: argparse.Namespace, arch: str, loader: Any, init: dict[str, torch.Tensor]
) -> dict:
    """Per-step time of each part of our SAE math (bare loop, no Lightning), from record_function ranges."""
    import lightning as L
    from torch.profiler import ProfilerActivity, profile, record_function

    steps = args.profile_steps
    L.seed_everything(args.seed, verbose=False)
    module = _ours_module(args, arch, loader.dataset.tokens.shape[1])
    sae = module.sae
    with torch.no_grad():
        sae.input_scale.fill_(float(init["scale"]))
        sae.b_dec.copy_(init["b_dec"])
        module.initialized.fill_(True)
    optimizer = torch.optim.Adam(sae.parameters(), lr=args.lr, betas=(0.9, 0.999))
    module.train()
    batches = itertools.chain.from_iterable(itertools.repeat(loader))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _, batch in zip(range(steps), batches, strict=False):
            with record_function("phase:forward (module.losses)"):
                out = module.losses(batch["activations"])
            with record_function("phase:backward"):
                out["loss"].backward()
            with record_function("phase:remove_parallel_gradient + clip_grad_norm_"):
                sae.remove_parallel_gradient()
                torch.nn.utils.clip_grad_norm_(sae.parameters(), 1.0)
            with record_function("phase:adam step + zero_grad"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            with record_function("phase:normalize_decoder"):
                sae.normalize_decoder()
        total = time.perf_counter() - start
    phases = {
        e.key.removeprefix("phase:"): e.cpu_time_total / 1e3 / steps
        for e in prof.key_averages()
        if e.key.startswith("phase:")
    }
    return {"wall_ms_per_step": total * 1e3 / steps, "phases_ms_per_step": phases, **_op_table(prof, steps)}


def _cprofile_ours(args: argparse.Namespace, arch: str, loader: Any, top: int = 40) -> dict[str, Any]:
    """cProfile of our whole fit: where Lightning's share goes (Python functions by cumulative time)."""
    import lightning as L

    steps = args.profile_steps
    L.seed_everything(args.seed, verbose=False)
    module = _ours_module(args, arch, loader.dataset.tokens.shape[1])
    trainer = _trainer(steps)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    trainer.fit(module, train_dataloaders=loader)
    profiler.disable()
    total = time.perf_counter() - start
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (filename, line, name), (_cc, ncalls, tt, ct, _callers) in stats.stats.items():
        short = filename.split("site-packages/")[-1].split("/work/main/")[-1]
        rows.append(
            {
                "function": f"{short}:{line}({name})",
                "cumulative_ms_per_step": ct * 1e3 / steps,
                "self_ms_per_step": tt * 1e3 / steps,
                "calls_per_step": ncalls / steps,
            }
        )
    rows.sort(key=lambda r: r["cumulative_ms_per_step"], reverse=True)

    def cumulative(pattern: str) -> float:
        return max((r["cumulative_ms_per_step"] for r in rows if pattern in r["function"]), default=0.0)

    return {
        "fit_ms_per_step_under_cprofile": total * 1e3 / steps,
        "selected_cumulative_ms_per_step": {
            name: cumulative(pattern)
            for name, pattern in (
                ("trainer.fit", "trainer/trainer.py:"),
                ("training_step (ours)", "modules/sae.py:" + str(_line_of("training_step"))),
                ("losses (ours)", "modules/sae.py:" + str(_line_of("losses"))),
                ("LightningModule.log", "core/module.py:" + str(_line_of_lightning_log())),
                ("clip_gradients (Lightning)", "(_clip_gradients)"),
                ("Adam.step", "adam.py:"),
                (
                    "on_before_optimizer_step (ours)",
                    "modules/sae.py:" + str(_line_of("on_before_optimizer_step")),
                ),
                ("on_train_batch_end (ours)", "modules/sae.py:" + str(_line_of("on_train_batch_end"))),
                ("on_fit_start (ours)", "modules/sae.py:" + str(_line_of("on_fit_start"))),
            )
        },
        "top_functions_by_cumulative": rows[:top],
    }


def _hook_times_ours(args: argparse.Namespace, arch: str, loader: Any) -> dict[str, Any]:
    """A plain fit of ours with perf_counter wrappers on the module's methods (instance attributes, which
    Lightning's hook calls and ``self.log`` find first): an exact split of a step without profiler overhead."""
    import lightning as L

    steps = args.profile_steps
    L.seed_everything(args.seed, verbose=False)
    module = _ours_module(args, arch, loader.dataset.tokens.shape[1])
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    for name in (
        "training_step",
        "losses",
        "log",
        "backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
        "on_fit_start",
    ):
        original = getattr(module, name)

        def wrapper(*a: Any, _name: str = name, _fn: Any = original, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - start
                calls[_name] = calls.get(_name, 0) + 1

        setattr(module, name, wrapper)
    trainer = _trainer(steps)
    with _Clock(loader) as clock:
        trainer.fit(module, train_dataloaders=loader)
    per_step = {name: t * 1e3 / steps for name, t in spent.items()}
    step_ms = clock.result()["median_step_s"] * 1e3
    inside = (
        per_step.get("training_step", 0.0)
        + per_step.get("backward", 0.0)
        + per_step.get("on_before_optimizer_step", 0.0)
        + per_step.get("on_train_batch_end", 0.0)
    )
    return {
        "steps": steps,
        "fit_wall_ms_per_step": clock.wall * 1e3 / steps,
        "median_step_ms": step_ms,
        "ms_per_step": per_step,
        "calls_per_step": {name: c / steps for name, c in calls.items()},
        "training_step_excluding_losses_and_log_ms": per_step.get("training_step", 0.0)
        - per_step.get("losses", 0.0)
        - per_step.get("log", 0.0),
        "rest_of_fit_ms_per_step": clock.wall * 1e3 / steps - inside,
        "rest_of_fit_is": "fit time outside training_step/backward/our hooks, per step: Lightning's loop, hook "
        "dispatch, closure, gradient clipping, Adam's update, the LR scheduler, data fetching and (amortised) "
        "Lightning's startup",
    }


def _line_of(method: str) -> int:
    """The line cProfile names a method by (``co_firstlineno``: its first decorator, if any)."""
    from lightning_llm.modules.sae import SparseAutoencoderModule

    return getattr(SparseAutoencoderModule, method).__code__.co_firstlineno


def _line_of_lightning_log() -> int:
    from lightning.pytorch import LightningModule

    return LightningModule.log.__code__.co_firstlineno


def _profile(
    args: argparse.Namespace, arch: str, loader: Any, init: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Where each side's time goes: torch.profiler over both fits, our bare loop by phase, our fit with method
    timers, cProfile of ours. Each measurement but cProfile runs ``--profile-repeats`` times and the fastest run
    is kept (other jobs on a shared machine only ever slow a run down)."""
    from torch.profiler import ProfilerActivity, profile

    steps = args.profile_steps

    def fastest(run: Callable[[], dict[str, Any]], key: str) -> dict[str, Any]:
        runs = [run() for _ in range(args.profile_repeats)]
        best = min(runs, key=lambda r: r[key])
        return {
            **best,
            "runs_kept_fastest_of": len(runs),
            "wall_ms_per_step_all_runs": [r[key] for r in runs],
        }

    def profiled(fit: Callable[[], tuple[dict[str, Any], Any]]) -> dict[str, Any]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            timing, _ = fit()
        return {"wall_ms_per_step_under_profiler": timing["wall_s"] * 1e3 / steps, **_op_table(prof, steps)}

    out: dict[str, Any] = {"arch": arch, "steps": steps}
    out["ours_fit"] = fastest(
        lambda: profiled(lambda: _fit_ours(args, arch, loader, steps)), "wall_ms_per_step_under_profiler"
    )
    out["saelens_fit"] = fastest(
        lambda: profiled(lambda: _fit_saelens(args, arch, loader, init, steps)),
        "wall_ms_per_step_under_profiler",
    )
    out["ours_bare_phases"] = fastest(lambda: _phases_ours_bare(args, arch, loader, init), "wall_ms_per_step")
    out["ours_fit_method_times"] = fastest(
        lambda: _hook_times_ours(args, arch, loader), "fit_wall_ms_per_step"
    )
    out["ours_fit_cprofile"] = _cprofile_ours(args, arch, loader)
    return out


def _print_profile(p: dict[str, Any]) -> None:
    log = sys.stderr
    print(f"[{p['arch']}] profile over {p['steps']} steps (ms/step):", file=log)
    for name in ("ours_fit", "saelens_fit"):
        r = p[name]
        print(f"  {name}: wall {r['wall_ms_per_step_under_profiler']:.2f} under torch.profiler", file=log)
        for op in r["top_ops_by_self_cpu"][:10]:
            print(
                f"    {op['op'][:60]:<60} self {op['self_cpu_ms_per_step']:7.3f}  total "
                f"{op['cpu_total_ms_per_step']:7.3f}  calls {op['calls_per_step']:.1f}",
                file=log,
            )
        for key, v in r["lightning_llm_custom_ops"].items():
            print(f"    custom op {key}: total {v['cpu_total_ms_per_step']:.3f}", file=log)
    hooks = p["ours_fit_method_times"]
    print(
        f"  ours fit with method timers: wall {hooks['fit_wall_ms_per_step']:.2f}, median step "
        f"{hooks['median_step_ms']:.2f}; training_step minus losses and log "
        f"{hooks['training_step_excluding_losses_and_log_ms']:.3f}; rest of fit {hooks['rest_of_fit_ms_per_step']:.3f}",
        file=log,
    )
    for name, ms in hooks["ms_per_step"].items():
        print(f"    {name:<40} {ms:7.3f}  calls/step {hooks['calls_per_step'][name]:.2f}", file=log)
    bare = p["ours_bare_phases"]
    print(f"  ours bare loop: wall {bare['wall_ms_per_step']:.2f}", file=log)
    for phase, ms in bare["phases_ms_per_step"].items():
        print(f"    {phase:<50} {ms:7.3f}", file=log)
    cp = p["ours_fit_cprofile"]
    print(f"  ours fit under cProfile: {cp['fit_ms_per_step_under_cprofile']:.2f}", file=log)
    for name, ms in cp["selected_cumulative_ms_per_step"].items():
        print(f"    {name:<40} {ms:7.3f}", file=log)
    for row in cp["top_functions_by_cumulative"][:25]:
        print(
            f"    {row['function'][:90]:<90} cum {row['cumulative_ms_per_step']:7.3f} self "
            f"{row['self_ms_per_step']:6.3f} calls {row['calls_per_step']:.1f}",
            file=log,
        )


def _summarise(
    timings: list[dict[str, Any]], evals: list[dict[str, float]], batch_size: int, steps: int
) -> dict[str, Any]:
    tokens = steps * batch_size
    wall = [t["wall_s"] for t in timings]
    cpu = [t["cpu_s"] for t in timings]
    step = [t["median_step_s"] for t in timings]
    rates = [tokens / t for t in wall]
    return {
        "tokens_per_s": {"median": statistics.median(rates), "max": max(rates), "all": rates},
        "wall_s": {"median": statistics.median(wall), "min": min(wall), "all": wall},
        "ms_per_step_median": statistics.median(wall) * 1e3 / steps,
        "steady_state": {
            "what": "median interval between consecutive batch requests of a fit (one optimiser step, startup "
            "excluded), median over repetitions",
            "median_step_ms": statistics.median(step) * 1e3,
            "tokens_per_s": batch_size / statistics.median(step),
            "median_step_ms_all": [x * 1e3 for x in step],
        },
        "cpu": {
            "what": "process CPU time of the fit (one torch thread: robust to other jobs on the machine)",
            "tokens_per_s": tokens / statistics.median(cpu),
            "cpu_s_all": cpu,
        },
        "heldout": {
            key: statistics.median(e[key] for e in evals)
            for key in ("mse", "explained_variance", "l0", "dead_latents")
        },
        "heldout_all": evals,
        "timings": timings,
    }


def _run_arch(args: argparse.Namespace, arch: str, data: dict[str, Any]) -> dict[str, Any]:
    loader = _loader(data["train"], args.batch_size)
    first = next(iter(loader))["activations"]
    init = _init_state(args, arch, first)
    heldout = data["heldout"]
    log = sys.stderr
    print(f"[{arch}] checks ...", file=log, flush=True)
    checks = {"initial_sae": _initial_check(args, arch, init, heldout)}
    checks.update(_data_and_init_check(args, arch, loader, init))
    print(f"[{arch}] warm-up fits ({args.warmup_steps} steps) ...", file=log, flush=True)
    _fit_ours(args, arch, loader, args.warmup_steps)
    _fit_saelens(args, arch, loader, init, args.warmup_steps)
    _fit_ours_bare(args, arch, loader, init, args.warmup_steps)
    fits: dict[str, Callable[[], tuple[dict[str, Any], Any]]] = {
        "ours": lambda: _fit_ours(args, arch, loader, args.steps),
        "saelens": lambda: _fit_saelens(args, arch, loader, init, args.steps),
        "ours_bare": lambda: _fit_ours_bare(args, arch, loader, init, args.steps),
    }
    evaluate = {"ours": _eval_ours, "saelens": _eval_saelens, "ours_bare": _eval_ours}
    timings: dict[str, list[dict[str, Any]]] = {name: [] for name in fits}
    evals: dict[str, list[dict[str, float]]] = {name: [] for name in fits}
    names = list(fits)
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            timing, trained = fits[name]()
            timings[name].append(timing)
            evals[name].append(evaluate[name](trained, heldout))
            print(
                f"[{arch}] rep {rep + 1}/{args.reps} {name:>9}: {timing['wall_s']:7.3f} s "
                f"({args.steps * args.batch_size / timing['wall_s']:,.0f} tok/s; cpu {timing['cpu_s']:.3f} s; "
                f"median step {timing['median_step_s'] * 1e3:.2f} ms), held-out mse "
                f"{evals[name][-1]['mse']:.4g}, l0 {evals[name][-1]['l0']:.1f}",
                file=log,
                flush=True,
            )
            del trained
    results = {name: _summarise(timings[name], evals[name], args.batch_size, args.steps) for name in fits}
    ours, theirs, bare = results["ours"], results["saelens"], results["ours_bare"]

    def ratio(a: dict[str, Any], b: dict[str, Any], *path: str) -> float:
        for key in path:
            a, b = a[key], b[key]
        return a / b

    return {
        "variants": results,
        "ratios": {
            "tokens_per_s_ours_over_saelens": ratio(ours, theirs, "tokens_per_s", "median"),
            "steady_state_tokens_per_s_ours_over_saelens": ratio(
                ours, theirs, "steady_state", "tokens_per_s"
            ),
            "cpu_tokens_per_s_ours_over_saelens": ratio(ours, theirs, "cpu", "tokens_per_s"),
            "mse_ours_over_saelens": ratio(ours, theirs, "heldout", "mse"),
            "tokens_per_s_ours_bare_over_saelens": ratio(bare, theirs, "tokens_per_s", "median"),
            "steady_state_tokens_per_s_ours_bare_over_saelens": ratio(
                bare, theirs, "steady_state", "tokens_per_s"
            ),
            "lightning_share_of_ours_fit_wall": 1.0 - ratio(bare, ours, "wall_s", "median"),
            "lightning_share_of_ours_fit_cpu": 1.0 - ratio(ours, bare, "cpu", "tokens_per_s"),
        },
        "checks": checks,
        "init": {"input_scale": float(init["scale"]), "b_dec_norm": float(init["b_dec"].norm())},
    }


def _notes(args: argparse.Namespace) -> list[str]:
    return [
        "Same activations, batches and order on both sides: one epoch of ActivationDataModule's training stream "
        "materialised once; a plain DataLoader over it feeds ours and SAELens's data provider iterates the "
        "same loader (checked by digest of what each side received).",
        "Same initial SAE: our seeded unit-norm decoder rows, W_enc = W_dec^T, b_enc = 0, b_dec = geometric "
        "median of the scaled first batch (ours computes it in on_fit_start, inside the timed fit; for SAELens "
        "it is computed beforehand and copied in, since SAETrainer starts b_dec at zero). SAELens defaults not "
        "used: decoder_init_norm=0.1 and Kaiming-uniform W_dec. Checked: equal held-out MSE and L0 before "
        "training.",
        "Activation normalisation 'expected_average_only_in' on both, from the same first batch "
        "(SAELens n_batches_for_norm_estimate=1; ours init_sample_tokens=batch_size); checked equal.",
        "Decoder norm handling differs by design: ours removes the gradient component along each decoder row "
        "and renormalises rows after every step; SAELens topk uses rescale_acts_by_decoder_norm=True (its "
        "default) and never renormalises; SAELens standard leaves decoder norms free (they enter the L1 term, "
        "as in ours). This, not the data or init, is what the final MSE difference reflects.",
        f"TopK AuxK: coefficient {args.aux_coefficient:g} on both (SAELens default 1.0), k_aux = d_in/2 with "
        f"the min(n_dead / k_aux, 1) scale on both; dead = no firing for {args.dead_window_steps} steps "
        "(ours: dead_window_tokens = (steps + 1) * batch_size, since ours tests >= and SAELens >); with "
        "--steps below that window no latent is ever dead and AuxK is zero on both.",
        "Gradient-norm clipping at 1.0 on both (SAELens hard-codes it; ours via Lightning "
        "gradient_clip_val=1.0, applied after our parallel-gradient removal, as in our module's hooks).",
        "Learning rate constant on both (ours min_lr_ratio=1.0, warmup_steps=0; SAELens 'constant'); "
        "torch.optim.Adam(betas=(0.9, 0.999), eps=1e-8) on both; no weight decay; no L1 warm-up.",
        "Ours' timed fit includes Lightning's startup (Trainer.fit setup, configure_optimizers, on_fit_start "
        "with the geometric median) and per-step self.log calls (6 per step, no logger attached); SAELens's "
        "includes its norm estimate and the final folding of the scale. Trainer/SAE construction is outside "
        "both timers.",
        "SAELens's firing statistics (act_freq_scores, n_forward_passes_since_fired) are updated every step; "
        "its sparsity-window log (which builds a wandb.Histogram even without wandb) is kept out by "
        "feature_sampling_window > steps. SAELens's tqdm bar is disabled (TQDM_DISABLE=1) as ours is.",
        "relu: the L1 penalty sets each side's L0 (compare the held-out MSE together with L0); topk: L0 = k on "
        "both by construction. L0 is in the payload only.",
        f"Timing with {args.threads or 'the default number of'} torch thread(s) on a small shared machine: "
        "see machine.load_avg_1m; the steady-state and CPU-time rates are the contention-robust companions of "
        "the whole-fit wall-clock rate.",
    ]


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    warnings.filterwarnings("ignore", message=".*defined a `validation_step` but have no `val_dataloader`.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    import logging

    import lightning  # noqa: F401  (configures its loggers on import; quiet them afterwards)

    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.manual_seed(args.seed)

    print("harvesting activations ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    data = _harvest(args)
    harvest_s = time.perf_counter() - start
    d_in = data["train"].shape[1]
    n_batches = len(data["train"]) // args.batch_size
    print(
        f"  {len(data['train'])} train tokens ({n_batches} batches), {len(data['heldout'])} held-out, d_in {d_in}, "
        f"{harvest_s:.1f} s",
        file=sys.stderr,
        flush=True,
    )

    per_arch = {arch: _run_arch(args, arch, data) for arch in args.archs}
    profile_result = None
    if args.profile:
        print("profiling ours ...", file=sys.stderr, flush=True)
        loader = _loader(data["train"], args.batch_size)
        profile_result = {}
        for arch in args.archs:
            init = _init_state(args, arch, next(iter(loader))["activations"])
            profile_result[arch] = _profile(args, arch, loader, init)
            _print_profile(profile_result[arch])

    threads = torch.get_num_threads()
    summary = []
    for arch, r in per_arch.items():
        unit = (
            f"{arch}{f' k={args.k}' if arch == 'topk' else f' l1={args.l1_coefficient:g}'}, d_in={d_in}, "
            f"d_sae={args.expansion * d_in}, batch {args.batch_size} tokens, {args.steps} steps, fp32, cpu, "
            f"{threads} thread(s)"
        )
        ours, theirs = r["variants"]["ours"], r["variants"]["saelens"]
        peer = f"SAELens {SAELENS_ARCH[arch]} (SAETrainer)"
        rows = (
            ("training tokens/s, whole fit call (ours incl. Lightning startup)", "tokens_per_s", "higher"),
            ("training tokens/s, steady state (median step interval)", "steady_state", "higher"),
            ("held-out MSE per token, raw units, after training", "heldout", "lower"),
        )
        values = {
            "tokens_per_s": lambda side: side["tokens_per_s"]["median"],
            "steady_state": lambda side: side["steady_state"]["tokens_per_s"],
            "heldout": lambda side: side["heldout"]["mse"],
        }
        for metric, key, better in rows:
            summary.append(
                summary_row(
                    NAME,
                    f"SparseAutoencoderModule ({arch}, Lightning Trainer)",
                    peer,
                    f"{metric} ({unit})",
                    values[key](ours),
                    values[key](theirs),
                    better=better,
                )
            )
    checks_ok = all(
        r["checks"]["initial_sae"]["equal"]
        and r["checks"]["batches"]["identical"]
        and r["checks"]["input_scale"]["equal"]
        and r["checks"]["init_equal"]
        for r in per_arch.values()
    )
    payload = {
        "benchmark": NAME,
        "description": "SAE training on the same tiny-backbone activations: lightning_llm SparseAutoencoderModule "
        "under a lightning.Trainer vs SAELens SAETrainer, same init, data order and hyperparameters",
        "config": {
            "model": "tiny (lightning_llm.backbone), fp32, eval mode",
            "layer": args.layer,
            "layer_convention": "output of decoder block `layer` (0-based; HF hidden_states[layer + 1])",
            "activations": data["source"],
            "task": "arithmetic (ChatSFTDataModule, shuffle=False, chat template), every non-pad token",
            "dialogues": data["dialogues"],
            "train_tokens": len(data["train"]),
            "heldout_tokens": len(data["heldout"]),
            "epochs": args.steps / max(1, n_batches),
            "d_in": d_in,
            "expansion": args.expansion,
            "d_sae": args.expansion * d_in,
            "architectures": {a: SAELENS_ARCH[a] for a in args.archs},
            "k": args.k,
            "l1_coefficient": args.l1_coefficient,
            "aux_coefficient": args.aux_coefficient,
            "dead_window_steps": args.dead_window_steps,
            "batch_size_tokens": args.batch_size,
            "steps": args.steps,
            "lr": args.lr,
            "optimizer": "torch.optim.Adam(betas=(0.9, 0.999), eps=1e-8), constant lr, grad-norm clip 1.0",
            "normalize_activations": "expected_average_only_in (ours normalize_activations=True)",
            "dtype": "float32",
            "device": "cpu",
            "reps": args.reps,
            "warmup_steps": args.warmup_steps,
            "torch_threads": threads,
            "seed": args.seed,
            "quick": args.quick,
            "harvest_s": harvest_s,
        },
        "results": per_arch,
        "profile": profile_result,
        "notes": _notes(args),
        "measurement": MEASUREMENT,
        "versions": package_versions(["torch", "lightning", "sae-lens", "transformers", "lightning-llm"]),
        "machine": machine_info(),
        "date": utc_now(),
        "summary": summary,
    }
    for arch, r in per_arch.items():
        for name, v in r["variants"].items():
            print(
                f"{arch:>5} {name:>9}: fit {v['tokens_per_s']['median']:>8,.0f} tok/s ({v['ms_per_step_median']:.2f} "
                f"ms/step), steady {v['steady_state']['tokens_per_s']:>8,.0f} tok/s "
                f"({v['steady_state']['median_step_ms']:.2f} ms/step), cpu {v['cpu']['tokens_per_s']:>8,.0f} tok/s; "
                f"held-out mse {v['heldout']['mse']:.4g}, ev {v['heldout']['explained_variance']:.4f}, "
                f"l0 {v['heldout']['l0']:.1f}, dead {v['heldout']['dead_latents']}"
            )
        print(f"{arch:>5} ratios: {json.dumps({k: round(x, 4) for k, x in r['ratios'].items()})}")
        print(
            f"{arch:>5} checks: initial SAEs equal {r['checks']['initial_sae']['equal']} "
            f"(rel mse diff {r['checks']['initial_sae']['relative_mse_diff']:.1e}), batches identical "
            f"{r['checks']['batches']['identical']}, input scale equal {r['checks']['input_scale']['equal']} "
            f"(rel {r['checks']['input_scale']['relative_diff']:.1e}), b_dec/W_dec at start equal "
            f"{r['checks']['init_equal']} (b_dec max diff {r['checks']['b_dec_max_abs_diff_ours_vs_given_to_saelens']:.1e})"
        )
    if args.no_write:
        if not args.quick:
            print(json.dumps(payload, indent=2))
    else:
        print(f"wrote {write_result(NAME, payload)}")
    return 0 if checks_ok else 1


if __name__ == "__main__":
    sys.exit(main())
