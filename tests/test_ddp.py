"""DDP on CPU (2 processes, gloo) takes the same steps as one process with twice the batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).with_name("_ddp_sft.py")


def _run(devices: int, batch_size: int, out: Path, method: str = "full") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(devices), str(batch_size), str(out), method],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_ddp_two_processes_match_one_process_with_double_batch(tmp_path, tiny_backbone):
    ddp = _run(2, 4, tmp_path / "ddp.json")
    single = _run(1, 8, tmp_path / "single.json")
    assert len(ddp["losses"]) == len(single["losses"]) == 4
    # Same loss at every step, so the updates in between matched too; then the weights themselves.
    torch.testing.assert_close(
        torch.tensor(ddp["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        torch.tensor(ddp["params_head"]), torch.tensor(single["params_head"]), rtol=1e-4, atol=1e-6
    )
    assert single["losses"][-1] < single["losses"][0]


def test_scalora_under_ddp_matches_one_process_with_double_batch(tmp_path, tiny_backbone):
    """LoRA + ScaLoRA (rescale, fold, moment transfer every step) under DDP takes the single-process steps."""
    ddp = _run(2, 4, tmp_path / "ddp.json", "scalora")
    single = _run(1, 8, tmp_path / "single.json", "scalora")
    torch.testing.assert_close(
        torch.tensor(ddp["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        torch.tensor(ddp["params_head"]), torch.tensor(single["params_head"]), rtol=1e-4, atol=1e-6
    )


def test_grpo_runs_under_ddp_and_replicas_stay_identical(tmp_path, tiny_backbone):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = Path(__file__).with_name("_ddp_grpo.py")
    out = tmp_path / "grpo"
    proc = subprocess.run(
        [sys.executable, str(script), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0, rank1 = (json.loads((tmp_path / f"grpo.{r}.json").read_text()) for r in (0, 1))
    assert rank0["head"] == rank1["head"] and rank0["checksum"] == rank1["checksum"]
    for key in ("train/reward", "train/LLDS/loss", "train/grad_norm", "val/reward"):
        assert key in rank0["metrics"], sorted(rank0["metrics"])


def test_grpo_with_warmup_and_kl_is_the_same_under_fsdp2_and_ddp(tmp_path, tiny_backbone):
    """ModelParallelStrategy (FSDP2 over 2 gloo processes, the model built and sharded in configure_model) and DDP
    train the same parameters: warm-up through the strategy, a KL to the warmed-up reference (a gathered snapshot
    under FSDP), GRPO updates. The strategies reduce gradients in different orders, so the runs differ by rounding,
    which Adam's normalised step amplifies on coordinates whose gradient is near 0. Measured (this host,
    2026-12-06): the difference has 3.9e-6 of the norm of the update (parameters moved by up to 3.4e-2); its
    largest element is 4.6e-5, on one coordinate of layers.0.mlp.up_proj (1e-5 on the first host). Asserted: the
    norm ratio below 1e-4 and every element within 1e-2 of the largest move."""
    import torch

    from lightning_llm.backbones import load_model

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = Path(__file__).with_name("_strategy_grpo.py")
    for strategy in ("ddp", "fsdp"):
        proc = subprocess.run(
            [sys.executable, str(script), strategy, str(tmp_path / strategy)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
    ddp, fsdp, fsdp1 = (
        torch.load(tmp_path / name, weights_only=True) for name in ("ddp.0.pt", "fsdp.0.pt", "fsdp.1.pt")
    )
    base = load_model("tiny").state_dict()
    assert set(ddp) == set(fsdp)
    moved = max((ddp[k] - base[k]).abs().max().item() for k in ddp)
    apart = max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp)
    norm = (
        sum(((ddp[k] - fsdp[k]) ** 2).sum() for k in ddp).sqrt()
        / sum(((ddp[k] - base[k]) ** 2).sum() for k in ddp).sqrt()
    )
    assert moved > 1e-2 and float(norm) < 1e-4 and apart < 1e-2 * moved, (moved, float(norm), apart)
    assert all(torch.equal(fsdp[k], fsdp1[k]) for k in fsdp)
