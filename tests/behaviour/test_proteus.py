"""Behaviour: Proteus 2-bit trellis quantisation keeps a trained tiny model far closer to fp32 than RTN-2.

The embedded ``"tiny"`` backbone (Llama, 4 layers, hidden 128; 737k weights in its 28 decoder linears) is
trained by :func:`~lightning_llm.evaluation.quantizers.train_arithmetic_model` (``CausalLMModule``, lr 5e-3,
cosine, 800 steps of 64 conversations of two-digit arithmetic with ``+``, ``-`` and ``*``: a task that needs
exact weights; a model trained on PCFG sentences was insensitive even to RTN-2, and at 400 steps this one had not
learned the products yet and every quantiser matched it). :func:`~lightning_llm.evaluation.quantizers.
compare_quantizers` quantises copies, every decoder linear (the tied embedding / ``lm_head`` stays fp32), and
scores the held-out response tokens of 200 conversations by perplexity and by the mean KL from the fp32
model's next-token distributions:

- ``rtn``: round-to-nearest, 2 bits, per-row MSE-best step, no rotation (the plain RTN-2 baseline);
- ``proteus``: random Hadamard incoherence + MUL-BAL trellis code at 2 bits (L = 12 here, ~1 min of encoding;
  the library's default is L = 16) + channel compensation;
- ``proteus+distill``: the same bits, then few-shot distillation of the per-layer affine and the channel
  scales on the first training batch (64 conversations, 50 Adam steps);
- ``nf4``: bitsandbytes NF4 (4 bits per weight plus a scale per 64).

Measured on the development machine (one thread), perplexity fp32 / NF4 / RTN-2 / Proteus / Proteus+distill,
then KL to fp32 (nats per token) RTN-2 / Proteus / Proteus+distill / NF4:

- seed 0: 2.359 / 2.358 / 2.524 / 2.407 / 2.368; KL 0.0653 / 0.0155 / 0.0073 / 0.0007
- seed 1: 2.202 / 2.206 / 2.322 / 2.269 / 2.211; KL 0.0575 / 0.0232 / 0.0031 / 0.0017
- seed 2: 2.664 / 2.662 / 2.830 / 2.668 / 2.670; KL 0.0451 / 0.0040 / 0.0019 / 0.0019

At L = 10 with 16 calibration conversations (an earlier run) the ordering was the same except that the
distillation raised seed 2's perplexity by 0.013 while lowering its calibration KL 50-fold: perplexity moves by
little once the model is this close to fp32, so the distillation is judged by the KL it minimises.

Asserted at seed 0, each margin under half the smallest gap over the three seeds: Proteus's perplexity ≤ RTN-2's
− 0.025 (gaps 0.117 / 0.053 / 0.162) and its KL ≤ 0.5 × RTN-2's (ratios 0.24 / 0.40 / 0.09); distillation's
KL ≤ 0.6 × Proteus's (0.47 / 0.13 / 0.48), its perplexity ≤ RTN-2's − 0.05 (gaps 0.156 / 0.111 / 0.160) and ≤
NF4's + 0.02 (excess 0.011 / 0.004 / 0.008) at half NF4's bits.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_llm.evaluation.quantizers import compare_quantizers, train_arithmetic_model
from lightning_llm.quantization import TrellisLinear

pytestmark = pytest.mark.slow

STEPS, L_TRELLIS, CALIBRATION = 800, 12, 64
METHODS = ("fp32", "nf4", "rtn", "proteus", "proteus+distill")
MARGIN_RTN, KL_RATIO_RTN = 0.025, 0.5
KL_RATIO_DISTILL, MARGIN_DISTILL_RTN, NF4_GAP = 0.6, 0.05, 0.02


def run(seed: int, steps: int = STEPS) -> dict[str, float]:
    """Train the tiny model on arithmetic, quantise copies; held-out perplexities and KLs to fp32."""
    model, data = train_arithmetic_model(steps, seed=seed)
    held_out = list(data.val_dataloader())
    first = next(iter(data.train_dataloader()))
    calibration = {k: first[k][:CALIBRATION] for k in ("input_ids", "attention_mask")}
    results = compare_quantizers(model, held_out, methods=METHODS, L=L_TRELLIS, calibration=calibration)
    assert sum(isinstance(m, TrellisLinear) for m in results["proteus"]["model"].modules()) == 28
    return {method: r["perplexity"] for method, r in results.items()} | {
        f"kl:{method}": r["kl_to_fp32"] for method, r in results.items()
    }


@pytest.fixture(scope="module")
def ppl(tiny_backbone):
    return run(0)


def test_proteus_well_below_rtn2(ppl):
    assert all(math.isfinite(v) for v in ppl.values()), ppl
    assert ppl["proteus"] <= ppl["rtn"] - MARGIN_RTN, ppl
    assert ppl["kl:proteus"] <= KL_RATIO_RTN * ppl["kl:rtn"], ppl
    assert ppl["fp32"] < ppl["proteus"], ppl


def test_distillation_moves_towards_fp32_and_nf4(ppl):
    assert ppl["kl:proteus+distill"] <= KL_RATIO_DISTILL * ppl["kl:proteus"], ppl
    assert ppl["proteus+distill"] <= ppl["rtn"] - MARGIN_DISTILL_RTN, ppl
    assert ppl["proteus+distill"] <= ppl["nf4"] + NF4_GAP, ppl


if __name__ == "__main__":  # the seeds of the docstring: python tests/behaviour/test_proteus.py 0 1 2
    import sys

    torch.set_num_threads(1)
    for s in map(int, sys.argv[1:] or ["0", "1", "2"]):
        print(s, {k: round(v, 4) for k, v in run(s).items()}, flush=True)
