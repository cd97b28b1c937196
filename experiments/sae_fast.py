"""FAST on a real instruct model: TopK SAEs on a middle layer, sequential vs block harvesting at equal tokens.

Data: the shipped templated chat corpus (:func:`~lightning_llm.datamodules.load_chat_corpus`, 300 multi-turn
conversations), each rendered by the backbone's chat template. The last ``num_val`` conversations are held out;
the others, in corpus order, give the training rows:

- ``sequential`` (FAST): one conversation per sequence, as the deployed model reads it;
- ``block`` (the baseline): the same conversations concatenated and cut into ``block_size``-token blocks, so
  attention crosses conversations and a block starts mid-conversation.

Both harvests keep the output of decoder layer ``layer`` for exactly the first ``num_tokens`` tokens of their
rows (:func:`~lightning_llm.datamodules.activation_harvest.harvest_corpus`), so the two SAEs of a seed see
the same number of activations of the same text. Per SAE seed, both modes train an identical
:class:`~lightning_llm.modules.SparseAutoencoderModule` (TopK, same initialisation, same batch order of token
positions) for ``steps`` batches of ``batch_size`` tokens, then are scored on the held-out conversations in the
sequential format:

- per-sequence MSE (raw units) and explained variance, each over **special** tokens (the tokenizer's special
  ids: ``<|im_start|>``, ``<|im_end|>``...), **ordinary** tokens (all others, role names included) and all
  tokens; the pooled figures are dominated by the special tokens' large norms, so the split is what to read;
- ``delta_loss``: LM loss (mean next-token NLL) with the SAE's reconstruction spliced into the layer's output
  at every real token, minus the clean loss, on the first ``num_delta`` held-out conversations (its relative
  version too);
- dead latents: latents that fire on no held-out token, and the training dead fraction (silent for the last
  ``dead_window_tokens`` training tokens), L0.

Run: ``python experiments/sae_fast.py`` (writes ``benchmarks/results/sae_fast_smollm2.json``).
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _results import refuse_existing, write_results
from torch import Tensor

from lightning_llm.backbones import load_backbone
from lightning_llm.backbones.inspect import decoder_layers
from lightning_llm.datamodules.activation_harvest import harvest_corpus, special_token_ids
from lightning_llm.modules import SparseAutoencoderModule
from lightning_llm.trainer import quiet_trainer
from lightning_llm.types import IGNORE_INDEX

MODES = ("sequential", "block")

DEFAULT_OUT = Path("benchmarks/results/sae_fast_smollm2.json")

METRICS = (
    "mse_special",
    "mse_ordinary",
    "mse",
    "explained_variance_special",
    "explained_variance_ordinary",
    "explained_variance",
    "l0",
    "delta_loss",
    "delta_loss_relative",
    "dead_latents_heldout",
    "dead_fraction_train",
)


def _batches(
    tokens: Tensor, special: Tensor, steps: int, batch_size: int, seed: int
) -> list[dict[str, Tensor]]:
    """``steps`` batches drawn epoch by epoch through seeded permutations of the token positions."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(tokens), generator=generator) for _ in range(
        math.ceil(steps * batch_size / len(tokens)))])  # fmt: skip
    return [
        {"activations": tokens[index], "special_mask": special[index]}
        for index in order[: steps * batch_size].split(batch_size)
    ]


def _splice_hook(sae: Any, keep: Tensor) -> Any:
    """A forward hook replacing a decoder layer's output by ``sae``'s reconstruction where ``keep`` is True."""

    def hook(module: Any, args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        replaced = torch.where(keep, sae(hidden.float()).to(hidden.dtype), hidden)
        return (replaced, *output[1:]) if isinstance(output, tuple) else replaced

    return hook


@torch.no_grad()
def _nll(
    model: Any, layer: int, val: dict[str, Tensor], count: int, sae: Any = None, chunk: int = 4
) -> float:
    """Mean next-token NLL over the real tokens of the first ``count`` held-out conversations, with ``sae``'s
    reconstruction replacing decoder layer ``layer``'s output at real tokens when given."""
    total, tokens = 0.0, 0
    for start in range(0, count, chunk):
        input_ids = val["input_ids"][start : min(start + chunk, count)]
        mask = val["attention_mask"][start : min(start + chunk, count)]
        handle = None
        if sae is not None:
            hook = _splice_hook(sae, mask.bool()[..., None])
            handle = decoder_layers(model)[layer].register_forward_hook(hook, prepend=True)
        try:
            logits = model(input_ids=input_ids, attention_mask=mask).logits.float()
        finally:
            if handle is not None:
                handle.remove()
        labels = input_ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        total, tokens = total + float(nll), tokens + int((labels != IGNORE_INDEX).sum())
    return total / tokens


def train_and_score(
    data: dict[str, Any], args: argparse.Namespace, seed: int, model: Any, clean_nll: float
) -> dict[str, float]:
    """One SAE trained on ``data``'s training activations and scored on its held-out conversations."""
    L.seed_everything(seed, verbose=False)
    module = SparseAutoencoderModule(
        data["train"].shape[1], expansion=args.expansion, architecture="topk", k=args.k, lr=args.lr,
        min_lr_ratio=0.1, dead_window_tokens=args.dead_window_tokens, init_sample_tokens=4096,
        compute_delta_loss=False, seed=seed,
    )  # fmt: skip
    train = torch.utils.data.DataLoader(
        _batches(data["train"], data["train_special"], args.steps, args.batch_size, seed),
        batch_size=None,
        shuffle=False,
    )
    val = torch.utils.data.DataLoader([data["val"]], batch_size=None, shuffle=False)
    trainer = quiet_trainer(max_steps=args.steps, limit_val_batches=1.0)
    trainer.fit(module, train_dataloaders=train)
    logged = {name: float(value) for name, value in trainer.validate(module, val, verbose=False)[0].items()}
    out = {name: logged[f"val/{name}"] for name in METRICS[:7]}
    sae = module.sae.eval()
    with torch.no_grad():
        real = data["val"]["attention_mask"].bool()
        fired = (sae.encode(data["val"]["activations"][real]) > 0).any(0)
    spliced = _nll(model, args.layer, data["val"], args.num_delta, sae)
    out["delta_loss"] = spliced - clean_nll
    out["delta_loss_relative"] = (spliced - clean_nll) / clean_nll
    out["dead_latents_heldout"] = int((~fired).sum())
    out["dead_fraction_train"] = float((module.tokens_since_fired >= args.dead_window_tokens).float().mean())
    return out


def _spread(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The study as a JSON-ready dict: per mode and seed the metrics, their median and spread, the pairing."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    torch.manual_seed(0)
    model, tokenizer = load_backbone(args.model)
    model.eval().requires_grad_(False)
    harvested, harvest_cpu = {}, {}
    for mode in MODES:
        start = time.process_time()
        # fmt: off
        harvested[mode] = harvest_corpus(
            model, tokenizer, layer=args.layer, mode=mode, num_tokens=args.num_tokens, num_val=args.num_val,
            max_length=args.max_length, block_size=args.block_size,
        )
        # fmt: on
        harvest_cpu[mode] = round(time.process_time() - start, 1)
        special = harvested[mode]["train_special"].float().mean()
        print(
            f"harvested {mode}: {args.num_tokens} tokens ({float(special):.3f} special) in {harvest_cpu[mode]} CPU-s"
        )
    val = harvested["sequential"]["val"]
    torch.testing.assert_close(val["activations"], harvested["block"]["val"]["activations"])  # same held-out
    start = time.process_time()
    clean = _nll(model, args.layer, val, args.num_delta)
    clean_cpu = round(time.process_time() - start, 1)
    runs = []
    for seed in args.seeds:
        for mode in MODES:
            start = time.process_time()
            metrics = train_and_score(harvested[mode], args, seed, model, clean)
            record = {
                "mode": mode,
                "seed": seed,
                **metrics,
                "cpu_seconds": round(time.process_time() - start, 1),
            }
            runs.append(record)
            print(
                f"{mode:>10} seed {seed}: MSE special {metrics['mse_special']:.1f} ordinary "
                f"{metrics['mse_ordinary']:.2f} | EV special {metrics['explained_variance_special']:.3f} "
                f"ordinary {metrics['explained_variance_ordinary']:.3f} pooled {metrics['explained_variance']:.3f}"
                f" | dL {metrics['delta_loss']:.4f} | dead {metrics['dead_latents_heldout']} "
                f"({record['cpu_seconds']} CPU-s)",
                flush=True,
            )
    summary = {
        mode: {key: _spread([r[key] for r in runs if r["mode"] == mode]) for key in METRICS} for mode in MODES
    }
    paired = {}
    for key in ("mse_special", "mse_ordinary", "mse"):
        ratios = [
            next(r[key] for r in runs if r["mode"] == "block" and r["seed"] == seed)
            / next(r[key] for r in runs if r["mode"] == "sequential" and r["seed"] == seed)
            for seed in args.seeds
        ]
        paired[f"{key}_block_over_sequential"] = _spread(ratios)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}
    return {
        "study": "FAST sequential vs block SAE training on a real instruct model (experiments/sae_fast.py)",
        "settings": settings,
        "corpus": "lightning_llm/assets/chat_corpus.jsonl (templated, lightning_llm.datamodules.chat_corpus)",
        "special_token_ids": sorted(special_token_ids(tokenizer)),
        "train_special_fraction": {m: float(harvested[m]["train_special"].float().mean()) for m in MODES},
        "heldout_tokens": harvested["sequential"]["val_tokens"],
        "heldout_special_fraction": float(val["special_mask"].sum() / val["attention_mask"].sum()),
        "clean_nll": clean,
        "runs": runs,
        "summary": summary,
        "paired_ratios": paired,
        "harvest_cpu_seconds": harvest_cpu,
        "clean_nll_cpu_seconds": clean_cpu,
        "total_cpu_seconds": round(time.process_time() - cpu0, 1),
        "total_wall_seconds": round(time.perf_counter() - wall0, 1),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layer", type=int, default=15, help="0-based decoder layer whose output is read")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="SAE seeds")
    parser.add_argument("--num-tokens", type=int, default=20_480, help="harvested training tokens per mode")
    parser.add_argument("--num-val", type=int, default=60, help="held-out conversations (the corpus's last)")
    parser.add_argument("--num-delta", type=int, default=24, help="held-out conversations for delta_loss")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--expansion", type=int, default=8)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dead-window-tokens", type=int, default=10_240)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    refuse_existing(args.out, args.overwrite)
    write_results(args.out, run(args), indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
