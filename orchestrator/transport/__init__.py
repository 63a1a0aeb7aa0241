"""Ways of reaching a node's agent (see base.NodeConnection), and the default choice."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

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


class _Deferred(types.ModuleType):
    """A module imported on first use of one of its names: it stands in ``sys.modules``
    until then (``importlib.util.LazyLoader`` loads on the import statement itself here)."""

    def __getattr__(self, attr: str) -> Any:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attr)


def _defer_import(name: str) -> None:
    """Import ``name`` when one of its names is first used, not when it is imported. For
    paramiko's ``import invoke`` (paramiko.config, for a ``Match exec`` line of
    ~/.ssh/config): half of paramiko's import, 40-60 ms on the way from every submit to its
    first login, for a line hardly anyone writes (which still works: invoke loads then).
    Nothing where the module is missing (paramiko then knows it has none) or imported."""
    if name in sys.modules:
        return
    try:
        if importlib.util.find_spec(name) is None:
            return
    except (ImportError, ValueError):
        return
    sys.modules[name] = _Deferred(name)


# paramiko is imported only from this package's modules (ssh.py, hosts.py): this runs first.
_defer_import("invoke")
