"""Ways of reaching a node's agent (see base.NodeConnection), and the default choice."""

from __future__ import annotations

from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.transport.base import NodeConnection
from orchestrator.world import UserWorld


class Connector:
    """The transport for each node: a local subprocess, or an SSH session. Local relays
    start in ``world`` (the submitter's; None: this process's)."""

    def __init__(self, world: UserWorld | None = None):
        self.world = world

    def __call__(self, node: NodeSpec, spec: JobSpec) -> NodeConnection:
        if node.is_local:
            from orchestrator.transport.local import LocalConnection

            return LocalConnection(node.host, self.world)
        from orchestrator.transport.ssh import SSHConnection  # paramiko only when needed

        return SSHConnection(node, spec)


#: In the calling process's own world (``check``, tests).
default_connect = Connector()
