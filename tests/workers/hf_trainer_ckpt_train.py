"""The Hugging Face Trainer on CPU (a tiny torch.nn model built here: no download, no
tokenizer, no network) that checkpoints every step through
``orchestrator.checkpoint_hf.OrchestratorCheckpointCallback`` and resumes through its
``resume(trainer)``. Deterministic: the Trainer's seeded sampler, dropout (torch's RNG), AdamW
with a linear schedule; each must come back for the final state to equal that of a run that
never failed.

Env: CRASH_AT / CRASH_RANK: in the first attempt, that rank SIGKILLs itself right after the save
of that global step; OUT: a directory where each rank writes ``resumed-<attempt>-<rank>`` (the
global step it resumed at, 0 for a fresh start) and ``final-<rank>.pt``. 48 samples, batch 2
per rank, 2 epochs: 12 steps on 4 ranks.
"""
import os
import signal
import sys

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from orchestrator.checkpoint_hf import OrchestratorCheckpointCallback


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(16, 1))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Marks(TrainerCallback):
    """Where each rank starts; the crash right after the checkpoint callback's save."""

    def on_train_begin(self, args, state, control, **kwargs):
        with open(os.path.join(out, f"resumed-{attempt}-{args.process_index}"), "w") as f:
            f.write(str(state.global_step))
        print(f"rank {args.process_index} attempt {attempt} starts after step "
              f"{state.global_step}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        print(f"rank {args.process_index} step {state.global_step} saved", flush=True)
        if attempt == "1" and state.global_step == int(os.environ.get("CRASH_AT", "-1")) and \
                args.process_index == int(os.environ.get("CRASH_RANK", "1")):
            os.kill(os.getpid(), signal.SIGKILL)


attempt, out = os.environ["ORCHESTRATOR_ATTEMPT"], os.environ["OUT"]
torch.manual_seed(0)
model = Tiny()
args = TrainingArguments(
    output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=2, num_train_epochs=2,
    learning_rate=0.01, lr_scheduler_type="linear", logging_steps=5, save_strategy="no",
    report_to=[], use_cpu=True, disable_tqdm=True, remove_unused_columns=False, seed=0)
checkpoints = OrchestratorCheckpointCallback(every_n_steps=1)
trainer = Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[checkpoints, Marks()])
trainer.train(resume_from_checkpoint=checkpoints.resume(trainer))

rank = args.process_index
torch.save({"model": model.state_dict(), "lr": trainer.lr_scheduler.get_last_lr(),
            "rng": torch.rand(4), "global_step": trainer.state.global_step,
            "losses": [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e],
            "resume_dir_left": checkpoints.resume_dir},
           os.path.join(out, f"final-{rank}.pt"))
# Exit without the interpreter's shutdown: torch 2.13's gloo threads can abort it
# (pytorch/pytorch#190489; as tests/workers/accelerate_train.py).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
