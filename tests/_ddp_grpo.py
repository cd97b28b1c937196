"""Run by tests/test_ddp.py: GRPOModule under Trainer(strategy="ddp", accelerator="cpu", devices=2)."""

import json
import sys

import lightning as L
import torch

from lightning_llm.callbacks import EntropyDiscriminatorClipping, LLDSRegularizer
from lightning_llm.datamodules import PromptDataModule
from lightning_llm.modules import GRPOModule


def main(out: str) -> None:
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        val_check_interval=2,
        num_sanity_val_steps=0,
        callbacks=[EntropyDiscriminatorClipping(mode="batch"), LLDSRegularizer()],
    )
    module = GRPOModule(group_size=4, max_new_tokens=6, lr=1e-3, mini_batches=2, scale_rewards="batch")
    data = PromptDataModule(
        task="arithmetic", task_kwargs={"digits": 1}, num_train=32, num_val=8, batch_size=2
    )
    trainer.fit(module, data)
    params = torch.cat([p.detach().flatten() for p in module.model.parameters()])
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    with open(f"{out}.{trainer.global_rank}.json", "w") as f:
        json.dump(
            {"checksum": float(params.double().sum()), "head": params[:256].tolist(), "metrics": metrics}, f
        )


if __name__ == "__main__":
    main(sys.argv[1])
