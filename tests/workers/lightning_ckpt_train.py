"""PyTorch Lightning DDP on CPU (gloo) checkpointed every step by
``orchestrator.checkpoint_lightning.OrchestratorCheckpoint``, resumed by it at ``fit``.

Deterministic: the batch of global data index i on rank r comes from seed ``i * world + r``,
served by a resumable iterable (``state_dict``/``load_state_dict``), 4 batches an epoch, 3
epochs; SGD with momentum and a StepLR stepped every step, so a step lost, redone or fed
other data changes the final weights.

Env: OUT (each rank writes ``final-<rank>.pt``); CRASH_AT / CRASH_RANK: in the first attempt
(``ORCHESTRATOR_ATTEMPT``, else ``ATTEMPT``, else 1), that rank SIGKILLs itself right
after the save of that step (once every rank has saved it). Prints, per rank,
``LCKPT rank=R attempt=A resumed=S`` at the start of training and
``LCKPT rank=R attempt=A step=S epoch=E batch=B data=I`` per step.
"""
import os
import signal
import sys

import lightning as L
import torch

from orchestrator.checkpoint_lightning import OrchestratorCheckpoint

PER_EPOCH, EPOCHS = 4, 3
ATTEMPT = os.environ.get("ORCHESTRATOR_ATTEMPT") or os.environ.get("ATTEMPT", "1")
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class Batches:
    """This rank's batches; its state is how many it has served (Lightning keeps it in the
    fit loop's state and gives it back before iterating again)."""

    def __init__(self) -> None:
        self.served = 0

    def __len__(self) -> int:
        return PER_EPOCH

    def __iter__(self):
        for _ in range(self.served % PER_EPOCH, PER_EPOCH):
            index = self.served
            g = torch.Generator().manual_seed(index * WORLD + RANK)
            self.served += 1
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            yield torch.tensor(index), x, y

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.served = state["served"]


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(16, 4)

    def say(self, text: str) -> None:
        # One write: under torchrun the ranks share a pipe, and print() may write the line
        # and its newline apart.
        os.write(1, f"LCKPT rank={RANK} attempt={ATTEMPT} {text}\n".encode())

    def on_train_start(self) -> None:
        self.say(f"resumed={self.trainer.global_step}")

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        self.say(f"step={self.trainer.global_step + 1} epoch={self.current_epoch} "
                 f"batch={batch_idx} data={int(index)}")
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # After the callbacks' hooks: this step's save is made, on this rank, and once past
        # the barrier on every rank (a survivor stopped before its save would resume older).
        if ATTEMPT == "1" and self.trainer.global_step == int(os.environ.get("CRASH_AT", "-1")):
            torch.distributed.barrier()
            if RANK == int(os.environ.get("CRASH_RANK", "1")):
                self.say(f"killed after the save of step {self.trainer.global_step}")
                os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
trainer = L.Trainer(strategy="ddp", accelerator="cpu", num_nodes=nodes, devices=WORLD // nodes,
                    max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    use_distributed_sampler=False, callbacks=[OrchestratorCheckpoint()])
model = Tiny()
trainer.fit(model, Batches())
torch.save(model.layer.state_dict(), os.path.join(os.environ["OUT"], f"final-{RANK}.pt"))
model.say(f"done at step {trainer.global_step}")
# Exit without the interpreter's shutdown: torch 2.13's gloo threads can abort it
# (pytorch/pytorch#190489; README, "Failures, restarts and health").
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
