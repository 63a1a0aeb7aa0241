"""The worker contract, as a test sees it: what may differ between a worker's world under
``torchrun`` and under the orchestrator (docs/reference/worker-environment.md, "Workers see
torchrun's world"), and a comparison that names everything else. tests/workers/world.py
writes the worlds.

Adding a variable to workers means adding it here and to that page (a test checks that
every name below is on it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.helpers import ROOT

# torchrun's own variables: in both worlds, with our values (ids, ports, paths, stores).
TORCHRUN_VALUES = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
})
# Ours alone, each documented in docs/reference/worker-environment.md with its reason.
OURS = frozenset({
    "ORCHESTRATOR_JOB_ID", "ORCHESTRATOR_ATTEMPT", "ORCHESTRATOR_AGENT_TOKEN",
    "ORCHESTRATOR_HEARTBEAT_FILE", "ORCHESTRATOR_STACK_DIR", "ORCHESTRATOR_SAMPLED",
    "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "ORCHESTRATOR_CHECKPOINT_MEMORY", "ORCHESTRATOR_CHECKPOINT_MEMORY_BYTES",
    "ORCHESTRATOR_CHECKPOINT_PERSIST_EVERY",
})
# Ours too, on jobs of several nodes only (tests here compare one node with torchrun's).
OURS_MULTI_NODE = frozenset({"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"})
# Ours too, with checkpoint.dir or a checkpoint to resume (tests/integration/test_checkpoints.py).
OURS_CHECKPOINTS = frozenset({"ORCHESTRATOR_CHECKPOINT_DIR", "ORCHESTRATOR_CHECKPOINT_STEP"})
# Differ between any two sessions, whoever starts them.
PER_SESSION = frozenset({"SSH_CLIENT", "SSH_CONNECTION"})
# What the shell that typed the reference command (``cd DIR && torchrun ...``) adds of its
# own: not part of the contract either way.
SHELL_ARTIFACTS = frozenset({"_", "SHLVL", "OLDPWD"})
# PYTHONPATH: the user's entries, then our shim directory (sitecustomize and
# orchestrator_worker), <agent dir>/pythonpath.


def load_worlds(directory: Path) -> dict[int, dict]:
    return {int(p.stem.split("-", 1)[1]): json.loads(p.read_text())
            for p in sorted(directory.glob("world-*.json"))}


def shim_dir(world: dict) -> str:
    return os.path.join(os.path.dirname(world["env"]["ORCHESTRATOR_STACK_DIR"]), "pythonpath")


# On Slurm: the step of an allocation that the orchestrator requested (salloc --no-shell,
# then srun --jobid) lacks what salloc puts in the shell it starts, and has two of srun's
# step variables that a plain ``srun torchrun`` has not (docs/guides/slurm.md).
SLURM_ALLOCATION_SHELL = frozenset({
    "SLURM_CLUSTER_NAME", "SLURM_JOB_CPUS_PER_NODE", "SLURM_JOB_NUM_NODES",
    "SLURM_SUBMIT_DIR", "SLURM_SUBMIT_HOST"})
SLURM_STEP_OF_ALLOCATION = frozenset({"SLURM_DISTRIBUTION",
                                      "SLURM_JOB_CPUS_PER_NODE_PACK_GROUP_0"})


def differences(reference: dict, ours: dict, *, also_differ: frozenset[str] = frozenset(),
                may_lack: frozenset[str] = frozenset(), may_add: frozenset[str] = frozenset()
                ) -> list[str]:
    """What in ``ours`` (a worker's world under the orchestrator) differs from
    ``reference`` (the same rank under torchrun) beyond the documented differences;
    ``also_differ``, ``may_lack`` and ``may_add`` name more for one transport."""
    problems = []
    ref, env = reference["env"], ours["env"]
    shim = shim_dir(ours)
    for key in sorted(set(ref) | set(env)):
        if key in OURS or key in SHELL_ARTIFACTS:
            continue
        if key == "PYTHONPATH":
            want = os.pathsep.join(p for p in (ref.get(key), shim) if p)
            if env.get(key) != want:
                problems.append(f"PYTHONPATH {env.get(key)!r}, expected {want!r}")
            continue
        if key not in env:
            if key not in may_lack:
                problems.append(f"{key} missing (torchrun's worker has {ref[key]!r})")
        elif key not in ref:
            if key in may_add:
                continue
            problems.append(f"{key}={env[key]!r} is ours alone and not documented")
        elif ref[key] != env[key] and key not in TORCHRUN_VALUES | PER_SESSION | also_differ:
            problems.append(f"{key}={env[key]!r}, torchrun's worker has {ref[key]!r}")
    path = [p for p in ours["sys_path"] if p != shim]
    if path != reference["sys_path"]:
        problems.append(f"sys.path {ours['sys_path']}, torchrun's {reference['sys_path']}")
    for key in ("cwd", "umask", "nice", "rlimits", "signals", "flags", "executable"):
        if ours.get(key) != reference.get(key):
            problems.append(f"{key} {ours.get(key)!r}, torchrun's {reference.get(key)!r}")
    return problems


def documented_in_readme() -> list[str]:
    """Names above that the documentation's worker environment page does not mention."""
    section = (ROOT / "docs" / "reference" / "worker-environment.md").read_text()
    names = OURS | OURS_MULTI_NODE | OURS_CHECKPOINTS | {
        "PYTHONPATH", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_SIGNALS_TO_HANDLE"}
    return sorted(n for n in names if f"`{n}`" not in section)
