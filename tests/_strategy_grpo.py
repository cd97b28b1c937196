"""Run by tests/test_ddp.py: GRPOModule (+ SFTWarmup, KL to the warmed-up reference) on 2 CPU processes under
``ddp`` or FSDP2 (``ModelParallelStrategy(data_parallel_size=2)``, gloo); writes the full parameters per rank."""

import sys

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_llm.callbacks import SFTWarmup
from lightning_llm.datamodules import PromptDataModule
from lightning_llm.modules import GRPOModule


def main(strategy: str, out: str) -> None:
    L.seed_everything(0)
    if strategy == "fsdp":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[SFTWarmup(steps=3, lr=1e-2, batch_size=4)],
    )
    module = GRPOModule(group_size=4, max_new_tokens=6, lr=1e-3, mini_batches=2, beta=0.1, rewards=["format"])
    data = PromptDataModule(
        task="arithmetic", task_kwargs={"digits": 1}, num_train=32, num_val=0, batch_size=2
    )
    trainer.fit(module, data)
    if isinstance(trainer.strategy, ModelParallelStrategy):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True))
    else:
        state = module.model.state_dict()
    torch.save({k: v.detach().cpu() for k, v in state.items()}, f"{out}.{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
