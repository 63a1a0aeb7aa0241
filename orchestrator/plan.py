"""From a job spec to a launch plan: node ranks, master address and port, each worker's env.

Pure: no I/O, no clock, no randomness, so ``submit --dry-run`` prints exactly what would run
and the restart policy can recompute a plan for any attempt on any set of nodes.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from agents import commands as C
from orchestrator import placeholders
from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.sync import remote_tree_dir

ROLE_NAME = "default"
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's --signals-to-handle default
# torchrun (c10d mode) starts each tee'd worker line with this; ${rank} is the global rank.
TORCHRUN_LINE_PREFIX = "[orc-rank ${rank}]:"
TORCHRUN_LINE_RE = re.compile(r"^\[orc-rank (\d+)\]:\s?")


#: One process an agent starts (``rank`` None when torch's rendezvous assigns ranks): the
#: worker of a ``start`` command as it is sent.
WorkerPlan = C.WorkerStart


@dataclass(frozen=True)
class NodePlan:
    """What one node runs in one attempt."""

    node_index: int  # position in spec.nodes
    node_rank: int  # GROUP_RANK of this attempt
    host: str
    workdir: str
    env: dict[str, str]  # common to the node's workers
    workers: tuple[WorkerPlan, ...]
    # torchrun's defaults for the workers it starts: set unless the node's environment (or
    # env:) has them. Empty where torchrun itself runs (c10d) or nothing stands in for it.
    defaults: dict[str, str] = field(default_factory=dict)
    # The master's address when the attempt spans several nodes: the agent then sets
    # GLOO/NCCL_SOCKET_IFNAME to the interface that routes there, unless set.
    route_to: str | None = None
    ranks: int = 0  # the ranks it runs (0: one a worker; torchrun or the node's process: all)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start one attempt of a job."""

    job_id: str
    attempt: int
    restart_count: int
    backend: str
    master_addr: str
    master_port: int | None  # None: picked on node 0 at launch ("auto")
    world_size: int
    nodes: tuple[NodePlan, ...] = field(default_factory=tuple)
    secrets: frozenset[str] = frozenset()  # env names whose values to_dict() masks
    launch: str = "per-rank"  # or "per-node": one process per node owns its ranks

    def owner(self, node_rank: int) -> str:
        """Who runs a node's ranks when no one process is a rank (c10d, per-node)."""
        what = "torchrun" if self.backend == "c10d" else "the node's process"
        return f"{what} on node {node_rank}"

    def to_dict(self) -> dict[str, Any]:
        """The plan as shown by ``submit --dry-run --json``: secret env values masked."""

        def shown(env: dict[str, str]) -> dict[str, str]:
            return {k: ("***" if k in self.secrets else v) for k, v in env.items()}

        return {
            "job_id": self.job_id,
            "attempt": self.attempt,
            "backend": self.backend,
            "launch": self.launch,
            "master_addr": self.master_addr,
            "master_port": self.master_port if self.master_port is not None else "auto",
            "world_size": self.world_size,
            "nodes": [
                {
                    "node_index": n.node_index,
                    "node_rank": n.node_rank,
                    "host": n.host,
                    "workdir": n.workdir,
                    "env": shown(n.env),
                    "defaults": n.defaults,
                    "workers": [{"rank": w.rank, "local_rank": w.local_rank,
                                 "argv": list(w.argv), "env": shown(w.env)}
                                for w in n.workers],
                }
                for n in self.nodes
            ],
        }


def node_address(node: NodeSpec) -> str:
    """The address other nodes use to reach ``node``."""
    if node.address:
        return node.address
    return "127.0.0.1" if node.is_local else node.hostname


def plan_attempt(
    spec: JobSpec,
    job_id: str,
    *,
    attempt: int = 1,
    restart_count: int = 0,
    master_port: int | None = None,
    node_indices: list[int] | None = None,
    spec_dir: str = ".",
    nprocs: dict[int, int] | None = None,
    sync_tree: str | None = None,
) -> LaunchPlan:
    """Plan one attempt on the nodes ``node_indices`` (default: the first ``max_nodes``).

    Node ranks follow the order of ``node_indices``; the first node hosts the master (static)
    or the rendezvous store (c10d). ``nprocs`` gives each node's worker count when
    ``nproc_per_node`` is ``gpu`` or ``auto`` (from what its agent reported; a dry run
    assumes 1); nodes may then differ, and ranks follow the counts.
    """
    if node_indices is None:
        node_indices = list(range(spec.max_nodes))
    if not node_indices:
        raise ValueError("a plan needs at least one node")
    if master_port is None and isinstance(spec.rendezvous.port, int):
        master_port = spec.rendezvous.port
    master = spec.nodes[node_indices[0]]
    master_addr = spec.rendezvous.master_addr or node_address(master)
    counts = {i: (spec.nodes[i].slots or (nprocs or {}).get(i) or
                  (spec.nproc_per_node if isinstance(spec.nproc_per_node, int) else 1))
              for i in node_indices}
    nnodes = len(node_indices)
    world_size = sum(counts.values())
    port_text = str(master_port) if master_port is not None else str(spec.rendezvous.port)

    common = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": port_text,
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": ROLE_NAME,
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": job_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        # torchrun's launcher sets this in its own environment, which its workers inherit.
        "TORCHELASTIC_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS,
        "ORCHESTRATOR_JOB_ID": job_id,
        "ORCHESTRATOR_ATTEMPT": str(attempt),
    }
    per_rank_env = {k for k, v in spec.env.items()
                    if placeholders.names_in(v) & placeholders.PER_RANK}
    nodes = []
    first_rank = 0
    for node_rank, index in enumerate(node_indices):
        node = spec.nodes[index]
        nproc = counts[index]
        values: dict[str, object] = {
            "node_rank": node_rank, "nnodes": nnodes, "job_id": job_id, "attempt": attempt,
            "world_size": world_size, "master_addr": master_addr, "master_port": port_text,
            "node_start_rank": first_rank, "nproc_per_node": nproc}
        user_env = {k: placeholders.expand(v, values) for k, v in spec.env.items()
                    if k not in per_rank_env}
        defaults: dict[str, str] = {}
        if spec.rendezvous.backend == "c10d":
            # torchrun computes ranks and sizes itself; only our own ids pass through, and
            # the prefix that lets the controller file each output line under its rank.
            env = {**user_env, "ORCHESTRATOR_JOB_ID": job_id,
                   "ORCHESTRATOR_ATTEMPT": str(attempt),
                   "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": TORCHRUN_LINE_PREFIX}
            command = tuple(placeholders.expand(a, values) for a in spec.command)
            argv, options = _torchrun(spec, command, job_id, attempt, master_addr, port_text,
                                      node_address(node), nproc, is_host=node_rank == 0)
            workers: tuple[WorkerPlan, ...] = (WorkerPlan(None, 0, argv, options),)
        elif spec.launch == "per-node":
            # One process owns the node's ranks (it starts its workers itself): the job's
            # shape, no rank of its own; nothing of torchrun's stands in for it.
            env = {**user_env, **common, "GROUP_RANK": str(node_rank),
                   "LOCAL_WORLD_SIZE": str(nproc)}
            workers = (WorkerPlan(None, 0, tuple(placeholders.expand(a, values)
                                                 for a in spec.command), {}),)
        else:
            env = {**user_env, **common, "GROUP_RANK": str(node_rank),
                   "LOCAL_WORLD_SIZE": str(nproc)}
            workers = tuple(
                _worker(spec, first_rank + local, local, values, per_rank_env)
                for local in range(nproc)
            )
            defaults = torchrun_defaults(nproc)
        first_rank += nproc
        workdir = spec.workdir
        if node.is_local:
            workdir = os.path.normpath(os.path.join(spec_dir, os.path.expanduser(workdir)))
        elif spec.sync is not None:  # the synced copy, at the workdir's place inside it
            workdir = synced_workdir(spec, spec_dir, sync_tree or "<tree>")
        nodes.append(NodePlan(index, node_rank, node.host, workdir, env, workers, defaults,
                              master_addr if nnodes > 1 else None, nproc))

    return LaunchPlan(job_id, attempt, restart_count, spec.rendezvous.backend, master_addr,
                      master_port, world_size, tuple(nodes), spec.secret_names, spec.launch)


def torchrun_defaults(nproc: int) -> dict[str, str]:
    """What torchrun gives its workers unless its own environment has it: NCCL errors tear
    the process down instead of hanging until the collective timeout, and, with several
    workers on the node, one OpenMP thread each (``torch/distributed/run.py``,
    ``local_elastic_agent._start_workers``)."""
    out = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if nproc > 1:
        out["OMP_NUM_THREADS"] = "1"
    return out


def synced_workdir(spec: JobSpec, spec_dir: str, tree: str) -> str:
    """An SSH node's workdir with ``sync``: the copy, plus the workdir's place in the tree."""
    assert spec.sync is not None
    root = os.path.normpath(os.path.join(spec_dir, os.path.expanduser(spec.sync.path)))
    inside = os.path.relpath(os.path.normpath(os.path.join(spec_dir, spec.workdir)), root)
    if inside == "." or inside.startswith(".."):
        return remote_tree_dir(tree)
    return f"{remote_tree_dir(tree)}/{inside}"


def _worker(spec: JobSpec, rank: int, local: int, node_values: dict[str, object],
            per_rank_env: set[str]) -> WorkerPlan:
    values = {**node_values, "rank": rank, "local_rank": local}
    env = {k: placeholders.expand(spec.env[k], values) for k in per_rank_env}
    env.update({"RANK": str(rank), "LOCAL_RANK": str(local), "ROLE_RANK": str(rank)})
    return WorkerPlan(rank=rank, local_rank=local,
                      argv=tuple(placeholders.expand(a, values) for a in spec.command), env=env)


def _torchrun(spec: JobSpec, command_in: tuple[str, ...], job_id: str, attempt: int,
              master_addr: str, port: str, local_addr: str, nproc: int, *,
              is_host: bool) -> tuple[tuple[str, ...], dict[str, str]]:
    """torchrun's command line and its options. The options travel as ``PET_*`` environment
    variables (torchrun reads every option from ``PET_<NAME>``), never on the command line:
    the rendezvous endpoint and run id are all it takes to reach the job's TCPStore, and
    every local user can read command lines in ``ps``."""
    command = list(command_in)
    python_first = os.path.basename(command[0]).startswith("python")
    # -u: torchrun tees worker lines to its stdout, a pipe, which would hold them until it
    # exits; the flag is torchrun's alone (PYTHONUNBUFFERED would reach its workers).
    launcher = [command[0], "-u", "-m", "torch.distributed.run"] if python_first else [
        spec.python, "-u", "-m", "torch.distributed.run", "--no-python"]
    script = command[1:] if python_first else command
    options = {
        "PET_NNODES": f"{spec.min_nodes}:{spec.max_nodes}",
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": _host_port(master_addr, port),
        "PET_RDZV_ID": f"{job_id}-{attempt}",
        "PET_RDZV_CONF": "is_host=1" if is_host else "is_host=0",
        # The address peers reach this node at; torch would use the hostname, which often
        # resolves to loopback, and rank 0's workers would then host the store unreachably.
        "PET_LOCAL_ADDR": local_addr,
        "PET_MAX_RESTARTS": "0",  # restarts are the orchestrator's, counted once per job
        "PET_TEE": "3",  # workers' lines through torchrun, whole and prefixed with their rank
    }
    return (*launcher, *script), options


def _host_port(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def describe(plan: LaunchPlan) -> str:
    """A human-readable rendering of a plan, for ``submit --dry-run``."""
    lines = [
        f"job {plan.job_id} attempt {plan.attempt}: {len(plan.nodes)} node(s), world size "
        f"{plan.world_size}, backend {plan.backend}, master "
        f"{_host_port(plan.master_addr, str(plan.master_port or 'auto'))}",
    ]
    for n in plan.nodes:
        lines.append(f"  node {n.node_rank} ({n.host}) workdir {n.workdir}")
        for w in n.workers:
            if w.rank is not None:
                lines.append(f"    rank {w.rank} (local {w.local_rank}): {shlex.join(w.argv)}")
            elif plan.backend != "c10d":
                lines.append(f"    node process ({n.env['LOCAL_WORLD_SIZE']} ranks): "
                             f"{shlex.join(w.argv)}")
            else:
                lines.append(f"    torchrun (local {w.local_rank}): {shlex.join(w.argv)}")
                pet = " ".join(f"{k}={v}" for k, v in w.env.items() if k.startswith("PET_"))
                lines.append(f"      torchrun options (environment): {pet}")
    return "\n".join(lines)
