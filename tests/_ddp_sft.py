"""Run by tests/test_ddp.py in a subprocess: Lightning's DDP launcher re-executes this script per rank."""

import json
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_llm.callbacks import ScaLoRA
from lightning_llm.datamodules import ChatSFTDataModule
from lightning_llm.lora import LoRAConfig, lora_layers
from lightning_llm.modules import CausalLMModule


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def main(devices: int, batch_size: int, out: str, method: str = "full") -> None:
    L.seed_everything(0)
    record = _Record()
    trainer = L.Trainer(
        strategy="ddp" if devices > 1 else "auto",
        accelerator="cpu",
        devices=devices,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[record] + ([ScaLoRA(rank_every=2)] if method == "scalora" else []),
    )
    # ScaLoRA: each rank solves for the column scales from the all-reduced gradients, so replicas agree.
    lora = LoRAConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"]) if method == "scalora" else None
    module = CausalLMModule(lr=3e-3 if lora is None else 1e-2, warmup_ratio=0.0, lora=lora)
    # The same DataModule in both runs: its sampler deals one process's shuffled order to the ranks (rank r takes
    # order[r::2]), so a batch of 2B in one process holds exactly the two ranks' batches of B.
    data = ChatSFTDataModule(task="arithmetic", num_train=64, num_val=8, batch_size=batch_size)
    trainer.fit(module, data)
    if trainer.is_global_zero:
        # With LoRA: the adapted layers (folded base weights and factors); the rest is frozen.
        source = [m for m in lora_layers(module.model).values()] or [module.model]
        params = torch.cat([p.detach().flatten() for m in source for p in m.parameters()])
        json.dump({"losses": record.losses, "params_head": params[:4096].tolist()}, open(out, "w"))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
