"""Node reputation across jobs: a host that keeps failing is quarantined, so that no job (and
no restart) spends itself on it again and again.

Every infrastructure failure (orchestrator/failclass.py) is kept against the host it happened
on, with the job it hit. A host with ``QUARANTINE_AFTER`` such events within ``WINDOW`` is
quarantined for ``FIRST_COOLDOWN``, doubled for each quarantine before it (capped at
``MAX_COOLDOWN``), as Horovod's host blacklist does. Quarantined hosts are left out of new
jobs and restarts where ``nnodes`` MIN allows. A user failure never counts, and ``local``
(this machine) is never quarantined: it would refuse every local job. ``orchestrator nodes``
shows it all; ``orchestrator nodes release HOST`` ends a quarantine early.
"""

from __future__ import annotations

import time
from typing import Any

from orchestrator.specparts import split_host
from orchestrator.store import Store

QUARANTINE_AFTER = 2  # infrastructure failures...
WINDOW = 3600.0  # ...within this many seconds
FIRST_COOLDOWN = 600.0
MAX_COOLDOWN = 86400.0


def host_key(spec_host: str) -> str | None:
    """The host as reputations know it (the hostname: users and ports differ between specs),
    or None for ``local``."""
    if spec_host == "local":
        return None
    try:
        return split_host(spec_host)[1]
    except ValueError:
        return spec_host


def cooldown(level: int) -> float:
    """Seconds of quarantine number ``level`` (1, 2, ...)."""
    return min(MAX_COOLDOWN, FIRST_COOLDOWN * 2 ** (level - 1))


def record(store: Store, spec_host: str, job_id: str, kind: str, detail: str,
           now: float | None = None) -> dict[str, Any] | None:
    """Keep an infrastructure failure against the host; quarantine it when that makes
    ``QUARANTINE_AFTER`` within ``WINDOW`` since its last quarantine. Returns the new
    quarantine, or None."""
    host = host_key(spec_host)
    if host is None:
        return None
    now = time.time() if now is None else now
    store.add_host_event(host, job_id, kind, detail, at=now)
    last = store.quarantines().get(host)
    if last is not None and last["until"] > now:
        return None  # in quarantine already
    since = max(now - WINDOW, last["until"] if last is not None else 0.0)
    events = store.host_events(since, host)
    if len(events) < QUARANTINE_AFTER:
        return None
    level = (last["level"] + 1) if last is not None else 1
    reason = (f"{len(events)} infrastructure failures within {WINDOW / 60:.0f} min "
              f"(last: {kind} in job {job_id}: {detail[:200]})")
    store.set_quarantine(host, now, now + cooldown(level), level, reason)
    return {"host": host, "until": now + cooldown(level), "level": level, "reason": reason}


def quarantined(store: Store, now: float | None = None) -> dict[str, dict[str, Any]]:
    """Hosts in quarantine now: host -> its quarantine."""
    now = time.time() if now is None else now
    return {h: q for h, q in store.quarantines().items() if q["until"] > now}
