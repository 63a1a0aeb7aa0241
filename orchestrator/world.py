"""The submitting user's world: the environment, umask and resource limits that workers
start from.

A script run under ``torchrun`` sees the environment, umask and limits of the shell that ran
torchrun. Ours must see the same, not the controller's: the controller hardens itself
(``PYTHONSAFEPATH``, its own ``PYTHONPATH``, umask 077, a private working directory, the
open-files limit raised to the hard one), and none of that may reach a worker. So ``submit``
captures the caller's world once, the store keeps it with the job (in ``state.db``, 0600,
like ``env:`` secrets; never printed), and a controller, also one started later by
``resume`` from another shell, starts every local relay and every Slurm step in it (srun
passes its soft limits on to the step, as ``srun torchrun`` typed in that shell would). An
SSH node's agent has the login environment and limits of its user instead, as ``ssh node
torchrun ...`` would. Pure: no I/O beyond reading and setting our own process's.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: The limits a controller raises for itself (orchestrator/controller.py): their soft values
#: are kept with the world, and what starts an agent gets them back.
RAISED_LIMITS = ("RLIMIT_NOFILE",)


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
    soft_limits: Mapping[str, int] = field(default_factory=dict)  # of RAISED_LIMITS

    @classmethod
    def capture(cls) -> UserWorld:
        """The calling process's world, as ``torchrun`` started from it would pass it on."""
        return cls(dict(os.environ), current_umask(),
                   {name: resource.getrlimit(getattr(resource, name))[0]
                    for name in RAISED_LIMITS})

    def to_dict(self) -> dict[str, Any]:
        return {"env": dict(self.env), "umask": self.umask,
                "soft_limits": dict(self.soft_limits)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UserWorld:
        env = data.get("env") or {}
        limits = data.get("soft_limits") or {}  # none kept by an older version
        return cls({str(k): str(v) for k, v in env.items()}, int(data.get("umask", 0o022)),
                   {str(k): int(v) for k, v in limits.items() if k in RAISED_LIMITS})

    def restore_limits(self) -> Callable[[], None] | None:
        """A ``preexec_fn`` that gives a child the submitter's soft limits back where this
        process has others (a controller raised them), within this process's hard limits;
        None where nothing differs (no preexec_fn: the fast spawn stays)."""
        changes = []
        for name, soft in self.soft_limits.items():
            which = getattr(resource, name)
            now, hard = resource.getrlimit(which)
            if hard != resource.RLIM_INFINITY and (soft == resource.RLIM_INFINITY
                                                   or soft > hard):
                soft = hard
            if soft != now:
                changes.append((which, (soft, hard)))
        if not changes:
            return None

        def restore() -> None:  # in the child, between fork and exec: nothing but the calls
            for which, limits in changes:
                resource.setrlimit(which, limits)
        return restore
