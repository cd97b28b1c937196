"""Profile our SAE training fit (``benchmarks/sae_vs_saelens.py``'s ``ours`` side) against a bare loop.

On the benchmark's data and settings (its flags apply: ``--archs``, ``--steps``, ``--batch-size`` ...):

* ``torch.profiler`` op tables (top ops by self CPU time per step) of our Lightning fit and of the bare loop
  that does the same SAE math without Lightning, so the difference is Lightning's share;
* a cProfile of our Lightning fit (top entries by cumulative time).

    python tools/profile_sae.py --archs topk --steps 100
"""

from __future__ import annotations

import cProfile
import itertools
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import torch
from _harness import parser, set_threads
from sae_vs_saelens import ARCHS, fit_ours, harvest, init_state, loader, ours_module, timed_fit


def fit_ours_bare(args, arch, data, init, steps, seed) -> tuple[dict[str, float], object]:
    """Our module's SAE math without Lightning: the same per-step work as its training_step + hooks, by hand."""
    import lightning as L

    L.seed_everything(seed, verbose=False)
    module = ours_module(args, arch, data.dataset.tokens.shape[1], seed)
    sae = module.sae
    with torch.no_grad():  # what on_fit_start does, here outside the timer
        sae.input_scale.fill_(float(init["scale"]))
        sae.b_dec.copy_(init["b_dec"])
        module.initialized.fill_(True)
    optimizer = torch.optim.Adam(sae.parameters(), lr=args.lr, betas=(0.9, 0.999))
    module.train()

    def loop() -> None:
        for _, batch in zip(
            range(steps), itertools.chain.from_iterable(itertools.repeat(data)), strict=False
        ):
            module.losses(batch["activations"])["loss"].backward()
            sae.remove_parallel_gradient()
            torch.nn.utils.clip_grad_norm_(sae.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sae.normalize_decoder()

    timing, _ = timed_fit(data, loop)
    return timing, sae


def _op_table(prof: torch.profiler.profile, steps: int, top: int) -> str:
    lines = [f"{'op':<50} {'self ms/step':>12} {'calls/step':>10}"]
    for event in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]:
        lines.append(
            f"{event.key[:50]:<50} {event.self_cpu_time_total / 1e3 / steps:12.3f} {event.count / steps:10.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--archs", nargs="+", choices=list(ARCHS), default=["topk"])
    p.add_argument("--layer", type=int, default=1)
    p.add_argument("--expansion", type=int, default=8)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--l1-coefficient", type=float, default=5.0)
    p.add_argument("--aux-coefficient", type=float, default=1 / 32)
    p.add_argument("--dead-window-steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--heldout-dialogues", type=int, default=10)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    set_threads(args.threads)
    tokens = harvest(args)
    data = loader(tokens["train"], args.batch_size)
    for arch in args.archs:
        init = init_state(args, arch, next(iter(data))["activations"], args.seed)
        fit_ours(args, arch, data, args.warmup, args.seed)  # warm-up
        for label in ("Lightning fit", "bare loop"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                if label == "bare loop":
                    timing, _ = fit_ours_bare(args, arch, data, init, args.steps, args.seed)
                else:
                    timing, _ = fit_ours(args, arch, data, args.steps, args.seed)
            print(
                f"\n[{arch}] {label}: {timing['wall_s']:.3f} s, median step {timing['step_s'] * 1e3:.2f} ms"
            )
            print(_op_table(prof, args.steps, args.top))
        profiler = cProfile.Profile()
        profiler.runcall(fit_ours, args, arch, data, args.steps, args.seed)
        print(f"\n[{arch}] cProfile of the Lightning fit")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
