"""Webhook notifications: a JSON body POSTed to each ``notify:`` URL that wants the event, from
one background thread, so that a slow or dead receiver never holds the controller.

The body is Slack-compatible (its ``text`` line names the job, the event, the cause and the
node) and carries the fields for anything else::

    {"text": "job pretrain (pretrain-3f2a1c): restarted after attempt 1: rank 3 exited
              with code 1 [user] on node 1 (gpu-07)",
     "id": "pretrain-3f2a1c/restarted/1", "job_id": ..., "name": ..., "event": "restarted",
     "attempt": 1, "cause": ..., "failure_class": ..., "message": ..., "host": ..., "at": ...}

Each event is sent once per receiver: a receiver that answers 2xx has it; a timeout, a
connection error, 429 or 5xx is tried again (up to ``TRIES`` times, doubling the wait); any
other answer is final. ``id`` is the same on every try, for receivers that deduplicate. The
URL is a secret (it often holds a token): logs name a receiver by its index only.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from typing import Any

log = logging.getLogger(__name__)

TRIES = 4
END_WAIT = 15.0  # seconds an ending controller gives its receivers
FIRST_WAIT = 0.5  # seconds before the second try; doubling


class Notifier:
    """Posts events for one job to the ``notify:`` targets of its spec."""

    def __init__(self, targets: tuple[Any, ...], job_id: str, name: str):
        self.targets = targets  # specparts.NotifySpec: url, on, timeout
        self.job_id, self.name = job_id, name
        self._queue: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def event(self, event: str, text: str, key: str, **fields: Any) -> None:
        """Queue ``event`` for every target that wants it; never blocks. ``key`` makes the
        event's id unique within the job (an attempt number, a host)."""
        wanted = [i for i, t in enumerate(self.targets) if event in t.on]
        if not wanted:
            return
        body = {"text": f"job {self.name} ({self.job_id}): {text}",
                "id": f"{self.job_id}/{event}/{key}", "job_id": self.job_id,
                "name": self.name, "event": event, "at": time.time(), **fields}
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="notify", daemon=True)
            self._thread.start()
        for index in wanted:
            self._queue.put((index, body))

    # --- the job's events, as the controller sees them -----------------------------------------
    def restarted(self, failure: dict[str, Any], attempt: int) -> None:
        """Attempt ``attempt`` failed with ``failure`` (a Failure's dict) and is restarted."""
        fields = failure_fields(failure)
        if failure["cause"] == "PREEMPTED":  # a planned move, not a restart
            self.event("drained", f"moved after attempt {attempt}: {failure['message']}",
                       str(attempt), attempt=attempt, **fields)
            return
        if failure["cause"] == "HUNG":
            self.event("hung", f"hung in attempt {attempt}: {failure['message']}",
                       str(attempt), attempt=attempt, **fields)
        self.event("restarted", f"restarted after attempt {attempt}: {failure['message']} "
                   f"[{failure.get('failure_class')}]", str(attempt), attempt=attempt,
                   **fields)

    def ended(self, state: str, failure: dict[str, Any] | None) -> None:
        """The job ended in ``state`` (SUCCEEDED, FAILED, CANCELLED), or stopped PREEMPTED."""
        event = {"SUCCEEDED": "succeeded", "FAILED": "failed",
                 "CANCELLED": "cancelled", "PREEMPTED": "preempted"}.get(state)
        if event is None:
            return
        if failure is None:
            self.event(event, event, "end")
            return
        fields = failure_fields(failure)
        if failure.get("root_cause", failure["cause"]) == "HUNG":
            self.event("hung", f"hung: {failure['message']}", "end", **fields)
        klass = f" [{failure['failure_class']}]" if failure.get("failure_class") else ""
        self.event(event, f"{event}: {failure['message']}{klass}", "end", **fields)

    def node_lost(self, index: int, host: str, message: str | None, attempt: int) -> None:
        self.event("node_lost", f"node {index} ({host}) lost"
                   + (f": {message}" if message else ""), f"{index}/{attempt}",
                   host=host, node_index=index, attempt=attempt, message=message)

    def close(self, wait: float) -> None:
        """Deliver what is queued, for at most ``wait`` seconds (the controller is ending)."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(wait)
        if self._thread.is_alive():
            log.warning("notify: gave up on %d event(s) still queued after %.0f s",
                        self._queue.qsize(), wait)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            index, body = item
            try:
                self._deliver(index, body)
            except Exception:  # noqa: BLE001 (a receiver never takes the controller down)
                log.exception("notify[%d]: %s not delivered", index, body["event"])

    def _deliver(self, index: int, body: dict[str, Any]) -> None:
        target = self.targets[index]
        data = json.dumps(body).encode()
        wait = FIRST_WAIT
        for attempt in range(1, TRIES + 1):
            request = urllib.request.Request(
                target.url, data=data, method="POST",
                headers={"Content-Type": "application/json", "User-Agent": "orchestrator"})
            try:
                with urllib.request.urlopen(request, timeout=target.timeout) as answer:
                    answer.read(65536)
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 429 and exc.code < 500:
                    log.warning("notify[%d]: %s refused with HTTP %d", index, body["event"],
                                exc.code)
                    return
                why = f"HTTP {exc.code}"
            except (OSError, ValueError) as exc:  # URLError, timeouts, resets
                why = type(exc).__name__
            if attempt < TRIES:
                time.sleep(wait)
                wait *= 2
        log.warning("notify[%d]: %s not delivered after %d tries (%s)", index, body["event"],
                    TRIES, why)


def failure_fields(failure: dict[str, Any]) -> dict[str, Any]:
    """What a notification carries of a failure (a Failure's dict)."""
    return {k: v for k, v in failure.items()
            if k in ("cause", "message", "failure_class", "evidence", "decision", "host",
                     "node_rank", "rank", "exit_code", "signal")}
