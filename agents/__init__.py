"""The node agent: a thin, obedient supervisor of one job's workers on one node.

Stdlib only, never imports torch, and shipped by the controller over the channel itself
(``orchestrator.transport.base.BOOTSTRAP`` sends every module of ``MODULES`` to ``python3
-I -c``), so a node needs nothing but ``python3``. One program, three roles:

- ``relay`` (agents/relay.py): what a channel runs; joins the channel to the job's agent
  through its Unix socket, starting the agent first when asked to.
- ``holder`` (agents/holder.py): on Slurm, the step each node's agent lives in.
- ``agent`` (agents/agent.py): the daemon that owns the workers: ``outbox`` (numbering,
  spooling, replay), ``workers`` (their world, start, output, exit), ``standby`` (warm
  restarts), ``checkpoints`` (the node's checkpoint memory), ``processes`` (no
  orphans), ``cache`` (synced trees, blobs, setup), ``stacks``, ``netinfo``, ``paths``.

The protocol between controller and agent is ``agents/protocol.py`` (what nodes say) and
``agents/commands.py`` (what they are told); the files the agent
puts on workers' PYTHONPATH are ``agents/shims/``.
"""

from __future__ import annotations

import os

#: What is shipped to a node, in this order (packages before their modules).
MODULES = ("agents", "agents.fields", "agents.protocol", "agents.commandbase",
           "agents.checkpointcommands", "agents.commands", "agents.paths",
           "agents.text",
           "agents.netinfo", "agents.containment", "agents.processes", "agents.outbox",
           "agents.leases",
           "agents.cache", "agents.setup", "agents.gpucheck", "agents.netcheck",
           "agents.rankfiles", "agents.shims",
           "agents.shims.sitecustomize", "agents.shims.orchestrator_worker",
           "agents.shims.orchestrator_checkpoint_format",
           "agents.shims.orchestrator_checkpoint_slots",
           "agents.shims.orchestrator_checkpoint_inflight",
           "agents.shims.orchestrator_checkpoint", "agents.transfers", "agents.holds",
           "agents.disk",
           "agents.replicawire", "agents.replicas",
           "agents.storewake", "agents.pulls", "agents.borrows", "agents.memshare", "agents.pages",
           "agents.stride",
           "agents.checkpoints",
           "agents.shims.standby_boot", "agents.workers", "agents.standby", "agents.stacks",
           "agents.ops", "agents.preemption", "agents.agent", "agents.daemon", "agents.holder",
           "agents.relay", "agents.main")


#: Modules the agent never imports, only writes out for workers (agents/shims): shipped as
#: source alone (their code objects were 4% of what every node's login carries).
TEXT_ONLY = frozenset(f"agents.shims.{n}" for n in (
    "sitecustomize", "orchestrator_worker", "orchestrator_checkpoint",
    "orchestrator_checkpoint_slots", "orchestrator_checkpoint_inflight", "standby_boot"))


def source(name: str) -> str:
    """The text of one of ``MODULES``: from what was shipped (the bootstrap keeps it as
    ``__shipped__``), else from the installed file."""
    shipped = globals().get("__shipped__")
    if shipped is not None:
        return shipped[name].decode("utf-8")
    parts = name.split(".")[1:]
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, *parts)
    path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
    with open(path, encoding="utf-8") as f:
        return f.read()
