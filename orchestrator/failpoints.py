"""Faults on purpose, for the tests and the soak benchmark: a controller started with
``ORCHESTRATOR_FAILPOINTS=turn@5x1`` raises :class:`InjectedFault` at its loop's first turn
after 5 s, once for the job (``x0``: at every controller's 5th second, for ever). Entries are
separated by commas; the count is kept in the job's directory, so that it holds across the
controllers that replace one another. Unset (always, outside tests), ``hit`` is one lookup.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

_SPEC = re.compile(r"^(?P<name>[a-z_]+)@(?P<after>[0-9.]+)(?:x(?P<times>[0-9]+))?$")


class InjectedFault(RuntimeError):
    """A fault asked for by ORCHESTRATOR_FAILPOINTS."""


_armed: dict[str, tuple[float, int]] = {}  # name -> (monotonic time it fires, times or 0)
_where: Path | None = None


def arm(job_dir: Path) -> None:
    """Read ORCHESTRATOR_FAILPOINTS for this controller of the job in ``job_dir``."""
    global _where
    _where = job_dir
    _armed.clear()
    for entry in filter(None, os.environ.get("ORCHESTRATOR_FAILPOINTS", "").split(",")):
        m = _SPEC.match(entry.strip())
        if m:
            _armed[m["name"]] = (time.monotonic() + float(m["after"]), int(m["times"] or 1))


def hit(name: str) -> None:
    """Raise InjectedFault if the failpoint ``name`` is armed, due, and not used up."""
    if name not in _armed or time.monotonic() < _armed[name][0]:
        return
    _, times = _armed.pop(name)
    if times and _where is not None:
        done = sorted(_where.glob(f"failpoint-{name}-*"))
        if len(done) >= times:
            return
        (_where / f"failpoint-{name}-{len(done) + 1}").touch()
    raise InjectedFault(f"failpoint {name} (ORCHESTRATOR_FAILPOINTS)")
