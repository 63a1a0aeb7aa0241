"""``orchestrator init``: a commented starter spec that validates, for this machine, SSH
machines or a Slurm cluster; a newcomer edits the lines marked EDIT and submits it. Each
starter is tested to validate as written (tests/unit/test_starters.py)."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.errors import SpecError

_COMMON = """\
nproc_per_node: {nproc}        # workers per node (torchrun's --nproc-per-node): N, gpu, auto
command: [python3, train.py]   # EDIT: every worker's argv, as after torchrun; quote numbers: "3"
workdir: {workdir}             # where workers start (relative paths: to this file)
max_restarts: 3                # whole-job restarts on a failure (torchrun's --max-restarts)
# env: {{WANDB_PROJECT: demo}}   # more variables for the workers; secrets: submit --env KEY
# rendezvous: {{backend: c10d}}  # static (default): ranks handed out; c10d: torchrun's own
# health: {{hang_timeout: 1800}} # seconds without output or heartbeat() before a job is HUNG
# total_steps: 10000           # percent and ETA in status (or the script's heartbeat(total_steps=))
"""

STARTERS = {
    "local": """\
# A job on this machine, without SSH: `orchestrator submit {file} --follow`.
# All fields: docs/reference/spec.md, or jobspecs/jobspec.schema.json for your editor.
name: {name}                   # job ids are <name>-<random>: [a-z0-9-]
nodes:
  - host: local                # this machine; add a second "- host: local" to rehearse two nodes
""" + _COMMON,
    "ssh": """\
# A job over SSH: `orchestrator check {file}` first (reaches every node, checks host keys,
# the master port and versions), then `orchestrator submit {file} --follow`.
# Host keys must be in ~/.ssh/known_hosts (ssh to each once), and ~/.ssh/config is read.
name: {name}
nodes:                         # EDIT: your machines; node 0 hosts the rendezvous
  - host: user@node0.example.com
  - host: user@node1.example.com
# hostfile: hosts              # or DeepSpeed's hostfile ("host slots=N" lines) instead of nodes
ssh:
  connect_timeout: 10
  # identity_file: ~/.ssh/id_ed25519
python: python3                # the nodes' interpreter for the agent (stdlib only)
# sync: .                      # ship this directory to every node (git-tracked files)
""" + _COMMON,
    "slurm": """\
# A job on a Slurm cluster: `orchestrator submit {file} --follow` allocates the nodes
# (salloc), or uses the allocation it runs in (inside sbatch or salloc).
name: {name}
slurm:
  nodes: 2                     # EDIT: nodes to allocate
  # partition: gpu
  # time: "04:00:00"
  # gres: "gpu:8"
python: python3                # EDIT: the interpreter on the nodes (a shared venv's path)
""" + _COMMON,
}


def starter(kind: str, file: str) -> str:
    """The starter spec of ``kind`` (local, ssh, slurm) for a file named ``file``."""
    if kind not in STARTERS:
        raise SpecError("init", f"no starter {kind!r}; one of {', '.join(STARTERS)}")
    stem = Path(file).stem.lower()
    name = "".join(c if c.isalnum() else "-" for c in stem).strip("-")[:40] or "job"
    return STARTERS[kind].format(
        file=file, name=name, nproc="gpu" if kind != "local" else 2,
        workdir="." if kind == "local" else os.path.abspath(os.path.dirname(file) or "."))


def write(kind: str, file: str, force: bool = False) -> Path:
    """Write the starter to ``file`` (0644), never over an existing file unless ``force``."""
    path = Path(file)
    text = starter(kind, file)
    try:
        with open(path, "w" if force else "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise SpecError("init", f"{file} exists; pass --force to replace it") from None
    except OSError as exc:
        raise SpecError("init", f"cannot write {file}: {exc.strerror}") from None
    return path
