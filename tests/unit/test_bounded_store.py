"""The store is bounded in time: samples thin out as they age (and the thinning done a bit
at a time comes to the same as done at once), a job keeps at most MAX_SAMPLES, ended jobs
go after the retention, and an ended job keeps no secret."""

from __future__ import annotations

import json
import math

import pytest

from orchestrator import retention
from orchestrator import store as store_module
from orchestrator.state import JobState
from orchestrator.store import SAMPLE_BANDS, Store

HOUR, DAY = 3600.0, 86400.0


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "home")
    s.create_job("week-000001", "week", "{}", str(tmp_path), 0, ["a"])
    s.start_attempt("week-000001", 1, "a", 1, 2, [(0, 0, 0), (1, 0, 1)])
    yield s
    s.close()


def fill(store: Store, start: float, end: float, every: float = 15.0) -> None:
    at, rows = start, []
    while at < end:
        rows += [(r, int(at), at, {"loss": 1.0}) for r in (0, 1)]
        at += every
    store.record_progress("week-000001", 1, {}, rows)


def ages(store: Store, now: float) -> list[float]:
    return [now - at for _, _, _, at, _ in store.samples("week-000001", limit=10 ** 7)]


def test_samples_thin_out_as_they_age(store):
    now = 10 * DAY
    fill(store, now - 3 * DAY, now)  # three days, a sample per rank every 15 s
    before = len(ages(store, now))
    store.compact_samples("week-000001", now)
    kept = ages(store, now)
    assert len(kept) < before / 10, (len(kept), before)
    recent = [a for a in kept if a <= HOUR]
    assert len(recent) == 2 * 240  # the last hour: every one
    for (age, width), (older, _) in zip(SAMPLE_BANDS, SAMPLE_BANDS[1:] + ((1e18, 0),),
                                        strict=True):
        band = [a for a in kept if age <= a < older]
        # One per rank per bucket (a bucket at each edge of the band may hold two).
        span = max(0.0, min(older, 3 * DAY) - age)
        assert len(band) <= 2 * (math.ceil(span / width) + 2), (age, len(band))


def test_thinning_a_bit_at_a_time_comes_to_the_same_as_at_once(tmp_path, store):
    start = 10 * DAY
    fill(store, start - 2 * DAY, start)
    again = Store(tmp_path / "other")
    again.create_job("week-000001", "week", "{}", str(tmp_path), 0, ["a"])
    again.start_attempt("week-000001", 1, "a", 1, 2, [(0, 0, 0), (1, 0, 1)])
    fill(again, start - 2 * DAY, start)
    store.compact_samples("week-000001", start)
    again.compact_samples("week-000001", start)
    since = start
    for step in range(1, 13):  # twelve hours of a controller's compactions, each 5 min
        now = start + step * HOUR
        fill(store, now - HOUR, now)
        fill(again, now - HOUR, now)
        for k in range(12):
            t = now - HOUR + (k + 1) * 300
            store.compact_samples("week-000001", t, since)
            since = t
    again.compact_samples("week-000001", start + 12 * HOUR)  # all at once, at the end
    a, b = ages(store, start + 12 * HOUR), ages(again, start + 12 * HOUR)
    assert abs(len(a) - len(b)) <= len(b) * 0.02, (len(a), len(b))
    again.close()


def test_a_job_keeps_at_most_max_samples_the_oldest_go(store, monkeypatch):
    monkeypatch.setattr(store_module, "MAX_SAMPLES", 100)
    fill(store, 0, 1000, every=1.0)
    store.compact_samples("week-000001", 1000.0)
    kept = store.samples("week-000001", limit=10 ** 6)
    assert len(kept) == 100 and kept[0][3] == 950.0 and kept[-1][3] == 999.0


def test_prune_removes_ended_jobs_past_the_retention_and_nothing_running(tmp_path):
    store = Store(tmp_path / "home")
    for job_id in ("old-000001", "new-000001", "run-000001"):
        store.create_job(job_id, job_id[:3], "{}", str(tmp_path), 0, ["a"])
        (store.job_dir(job_id) / "logs").mkdir()
    for job_id, ended in (("old-000001", 1.0), ("new-000001", None)):
        store.set_state(job_id, JobState.CANCELLED, **({"ended_at": ended} if ended else {}))
    store.record_progress("old-000001", 1, {}, [(0, 1, 1.0, {})])
    assert retention.prune(store, 3600, dry_run=True) == ["old-000001"]
    assert store.get_job("old-000001") and store.job_dir("old-000001").exists()
    assert retention.prune(store) == ["old-000001"]  # the default retention: 30 days
    assert [j.job_id for j in store.list_jobs()] == ["new-000001", "run-000001"]
    assert not store.job_dir("old-000001").exists() and store.samples("old-000001") == []
    retention.set_policy(store, None)
    assert retention.policy(store) is None and retention.prune(store) == []
    assert retention.prune(store, 0) == ["new-000001"]  # never a running job
    with pytest.raises(Exception, match="positive"):
        retention.set_policy(store, 0)


def test_an_ended_job_keeps_no_secret(tmp_path):
    store = Store(tmp_path / "home")
    spec = {"name": "s", "env": {"WANDB_API_KEY": "sekrit-value", "LR": "0.1"},
            "notify": [{"url": "https://hooks.example/T0/sekrit-hook", "on": ["failed"]}]}
    store.create_job("sec-000001", "s", json.dumps(spec), str(tmp_path), 0, ["a"],
                     secret="agent-sekrit", world={"env": {"AWS_SECRET": "sekrit-env"}})
    store.set_state("sec-000001", JobState.FAILED)
    job = store.get_job("sec-000001")
    assert job.secret is None and store.world("sec-000001") is None
    kept = json.loads(job.spec_json)
    assert kept["env"] == {"WANDB_API_KEY": "***", "LR": "***"}
    assert kept["notify"][0]["url"] == store_module.REDACTED_URL
    assert "sekrit" not in job.spec_json


def test_opening_an_existing_store_writes_nothing(tmp_path):
    """A reader (status, the dashboard) opens the store on a full disk too: opening one
    that exists may not write (the auto_vacuum pragma, for one, writes the header)."""
    first = Store(tmp_path / "home")
    first.create_job("quiet-000001", "quiet", "{}", str(tmp_path), 0, ["a"])
    first.close()  # the last connection checkpoints the WAL into state.db and removes it
    db = tmp_path / "home" / "state.db"
    before = db.read_bytes()
    reader = Store(tmp_path / "home")
    wal = tmp_path / "home" / "state.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    assert reader._db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
    reader.close()
    assert db.read_bytes() == before
