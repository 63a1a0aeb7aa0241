"""PyTorch Lightning DDP on CPU, as a user writes it for torchrun: a tiny model made in code,
Trainer(strategy="ddp", num_nodes=N, devices=M). Prints what Lightning made of the world."""
import argparse
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


parser = argparse.ArgumentParser()
parser.add_argument("--num-nodes", type=int, required=True)
parser.add_argument("--devices", type=int, required=True)
args = parser.parse_args()
torch.manual_seed(0)
trainer = L.Trainer(strategy="ddp", accelerator="cpu", num_nodes=args.num_nodes,
                    devices=args.devices, max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
trainer.fit(Tiny(), DataLoader(data, batch_size=4))  # 16 batches over 4 ranks: 4 steps each
cluster = type(trainer.strategy.cluster_environment).__name__
print(f"LIGHTNING rank={trainer.global_rank} world={trainer.world_size} "
      f"env_rank={os.environ['RANK']} node={trainer.node_rank} cluster={cluster} "
      f"steps={trainer.global_step} pid={os.getpid()}", flush=True)
# Exit without the interpreter's shutdown: torch 2.13's gloo threads can abort it
# (pytorch/pytorch#190489; README, "Failures, restarts and health").
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
