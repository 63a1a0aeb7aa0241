"""Node reputation across jobs: a host that keeps failing is quarantined, so that no job (and
no restart) spends itself on it again and again.

Every infrastructure failure (orchestrator/failclass.py) is kept against the host it happened
on, with the job it hit. A host with ``after`` such events within ``window`` seconds is
quarantined for ``cooldown`` seconds, doubled for each quarantine before it (capped at
``max_cooldown``), as Horovod's host blacklist does. The thresholds are this home's
(``Policy``, kept in the store; ``orchestrator nodes policy`` shows and sets them).
Quarantined hosts are left out of new jobs and restarts where ``nnodes`` MIN allows. A user
failure never counts, and ``local`` (this machine) is never quarantined: it would refuse
every local job. ``orchestrator nodes`` shows it all; ``orchestrator nodes release HOST``
ends a quarantine early.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from orchestrator.attempt import Failure
from orchestrator.errors import OrchestratorError
from orchestrator.specparts import split_host
from orchestrator.state import FailureCause
from orchestrator.store import Store

SETTING = "quarantine."  # the settings' names in the store: quarantine.after, ...
# The defaults:
QUARANTINE_AFTER = 2  # infrastructure failures (0: never quarantine)...
WINDOW = 3600.0  # ...within this many seconds
FIRST_COOLDOWN = 600.0  # the first quarantine, doubled for each one before it
MAX_COOLDOWN = 86400.0


@dataclass(frozen=True)
class Policy:
    after: int = QUARANTINE_AFTER
    window: float = WINDOW
    cooldown: float = FIRST_COOLDOWN
    max_cooldown: float = MAX_COOLDOWN

    def check(self) -> Policy:
        if type(self.after) is not int or self.after < 0:
            raise OrchestratorError(f"quarantine after: must be a whole number of at least 0 "
                                    f"(got {self.after!r})")
        for name in ("window", "cooldown", "max_cooldown"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not 0 < value < 10**9:
                raise OrchestratorError(f"quarantine {name}: must be a number of seconds above "
                                        f"0 (got {value!r})")
        return self


def policy(store: Store) -> Policy:
    """This home's quarantine policy (the defaults, where nothing was set)."""
    stored = store.settings(SETTING)
    values = {}
    for f in fields(Policy):
        raw = stored.get(SETTING + f.name)
        if raw is not None:
            values[f.name] = json.loads(raw)
    try:
        return Policy(**values).check()
    except OrchestratorError:
        return Policy()  # a store written by hand: the defaults rather than no verdict


def set_policy(store: Store, **changes: Any) -> Policy:
    """Change some of the policy's values (checked first); returns the policy now."""
    unknown = set(changes) - {f.name for f in fields(Policy)}
    if unknown:
        raise OrchestratorError(f"quarantine: no setting {', '.join(sorted(unknown))}")
    new = replace(policy(store), **changes).check()
    store.set_settings({SETTING + k: json.dumps(v) for k, v in asdict(new).items()})
    return new


def host_key(spec_host: str) -> str | None:
    """The host as reputations know it (the hostname: users and ports differ between specs),
    or None for ``local``."""
    if spec_host == "local":
        return None
    try:
        return split_host(spec_host)[1]
    except ValueError:
        return spec_host


def cooldown(level: int, rules: Policy = Policy()) -> float:
    """Seconds of quarantine number ``level`` (1, 2, ...)."""
    return min(rules.max_cooldown, rules.cooldown * 2 ** min(level - 1, 64))


def record(store: Store, spec_host: str, job_id: str, kind: str, detail: str,
           now: float | None = None) -> dict[str, Any] | None:
    """Keep an infrastructure failure against the host; quarantine it when that makes the
    policy's ``after`` within its ``window`` since its last quarantine. Returns the new
    quarantine, or None."""
    host = host_key(spec_host)
    if host is None:
        return None
    now = time.time() if now is None else now
    store.add_host_event(host, job_id, kind, detail, at=now)
    last = store.quarantines().get(host)
    if last is not None and last["until"] > now:
        return None  # in quarantine already
    rules = policy(store)
    if rules.after == 0:
        return None
    since = max(now - rules.window, last["until"] if last is not None else 0.0)
    events = store.host_events(since, host)
    if len(events) < rules.after:
        return None
    level = (last["level"] + 1) if last is not None else 1
    until = now + cooldown(level, rules)
    reason = (f"{len(events)} infrastructure failures within {rules.window / 60:g} min "
              f"(last: {kind} in job {job_id}: {detail[:200]})")
    store.set_quarantine(host, now, until, level, reason)
    return {"host": host, "until": until, "level": level, "reason": reason}


def count_failure(store: Store, job_id: str, host: str | None,
                  failure: Failure) -> dict[str, Any] | None:
    """An infrastructure failure counts against the node it happened on (``host``), across
    jobs; a controller that was gone is nobody's fault. The hold, when it quarantines the
    host."""
    if (failure.failure_class != "infrastructure" or host is None
            or failure.cause == FailureCause.CONTROLLER_LOST):
        return None
    # At the failure's own time: a controller that dies while the attempt is stopped decides
    # it again after taking over, and counted it twice (a host quarantined too soon).
    return record(store, host, job_id, failure.cause.value, failure.evidence or failure.message,
                  failure.detected_at or failure.at)


def quarantined(store: Store, now: float | None = None) -> dict[str, dict[str, Any]]:
    """Hosts in quarantine now: host -> its quarantine."""
    now = time.time() if now is None else now
    return {h: q for h, q in store.quarantines().items() if q["until"] > now}
