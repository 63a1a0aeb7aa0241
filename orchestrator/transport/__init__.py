"""Ways of reaching a node's agent (see base.NodeConnection), and the default choice."""

from __future__ import annotations

from orchestrator.spec import JobSpec, NodeSpec
from orchestrator.transport.base import NodeConnection


def default_connect(node: NodeSpec, spec: JobSpec) -> NodeConnection:
    """The transport for a node: a local subprocess, or an SSH session."""
    if node.is_local:
        from orchestrator.transport.local import LocalConnection

        return LocalConnection(node.host)
    from orchestrator.transport.ssh import SSHConnection  # paramiko only when needed

    return SSHConnection(node, spec)
