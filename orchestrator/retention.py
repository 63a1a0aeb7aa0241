"""How long a home keeps what ended jobs leave: their records, samples and logs.

A setting of the home (the store's settings table, like the quarantine policy): 30 days by
default, or ``None`` to keep everything. ``submit`` prunes with it (jobs that ended longer
ago than that go, with their logs), and ``orchestrator prune`` does it on demand, with
``--older-than`` and ``--dry-run``. Running jobs are never pruned. Secrets of an ended job
do not wait for this: they are wiped when it ends (Store.set_state).
"""

from __future__ import annotations

import json
import time

from orchestrator.errors import OrchestratorError
from orchestrator.store import Store

SETTING = "retention"
DEFAULT = 30 * 86400.0  # seconds


def policy(store: Store) -> float | None:
    """Seconds this home keeps ended jobs (None: for ever)."""
    raw = store.settings(SETTING).get(SETTING)
    if raw is None:
        return DEFAULT
    try:
        value = json.loads(raw)
    except ValueError:
        return DEFAULT
    return None if value is None else float(value)


def set_policy(store: Store, seconds: float | None) -> float | None:
    """Keep ended jobs ``seconds`` (None: for ever)."""
    if seconds is not None and not seconds > 0:
        raise OrchestratorError(f"retention: {seconds} is not a positive duration")
    store.set_settings({SETTING: json.dumps(seconds)})
    return seconds


def prune(store: Store, older_than: float | None = None, *, dry_run: bool = False
          ) -> list[str]:
    """Remove jobs that ended more than ``older_than`` seconds ago (default: this home's
    retention; nothing when that is for ever). Their ids, oldest first."""
    keep = policy(store) if older_than is None else older_than
    if keep is None:
        return []
    if not keep >= 0:
        raise OrchestratorError(f"prune: {keep} is not a duration")
    return store.prune(time.time() - keep, dry_run=dry_run)
