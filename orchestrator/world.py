"""The submitting user's world: the environment and umask that workers start from.

A script run under ``torchrun`` sees the environment and umask of the shell that ran
torchrun. Ours must see the same, not the controller's: the controller hardens itself
(``PYTHONSAFEPATH``, its own ``PYTHONPATH``, umask 077, a private working directory), and
none of that may reach a worker. So ``submit`` captures the caller's world once, the store
keeps it with the job (in ``state.db``, 0600, like ``env:`` secrets; never printed), and a
controller, also one started later by ``resume`` from another shell, starts every local
relay and every Slurm step in it. An SSH node's agent has the login environment of its user
instead, as ``ssh node torchrun ...`` would. Pure: no I/O beyond reading our own process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def current_umask() -> int:
    """This process's umask, read without changing it (Linux 4.7+ shows it in
    /proc/self/status); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@dataclass(frozen=True)
class UserWorld:
    """What a worker inherits from whoever submitted the job."""

    env: Mapping[str, str] = field(default_factory=dict)
    umask: int = 0o022

    @classmethod
    def capture(cls) -> UserWorld:
        """The calling process's world, as ``torchrun`` started from it would pass it on."""
        return cls(dict(os.environ), current_umask())

    def to_dict(self) -> dict[str, Any]:
        return {"env": dict(self.env), "umask": self.umask}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UserWorld:
        env = data.get("env") or {}
        return cls({str(k): str(v) for k, v in env.items()}, int(data.get("umask", 0o022)))
