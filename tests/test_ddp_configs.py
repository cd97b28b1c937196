"""Configs whose callbacks do more than log (the RL shaping configs of issue 4, the PCFG probes) run under
Trainer(strategy="ddp", devices=2) on CPU.

Each config goes through the real CLI in a fresh process (2 gloo ranks, ``fast_dev_run``): callbacks that
compute auxiliary losses, probe beliefs or re-prompt rollouts must not deadlock or diverge across ranks.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
CONFIGS = [
    "larft.yaml",
    "delta_belief.yaml",
    "recontext.yaml",
    "forecasting.yaml",
    "pcfg.yaml",
    "dpo_honeypot.yaml",
    "lt_tuning.yaml",
    "sae_fast.yaml",
    "indexmem.yaml",
    "ragep.yaml",
    "proteus.yaml",
]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_runs_under_two_process_ddp(name, tmp_path, tiny_backbone):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "lightning_llm",
        "fit",
        "--config",
        str(ROOT / "configs" / name),
        "--trainer.fast_dev_run=true",
        "--trainer.strategy=ddp",
        "--trainer.devices=2",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
