"""Sparse autoencoder training: ``lightning_llm`` (``SparseAutoencoderModule`` under Lightning) vs SAELens.

Both libraries train the same SAE on the same activations in one process, side by side:

* **data**: residual-stream activations of ``--model`` (default the tiny Llama; fp32, eval mode) at the output of
  block ``--layer`` (HF ``hidden_states[layer + 1]``), every token of chat-templated dialogues: ``--data
  arithmetic`` (default) harvested by ``ActivationDataModule(mode="sequential")`` (exactly ``steps x batch_size``
  training tokens through its seeded mixing buffer); ``--data chat`` the shipped multi-turn chat corpus, one
  conversation per sequence (:func:`lightning_llm.datamodules.activation_harvest.harvest_corpus`, its last
  ``--heldout-dialogues`` conversations held out), the first ``steps x batch_size`` training tokens shuffled
  with ``--seed``. One epoch is materialised once; a plain ``DataLoader`` over it feeds ours
  and SAELens's ``SAETrainer`` iterates the same loader, so both train on identical batches in identical order
  (checked: digests of what each side received). Held-out: the DataModule's validation dialogues.
* **SAE**: ``d_sae = --expansion x d_in``; ``topk`` (k, AuxK 1/32 with k_aux = d_in / 2) and ``relu`` (L1 x
  sum_i f_i ||d_i||, SAELens ``standard``); identical init on both sides (our seeded unit-norm decoder rows,
  ``W_enc = W_dec^T``, ``b_enc = 0``, ``b_dec`` = geometric median of the scaled first batch; SAELens gets these
  tensors, checked: same held-out MSE and L0); ``expected_average_only_in`` normalisation from the same first
  batch (checked equal); ``torch.optim.Adam`` (0.9, 0.999), the same constant lr, gradient-norm clipping at 1.0
  on both; no wandb, checkpoints, evaluators, logger or progress bar.
* **differences by design**: ours keeps decoder rows at unit norm (parallel gradient removed, rows renormalised
  after each step); SAELens TopK rescales activations by the decoder norm and never renormalises, SAELens
  standard leaves rows free. For TopK, ``--ours-variants`` adds our module under SAELens's conventions, one lead
  of the quality gap each: ``rescale`` (``rescale_acts_by_decoder_norm=True``: free rows, selection through
  ``z * ||d||``) and ``aux_relu`` (the former AuxK, a ReLU before the dead latents' top-k; ``default`` has
  SAELens's AuxK). Dead latents: SAELens counts steps, ours tokens (aligned windows). Ours' timed fit
  includes Lightning's startup (``on_fit_start``: input scale, geometric median) and ``self.log`` every step;
  SAELens's includes its norm estimate and the final folding of the scale; its ``b_dec`` median is computed
  beforehand (its trainer has no such step). For ``relu`` read the MSE with L0 (the L1 penalty sets each side's).

Measurement: per architecture a short untimed warm-up fit per side, then ``--reps`` repetitions in alternating
order, repetition ``r`` with a fresh SAE initialised from seed ``seed + r`` on both sides (so the held-out MSE is
over ``reps`` seeds, paired). Timed: ``trainer.fit`` of each side (whole-fit tokens/s) and, inside it, the median
interval between batch requests (steady-state tokens/s, no startup). After every fit one function evaluates
both SAEs' ``encode``/``decode`` on the held-out activations: MSE over all tokens and, separately, over special
(chat-template) and ordinary tokens, explained variance, L0, dead latents. ``tools/profile_sae.py`` profiles our fit and
compares it with the same SAE math in a hand-written loop (Lightning's share of our time).

    python benchmarks/sae_vs_saelens.py                  # topk and relu, 200 steps of 1024 tokens, 5 reps
    python benchmarks/sae_vs_saelens.py --model smollm2-135m --data chat --layer 15 --expansion 4 --batch-size 256 \
        --steps 100 --dead-window-steps 16 --heldout-dialogues 60 --ours-variants default rescale aux_relu \
        --tag smollm2                                    # real activations -> results/sae_vs_saelens-smollm2.json
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")  # before SAELens imports tqdm: no progress bar on either side

import torch
from _harness import digest, finish, parser, result, row, set_threads, stat

NAME = "sae_vs_saelens"
ARCHS = {"topk": "topk", "relu": "standard"}  # ours -> SAELens architecture
INIT_TOL = 1e-5  # relative |MSE_ours - MSE_saelens| of the two initial SAEs on held-out data


def harvest(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Training tokens (one epoch, in training order), held-out tokens and their special-token flags."""
    from lightning_llm.datamodules.activations import ActivationDataModule

    needed = args.steps * args.batch_size
    if args.data == "chat":
        return _harvest_chat(args, needed)
    # fmt: off
    dm = ActivationDataModule(
        model=args.model, layer=args.layer, mode="sequential", task="arithmetic",
        num_train=math.ceil(needed / 20), num_val=args.heldout_dialogues, max_length=args.max_length,
        num_tokens=needed, batch_size=args.batch_size, seed=args.seed,
    )
    # fmt: on
    dm.prepare_data()
    dm.setup("fit")
    train = torch.cat([batch["activations"] for batch in dm.train_dataloader()])
    heldout = torch.cat([b["activations"][b["attention_mask"].bool()] for b in dm.val_dataloader()])
    special = torch.cat([b["special_mask"][b["attention_mask"].bool()] for b in dm.val_dataloader()])
    return {
        "train": train.float().contiguous(),
        "heldout": heldout.float().contiguous(),
        "heldout_special": special.bool(),
    }


def _harvest_chat(args: argparse.Namespace, needed: int) -> dict[str, torch.Tensor]:
    """The chat corpus's conversations, one per sequence; the first ``needed`` training tokens, shuffled."""
    from lightning_llm.backbones import load_backbone
    from lightning_llm.datamodules.activation_harvest import harvest_corpus

    model, tokenizer = load_backbone(args.model)
    model.eval().requires_grad_(False)
    # fmt: off
    data = harvest_corpus(
        model, tokenizer, layer=args.layer, mode="sequential", num_tokens=needed,
        num_val=args.heldout_dialogues, max_length=args.max_length,
    )
    # fmt: on
    order = torch.randperm(needed, generator=torch.Generator().manual_seed(args.seed))
    real = data["val"]["attention_mask"].bool()
    return {
        "train": data["train"][order].float().contiguous(),
        "heldout": data["val"]["activations"][real].float().contiguous(),
        "heldout_special": data["val"]["special_mask"][real],
    }


class Batches(torch.utils.data.Dataset):
    """Item ``i`` is ``{"activations": tokens[i*B:(i+1)*B]}``; records the time of every request (one per step)."""

    def __init__(self, tokens: torch.Tensor, batch_size: int) -> None:
        self.tokens, self.batch_size = tokens, batch_size
        self.stamps: list[float] = []

    def __len__(self) -> int:
        return len(self.tokens) // self.batch_size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.stamps.append(time.perf_counter())
        return {"activations": self.tokens[i * self.batch_size : (i + 1) * self.batch_size]}


def loader(tokens: torch.Tensor, batch_size: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(Batches(tokens, batch_size), batch_size=None, shuffle=False)


def _provider(data: torch.utils.data.DataLoader, record: list[torch.Tensor] | None = None) -> Iterator[Any]:
    """SAELens's data provider: the first batch (its norm estimate), then the loader's batches, epoch after epoch."""
    yield next(iter(data))["activations"]
    for batch in itertools.chain.from_iterable(itertools.repeat(data)):
        if record is not None:
            record.append(batch["activations"])
        yield batch["activations"]


#: Our TopK module under each lead's convention (see the module docstring).
VARIANTS = {
    "default": {},
    "rescale": {"rescale_acts_by_decoder_norm": True},
    "aux_relu": {"aux_relu": True},
}


def ours_module(args: argparse.Namespace, arch: str, d_in: int, seed: int, variant: str = "default") -> Any:
    from lightning_llm.modules.sae import SparseAutoencoderModule

    # fmt: off
    return SparseAutoencoderModule(
        d_in, expansion=args.expansion, architecture=arch, k=args.k, l1_coefficient=args.l1_coefficient,
        aux_coefficient=args.aux_coefficient,
        dead_window_tokens=(args.dead_window_steps + 1) * args.batch_size, lr=args.lr, min_lr_ratio=1.0,
        warmup_steps=0, sparsity_warmup_steps=0, betas=(0.9, 0.999), normalize_activations=True,
        init_sample_tokens=args.batch_size, compute_delta_loss=False, seed=seed, **VARIANTS[variant],
    )
    # fmt: on


def init_state(
    args: argparse.Namespace, arch: str, first: torch.Tensor, seed: int
) -> dict[str, torch.Tensor]:
    """The shared initial SAE: our seeded directions, W_enc = W_dec^T, b_enc = 0, b_dec = geometric median."""
    from lightning_llm.sae import geometric_median

    sae = ours_module(args, arch, first.shape[1], seed).sae
    sample = first[: args.batch_size].float()
    scale = math.sqrt(sae.d_in) / float(sample.norm(dim=-1).mean().clamp_min(1e-12))
    return {
        "W_dec": sae.W_dec.detach().clone(),
        "W_enc": sae.W_enc.detach().clone(),
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

    # fmt: off
    common = dict(
        d_in=d_in, d_sae=args.expansion * d_in, dtype="float32", device="cpu", apply_b_dec_to_input=True,
        normalize_activations="expected_average_only_in", decoder_init_norm=None,
    )
    # fmt: on
    if arch == "topk":
        extra = dict(rescale_acts_by_decoder_norm=True, use_sparse_activations=False)
        sae = TopKTrainingSAE(
            TopKTrainingSAEConfig(**common, k=args.k, aux_loss_coefficient=args.aux_coefficient, **extra)
        )
    else:
        extra = dict(l1_coefficient=args.l1_coefficient, lp_norm=1.0, l1_warm_up_steps=0)
        sae = StandardTrainingSAE(StandardTrainingSAEConfig(**common, **extra))
    with torch.no_grad():
        sae.W_dec.copy_(init["W_dec"])
        sae.W_enc.copy_(init["W_enc"].T)
        sae.b_enc.copy_(init["b_enc"])
        sae.b_dec.copy_(init["b_dec"])
    return sae


def _saelens_trainer(args: argparse.Namespace, sae: Any, provider: Iterator[Any], steps: int) -> Any:
    from sae_lens import LoggingConfig, SAETrainer
    from sae_lens.config import SAETrainerConfig

    # fmt: off
    cfg = SAETrainerConfig(
        total_training_samples=steps * args.batch_size, train_batch_size_samples=args.batch_size, lr=args.lr,
        lr_end=args.lr, lr_scheduler_name="constant", lr_warm_up_steps=0, lr_decay_steps=0, adam_beta1=0.9,
        adam_beta2=0.999, device="cpu", autocast=False, dead_feature_window=args.dead_window_steps,
        feature_sampling_window=max(2000, steps + 1),
        # its window log builds a wandb.Histogram: keep it out n_checkpoints=0, checkpoint_path=None,
        save_final_checkpoint=False, logger=LoggingConfig(log_to_wandb=False), n_batches_for_norm_estimate=1,
    )
    # fmt: on
    return SAETrainer(cfg=cfg, sae=sae, data_provider=provider, evaluator=None, save_checkpoint_fn=None)


@torch.no_grad()
def evaluate(
    sae: Any, x: torch.Tensor, special: torch.Tensor | None = None, chunk: int = 4096
) -> dict[str, float]:
    """THE metric function for both trained SAEs: raw-unit MSE per token (all, and over the ``special`` and the
    other, ordinary, tokens apart), explained variance, L0, dead latents (firing on no held-out token)."""
    sae.eval()
    errors, l0, fired = [], 0.0, None
    for start in range(0, len(x), chunk):
        xc = x[start : start + chunk]
        f = sae.encode(xc)
        errors.append((sae.decode(f) - xc).pow(2).sum(-1).double())
        active = f != 0
        l0 += float(active.sum())
        fired = active.any(0) if fired is None else fired | active.any(0)
    error = torch.cat(errors)
    mse = float(error.mean())
    variance = float((x - x.mean(0)).pow(2).sum(-1).mean())
    out = {
        "mse": mse,
        "explained_variance": 1 - mse / variance,
        "l0": l0 / len(x),
        "dead": int((~fired).sum()),
    }
    if special is not None:
        for name, selected in (("special", special), ("ordinary", ~special)):
            if selected.any():
                part = x[selected].double()
                out[f"mse_{name}"] = float(error[selected].mean())
                out[f"explained_variance_{name}"] = 1 - float(error[selected].sum()) / float(
                    (part - part.mean(0)).pow(2).sum()
                )
    return out


def timed_fit(data: torch.utils.data.DataLoader, fit: Callable[[], Any]) -> tuple[dict[str, float], Any]:
    """Wall time of ``fit()`` and the median interval between its batch requests."""
    data.dataset.stamps.clear()
    start = time.perf_counter()
    trained = fit()
    wall = time.perf_counter() - start
    steps = [b - a for a, b in itertools.pairwise(data.dataset.stamps)]
    return {"wall_s": wall, "step_s": statistics.median(steps) if steps else float("nan")}, trained


def fit_ours(
    args, arch, data, steps, seed, callbacks=None, variant="default"
) -> tuple[dict[str, float], Any]:
    import lightning as L

    from lightning_llm.trainer import quiet_trainer

    L.seed_everything(seed, verbose=False)
    module = ours_module(args, arch, data.dataset.tokens.shape[1], seed, variant)
    t = quiet_trainer(steps, callbacks=callbacks or [], gradient_clip_val=1.0)  # SAELens clips at 1.0 too
    timing, _ = timed_fit(data, lambda: t.fit(module, train_dataloaders=data))
    if t.global_step != steps:
        raise RuntimeError(f"ours ran {t.global_step} steps, expected {steps}")
    return timing, module.sae


def fit_saelens(args, arch, data, init, steps, seed, record=None) -> tuple[dict[str, float], Any]:
    import lightning as L

    L.seed_everything(seed, verbose=False)
    sae = _saelens_sae(args, arch, data.dataset.tokens.shape[1], init)
    t = _saelens_trainer(args, sae, _provider(data, record), steps)
    timing, trained = timed_fit(data, t.fit)
    if t.n_training_steps != steps:
        raise RuntimeError(f"SAELens ran {t.n_training_steps} steps, expected {steps}")
    return timing, trained


def _checks(args: argparse.Namespace, arch: str, data: Any, init: dict[str, torch.Tensor], heldout) -> dict:
    """Same initial SAEs on held-out data; short fits that record the batches each side trains on and its
    starting input scale / b_dec (SAELens's own ActivationScaler estimate vs our on_fit_start)."""
    import lightning as L
    from sae_lens.training.activation_scaler import ActivationScaler

    module = ours_module(args, arch, heldout.shape[1], args.seed)
    with torch.no_grad():
        module.sae.input_scale.fill_(float(init["scale"]))
        module.sae.b_dec.copy_(init["b_dec"])
    theirs = _saelens_sae(args, arch, heldout.shape[1], init)
    theirs.fold_activation_norm_scaling_factor(float(init["scale"]))
    ours_m, theirs_m = evaluate(module.sae, heldout), evaluate(theirs, heldout)
    initial_rel = abs(ours_m["mse"] - theirs_m["mse"]) / max(abs(ours_m["mse"]), 1e-30)

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.batches: list[torch.Tensor] = []
            self.start: dict[str, torch.Tensor] = {}

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:  # after our on_fit_start
            self.start = {
                k: getattr(pl_module.sae, k).detach().clone() for k in ("input_scale", "b_dec", "W_dec")
            }

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.batches.append(batch["activations"].clone())

    steps, seen = min(args.steps, 5), []
    fit_saelens(args, arch, data, init, steps, args.seed, record=seen)
    recorder = Recorder()
    fit_ours(args, arch, data, steps, args.seed, [recorder])
    expected = [b["activations"] for _, b in zip(range(steps), data, strict=False)]
    digests = {"loader": digest(expected), "ours": digest(recorder.batches), "saelens": digest(seen[:steps])}
    scaler = ActivationScaler()
    scaler.estimate_scaling_factor(
        d_in=heldout.shape[1], data_provider=iter([expected[0]]), n_batches_for_norm_estimate=1
    )
    scale_rel = abs(float(recorder.start["input_scale"]) - scaler.scaling_factor) / scaler.scaling_factor
    return {
        "initial_sae_relative_mse_diff": initial_rel,
        "initial_sae_equal": initial_rel <= INIT_TOL and abs(ours_m["l0"] - theirs_m["l0"]) <= 1e-3,
        "batch_digests": digests,
        "batches_identical": len(set(digests.values())) == 1,
        "input_scale_relative_diff": scale_rel,
        "input_scale_equal": scale_rel <= 1e-5,
        "init_equal": float((recorder.start["b_dec"] - init["b_dec"]).abs().max()) <= 1e-5
        and bool(torch.equal(recorder.start["W_dec"], init["W_dec"])),
    }


def _run_arch(args: argparse.Namespace, arch: str, tokens: dict[str, torch.Tensor]) -> dict[str, Any]:
    data = loader(tokens["train"], args.batch_size)
    first = next(iter(data))["activations"]
    heldout = tokens["heldout"]
    checks = _checks(args, arch, data, init_state(args, arch, first, args.seed), heldout)
    fits = {
        "ours": lambda seed, init: fit_ours(args, arch, data, args.steps, seed),
        "saelens": lambda seed, init: fit_saelens(args, arch, data, init, args.steps, seed),
    }
    for variant in args.ours_variants if arch == "topk" else ():
        if variant != "default":
            fits[f"ours_{variant}"] = lambda seed, init, v=variant: fit_ours(
                args, arch, data, args.steps, seed, variant=v
            )
    warm = init_state(args, arch, first, args.seed)
    fit_ours(args, arch, data, args.warmup, args.seed)
    fit_saelens(args, arch, data, warm, args.warmup, args.seed)
    out: dict[str, dict[str, list[float]]] = {n: {} for n in fits}
    names = list(fits)
    for rep in range(args.reps):
        seed = args.seed + rep
        init = init_state(args, arch, first, seed)
        order = names[rep % len(names) :] + names[: rep % len(names)]  # each side leads in turn
        for name in order if rep % 2 == 0 else order[::-1]:
            timing, sae = fits[name](seed, init)
            metrics = evaluate(sae, heldout, tokens.get("heldout_special"))
            values = {"tokens_per_s": args.steps * args.batch_size / timing["wall_s"], **metrics}
            values["steady_tokens_per_s"] = args.batch_size / timing["step_s"]
            for key, value in values.items():
                out[name].setdefault(key, []).append(value)
            print(f"[{arch}] rep {rep + 1}/{args.reps} {name}: {values}", file=sys.stderr, flush=True)
    return {"values": out, "checks": checks}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, warmup=10)
    p.add_argument("--model", default="tiny", help="backbone whose activations are harvested")
    p.add_argument(
        "--data", choices=["arithmetic", "chat"], default="arithmetic",
        help="arithmetic dialogues (ActivationDataModule) or the shipped multi-turn chat corpus",
    )  # fmt: skip
    p.add_argument(
        "--ours-variants", nargs="+", choices=list(VARIANTS), default=["default"],
        help="topk: our module also under these conventions (rescale, aux_relu), each against SAELens",
    )  # fmt: skip
    p.add_argument("--archs", nargs="+", choices=list(ARCHS), default=list(ARCHS))
    p.add_argument("--layer", type=int, default=1, help="0-based decoder block whose output is read")
    p.add_argument("--expansion", type=int, default=8, help="d_sae = expansion * d_in")
    p.add_argument("--k", type=int, default=32, help="active latents per token (topk)")
    p.add_argument("--l1-coefficient", type=float, default=5.0, help="L1 coefficient (relu/standard)")
    p.add_argument("--aux-coefficient", type=float, default=1 / 32, help="AuxK coefficient (topk)")
    p.add_argument("--dead-window-steps", type=int, default=1000, help="silent steps before a latent is dead")
    p.add_argument("--batch-size", type=int, default=1024, help="tokens per optimiser step")
    p.add_argument("--steps", type=int, default=200, help="optimiser steps per fit")
    p.add_argument("--lr", type=float, default=4e-4, help="constant Adam learning rate")
    p.add_argument(
        "--heldout-dialogues", type=int, default=600, help="held-out dialogues (chat: corpus's last)"
    )
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    set_threads(args.threads)
    warnings.filterwarnings(
        "ignore", message=".*(does not have many workers|set_vital|validation_step|LeafSpec).*"
    )
    import logging

    import lightning  # noqa: F401  (configures its loggers on import; quiet them afterwards)

    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    tokens = harvest(args)
    d_in = tokens["train"].shape[1]
    per_arch = {arch: _run_arch(args, arch, tokens) for arch in args.archs}
    summary = []
    for arch, r in per_arch.items():
        unit = (
            f"{arch}{f' k={args.k}' if arch == 'topk' else f' l1={args.l1_coefficient:g}'}, d_in={d_in}, "
            f"d_sae={args.expansion * d_in}, batch {args.batch_size} tokens, {args.steps} steps, {args.model}, fp32, "
            f"cpu, {args.threads} thread(s)"
        )
        theirs = r["values"]["saelens"]
        metrics = [
            ("training tokens/s, whole fit call (ours incl. Lightning startup)", "tokens_per_s", "higher"),
            ("training tokens/s, steady state (median step interval)", "steady_tokens_per_s", "higher"),
            (f"held-out MSE per token, raw units, after training ({args.reps} seeds)", "mse", "lower"),
        ]
        if "mse_special" in theirs:
            metrics += [
                (f"held-out MSE per {kind} token, raw units ({args.reps} seeds)", f"mse_{kind}", "lower")
                for kind in ("special", "ordinary")
            ]
        for side, ours in r["values"].items():
            if side == "saelens":
                continue
            variant = side.removeprefix("ours").lstrip("_") or "default"
            label = f"SparseAutoencoderModule ({arch}, Lightning Trainer{'' if side == 'ours' else ', ' + variant})"
            for metric, key, better in metrics:
                peer = f"SAELens {ARCHS[arch]} (SAETrainer)"
                summary.append(row(NAME, f"{metric} ({unit})", label, peer, ours[key], theirs[key], better))
    checks = {arch: r["checks"] for arch, r in per_arch.items()}
    keys = ("initial_sae_equal", "batches_identical", "input_scale_equal", "init_equal")
    config = {**vars(args), "no_write": None, "d_in": d_in, "train_digest": digest(tokens["train"])}
    config.update(train_tokens=len(tokens["train"]), heldout_tokens=len(tokens["heldout"]))
    details = {
        a: {n: {k: stat(v) for k, v in vs.items()} for n, vs in r["values"].items()}
        for a, r in per_arch.items()
    }
    passed = all(c[k] for c in checks.values() for k in keys)
    packages = ("torch", "lightning", "sae-lens", "transformers", "lightning-llm")
    payload = result(
        NAME,
        __doc__,
        summary,
        config=config,
        checks=checks,
        passed=passed,
        details=details,
        packages=packages,
    )
    return finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
