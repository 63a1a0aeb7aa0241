"""Prometheus metrics, read from the state store at each scrape (prometheus-client's custom
collector: nothing is kept between scrapes, so a restarted dashboard reports the same).

Per job, for jobs that run or ended within the last hour (older ones would only add series):

- ``orchestrator_jobs{state}``: how many jobs are in each state (all jobs);
- ``orchestrator_job_restarts_total{job_id,name}``: restarts charged to ``max_restarts``;
- ``orchestrator_job_free_restarts_total{job_id,name}``: restarts not charged (controller lost);
- ``orchestrator_job_infra_restarts_total{job_id,name}``: restarts charged to
  ``restart_policy.max_infra_restarts``;
- ``orchestrator_attempt_failures_total{job_id,name,class}``: failed attempts by failure
  class (user, infrastructure, preempted, hung, unknown: orchestrator/failclass.py);
- ``orchestrator_job_attempt{job_id,name}``: the current attempt;
- ``orchestrator_attempt_duration_seconds{job_id,attempt,outcome}``: each attempt's duration,
  so far for the running one;
- ``orchestrator_node_state{job_id,node,host,state}``: 1 for the node's state, 0 for others;
- ``orchestrator_node_last_heard_age_seconds{job_id,node,host}``;
- ``orchestrator_rank_step{job_id,rank,host}``, ``orchestrator_rank_steps_per_second``,
  ``orchestrator_rank_heartbeat_age_seconds``, ``orchestrator_rank_wait_share`` (share of the
  last 30 s spent waiting in collectives), ``orchestrator_rank_straggler`` (1 when named).

Per host with an infrastructure failure in the last day or a quarantine on record
(orchestrator/reputation.py):

- ``orchestrator_host_quarantined{host}``: 1 while quarantined, else 0;
- ``orchestrator_host_infra_failures_24h{host}``: its infrastructure failures and failed
  health checks in the last 24 hours.

- ``orchestrator_time_lost_seconds_total{job_id,name}``, ``orchestrator_gpu_seconds_lost_total``
  and ``orchestrator_goodput_ratio``: see orchestrator/timelost.py.
- ``orchestrator_job_progress_ratio{job_id,name}`` (step over total steps) and
  ``orchestrator_job_eta_seconds`` (while it runs): see orchestrator/progress.py.
- ``orchestrator_checkpoint_restored_step{job_id,name}``: the checkpoint step the current
  attempt's ranks resumed (docs/guides/checkpoints.md); ``orchestrator_checkpoint_memory_bytes
  {job_id,node,host}`` and ``orchestrator_checkpoint_newest_step{job_id,node,host,where}``
  (``memory``, ``persisted``): what each node's agent holds, as it last said;
  ``orchestrator_checkpoint_block_seconds`` and ``orchestrator_checkpoint_bytes``
  ``{job_id,node,host}``: its newest save; ``orchestrator_checkpoint_restored_ranks
  {job_id,name,source}``: where the current attempt's ranks restored from.

- ``orchestrator_node_drained{job_id,node,host}`` (1 while drained) and
  ``orchestrator_node_notice_deadline_seconds{job_id,node,host,source}`` (the Unix time by
  which a noticed node's workers stop), while the job runs: see orchestrator/drain.py.

The ``_total`` ones are counters; the others are gauges.
"""

from __future__ import annotations

import os
import time
from typing import Any

from orchestrator import drain, progress, timelost
from orchestrator.failclass import FailureClass
from orchestrator.state import AttemptOutcome, JobState, NodeState
from orchestrator.store import JobRecord, Store

RECENT = 3600.0  # seconds an ended job keeps its per-job series


def exposition(home: str | os.PathLike[str] | None = None) -> tuple[bytes, str]:
    """The text exposition of every metric, and its content type."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(home))
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _Collector:
    def __init__(self, home: str | os.PathLike[str] | None):
        self.home = home

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        store = Store(self.home)
        try:
            records = store.list_jobs()
            now = time.time()
            shown = [store.get_job(j.job_id) for j in records
                     if not j.state.is_at_rest() or (j.ended_at or 0) > now - RECENT]
            held = store.quarantines()
            events = store.host_events(now - 86400)
            drains = store.drains()
        finally:
            store.close()

        jobs = GaugeMetricFamily("orchestrator_jobs", "Jobs by state.", labels=["state"])
        counts = {s.value: 0 for s in JobState}
        for j in records:
            counts[j.state.value] += 1
        for state, count in counts.items():
            jobs.add_metric([state], count)
        yield jobs

        quarantined = GaugeMetricFamily("orchestrator_host_quarantined",
                                        "1 while the host is quarantined.", labels=["host"])
        failures = GaugeMetricFamily("orchestrator_host_infra_failures_24h",
                                     "The host's infrastructure failures and failed health "
                                     "checks in the last 24 hours.", labels=["host"])
        for host in sorted(set(held) | {e["host"] for e in events}):
            quarantined.add_metric([host], int(host in held and held[host]["until"] > now))
            failures.add_metric([host], sum(e["host"] == host for e in events))
        yield from (quarantined, failures)

        job_labels = ["job_id", "name"]
        restarts = CounterMetricFamily("orchestrator_job_restarts",
                                       "Restarts charged to max_restarts.", labels=job_labels)
        free = CounterMetricFamily("orchestrator_job_free_restarts",
                                   "Restarts not charged (controller lost).", labels=job_labels)
        attempt = GaugeMetricFamily("orchestrator_job_attempt", "The current attempt.",
                                    labels=job_labels)
        duration = GaugeMetricFamily("orchestrator_attempt_duration_seconds",
                                     "Each attempt's duration (so far, while it runs).",
                                     labels=["job_id", "attempt", "outcome"])
        node_state = GaugeMetricFamily("orchestrator_node_state",
                                       "1 for the node's current state.",
                                       labels=["job_id", "node", "host", "state"])
        node_age = GaugeMetricFamily("orchestrator_node_last_heard_age_seconds",
                                     "Seconds since the node's agent was last heard.",
                                     labels=["job_id", "node", "host"])
        rank_labels = ["job_id", "rank", "host"]
        step = GaugeMetricFamily("orchestrator_rank_step", "The rank's last reported step.",
                                 labels=rank_labels)
        rate = GaugeMetricFamily("orchestrator_rank_steps_per_second",
                                 "Steps per second this attempt.", labels=rank_labels)
        beat = GaugeMetricFamily("orchestrator_rank_heartbeat_age_seconds",
                                 "Seconds since the rank's last heartbeat().",
                                 labels=rank_labels)
        wait = GaugeMetricFamily("orchestrator_rank_wait_share",
                                 "Share of the last 30 s spent waiting in collectives.",
                                 labels=rank_labels)
        slow = GaugeMetricFamily("orchestrator_rank_straggler",
                                 "1 when the others wait for this rank.", labels=rank_labels)
        lost = CounterMetricFamily("orchestrator_time_lost_seconds",
                                   "Seconds of training lost to failures: each fault until every "
                                   "rank trained again, plus the steps redone.",
                                   labels=job_labels)
        gpu_lost = CounterMetricFamily("orchestrator_gpu_seconds_lost",
                                       "Time lost times the ranks.", labels=job_labels)
        goodput = GaugeMetricFamily("orchestrator_goodput_ratio",
                                    "Useful step time over wall time since the job started.",
                                    labels=job_labels)
        infra = CounterMetricFamily("orchestrator_job_infra_restarts",
                                    "Restarts charged to max_infra_restarts.", labels=job_labels)
        classes = CounterMetricFamily("orchestrator_attempt_failures",
                                      "Failed attempts by failure class.",
                                      labels=[*job_labels, "class"])
        restored = GaugeMetricFamily("orchestrator_checkpoint_restored_step",
                                     "The checkpoint step the current attempt resumed.",
                                     labels=job_labels)
        memory = GaugeMetricFamily("orchestrator_checkpoint_memory_bytes",
                                 "Bytes of a node's memory its checkpoints take.",
                                 labels=["job_id", "node", "host"])
        newest = GaugeMetricFamily("orchestrator_checkpoint_newest_step",
                                   "The newest step a node holds of every one of its ranks.",
                                   labels=["job_id", "node", "host", "where"])
        done = GaugeMetricFamily("orchestrator_job_progress_ratio",
                                 "The job's step over its total steps.", labels=job_labels)
        eta = GaugeMetricFamily("orchestrator_job_eta_seconds",
                                "Seconds until the job's last step, at its pace, counting the "
                                "share of time lost to faults so far.", labels=job_labels)
        block = GaugeMetricFamily("orchestrator_checkpoint_block_seconds",
                                  "Seconds the node's newest save held training (its slowest "
                                  "rank).", labels=["job_id", "node", "host"])
        size = GaugeMetricFamily("orchestrator_checkpoint_bytes",
                                 "Bytes of the node's newest save, its ranks together.",
                                 labels=["job_id", "node", "host"])
        sources = GaugeMetricFamily("orchestrator_checkpoint_restored_ranks",
                                    "Ranks of the current attempt that restored from each "
                                    "source (memory, buddy, persisted).",
                                    labels=[*job_labels, "source"])
        notice = GaugeMetricFamily("orchestrator_node_notice_deadline_seconds",
                                   "The Unix time by which a node with a notice (a SIGTERM, "
                                   "a preemption_check) stops its workers.",
                                   labels=["job_id", "node", "host", "source"])
        drained = GaugeMetricFamily("orchestrator_node_drained", "1 while the node is "
                                    "drained.", labels=["job_id", "node", "host"])
        for job in shown:
            _move_metrics(job, drains, notice, drained)
            _checkpoint_metrics(job, restored, memory, newest, (block, size, sources))
            infra.add_metric([job.job_id, job.name], job.infra_restarts)
            for klass in FailureClass:
                classes.add_metric([job.job_id, job.name, klass.value], sum(
                    1 for a in job.attempts
                    if a.failure and a.failure.get("failure_class") == klass.value))
            _job_metrics(job, now, restarts, free, attempt, duration, node_state, node_age,
                         step, rate, beat, wait, slow)
            summary = timelost.summary(job.attempts, job.steps, job.ended_at)
            lost.add_metric([job.job_id, job.name], summary["seconds"])
            gpu_lost.add_metric([job.job_id, job.name], summary["gpu_seconds"])
            if summary["goodput"] is not None:
                goodput.add_metric([job.job_id, job.name], summary["goodput"])
            far = progress.progress(job, summary, now) or {}
            if far.get("percent") is not None:
                done.add_metric([job.job_id, job.name],
                                min(1.0, far["step"] / far["total_steps"]))
            if far.get("eta_s") is not None:
                eta.add_metric([job.job_id, job.name], far["eta_s"])
        yield from (restarts, free, attempt, duration, node_state, node_age, step, rate, beat,
                    wait, slow, lost, gpu_lost, goodput, infra, classes, restored, memory, newest,
                    done, eta, block, size, sources, notice, drained)


def _move_metrics(job: JobRecord, drains: list[dict[str, Any]], notice: Any,
                  drained: Any) -> None:
    """Planned moves (orchestrator/drain.py): each node's notice and drain, while the job
    runs."""
    if job.state.is_at_rest():
        return
    held = drain.drained(drains, job.job_id, {n.node_index: n.host for n in job.nodes})
    for n in job.nodes:
        labels = [job.job_id, str(n.node_index), n.host]
        drained.add_metric(labels, 1.0 if n.node_index in held else 0.0)
        said = n.info.get("notice")
        if isinstance(said, dict) and isinstance(said.get("deadline"), (int, float)):
            notice.add_metric([*labels, str(said.get("source"))], said["deadline"])


def _checkpoint_metrics(job: JobRecord, restored: Any, held: Any, newest: Any,
                        saves: tuple[Any, Any, Any]) -> None:
    current = next((a for a in job.attempts if a.attempt == job.attempt), None)
    if current is not None and current.restored_step is not None:
        restored.add_metric([job.job_id, job.name], current.restored_step)
    block, size, sources = saves
    loads: dict[str, int] = {}
    for n in job.nodes:
        report = n.info.get("checkpoint")
        if not isinstance(report, dict):
            continue
        labels = [job.job_id, str(n.node_index), n.host]
        if isinstance(report.get("memory_bytes"), int):
            held.add_metric(labels, report["memory_bytes"])
        for where, key in (("memory", "newest_in_memory"), ("persisted", "newest_persisted")):
            if isinstance(report.get(key), int):
                newest.add_metric([*labels, where], report[key])
        last = report.get("last_save")
        if isinstance(last, dict):
            block.add_metric(labels, last["block_s"])
            size.add_metric(labels, last["bytes"])
        for load in (report.get("restored") or {}).values():
            loads[load["source"]] = loads.get(load["source"], 0) + 1
    for source, count in sorted(loads.items()):
        sources.add_metric([job.job_id, job.name, source], count)


def _job_metrics(job: JobRecord, now: float, restarts: Any, free: Any, attempt: Any,
                 duration: Any, node_state: Any, node_age: Any, step: Any, rate: Any,
                 beat: Any, wait: Any, slow: Any) -> None:
    labels = [job.job_id, job.name]
    restarts.add_metric(labels, job.restarts)
    free.add_metric(labels, job.free_restarts)
    attempt.add_metric(labels, job.attempt)
    for a in job.attempts:
        end = a.ended_at if a.ended_at is not None else now
        outcome = a.outcome or AttemptOutcome.RUNNING.value
        duration.add_metric([job.job_id, str(a.attempt), outcome],
                            max(0.0, end - a.started_at))
    hosts = {}
    for n in job.nodes:
        hosts[n.node_index] = n.host
        for s in NodeState:
            node_state.add_metric([job.job_id, str(n.node_index), n.host, s.value],
                                  1.0 if n.state == s else 0.0)
        if n.heard_at is not None and not job.state.is_at_rest():
            node_age.add_metric([job.job_id, str(n.node_index), n.host],
                                max(0.0, now - n.heard_at))
    current = next((a for a in job.attempts if a.attempt == job.attempt), None)
    stragglers = set(current.stragglers) if current is not None else set()
    for r in job.ranks:
        if r.attempt != job.attempt:
            continue
        labels = [job.job_id, str(r.rank), hosts.get(r.node_index, "")]
        if r.step is not None:
            step.add_metric(labels, r.step)
        if r.steps_per_s is not None:
            rate.add_metric(labels, r.steps_per_s)
        if r.heartbeat_at is not None and not job.state.is_at_rest():
            beat.add_metric(labels, max(0.0, now - r.heartbeat_at))
        if r.wait_share is not None:
            wait.add_metric(labels, r.wait_share)
        slow.add_metric(labels, 1.0 if r.rank in stragglers else 0.0)
