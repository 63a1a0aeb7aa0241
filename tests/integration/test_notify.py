"""Webhook notifications with a real local HTTP server: each event once, with its cause and
node; a receiver that fails is tried again; a dead one never holds the job; the URL, a secret,
is shown nowhere (issue 20, item 5)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import orchestrator
from tests.helpers import (
    PYTHON,
    ROOT,
    WORKERS,
    assert_no_job_processes,
    wait_for,
    wait_for_output,
    write_spec,
)

TOKEN_PATH = "/hooks/T0KEN-abcdef0123456789"


class Receiver:
    """A webhook receiver on loopback: keeps every body; the first ``fail_first`` requests
    get a 503."""

    def __init__(self, fail_first: int = 0):
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.fail_first = fail_first
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.paths.append(self.path)
                if receiver.fail_first > 0:
                    receiver.fail_first -= 1
                    self.send_response(503)
                    self.end_headers()
                    return
                receiver.bodies.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{TOKEN_PATH}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self, job_id: str) -> list[str]:
        return [b["event"] for b in self.bodies if b["job_id"] == job_id]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver(fail_first=1)  # the first delivery is refused once, then taken
    yield r
    r.close()


def test_each_event_reaches_the_webhook_once(home, tmp_path, receiver):
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "hooked", "nodes": [{"host": "local"}] * 2, "nproc_per_node": 1,
        "command": [PYTHON, str(WORKERS / "goodput_train.py"), str(tmp_path / "ckpt")],
        "workdir": str(tmp_path), "max_restarts": 1, "restart_backoff": {"initial": 0.1},
        "stop_grace_period": 2, "env": {"STEPS": "200", "STEP_TIME": "0.05", "CKPT_EVERY": "10"},
        "notify": [{"url": receiver.url}]}))
    wait_for_output(job_id, "STEP 0 1 5 ", 1, timeout=90)
    victim = next(r for r in orchestrator.status(job_id)["ranks"] if r["node_index"] == 1)
    with open(f"/proc/{victim['pid']}/stat", "rb") as f:
        agent = int(f.read().rsplit(b")", 1)[1].split()[1])
    os.kill(agent, signal.SIGKILL)  # node 1's agent: the node is lost
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    wait_for(lambda: "succeeded" in receiver.events(job_id), 30, what="the succeeded event")
    assert sorted(receiver.events(job_id)) == ["node_lost", "restarted", "succeeded"]
    by_event = {b["event"]: b for b in receiver.bodies}
    lost = by_event["node_lost"]
    assert lost["host"] == "local" and lost["node_index"] == 1 and "node_lost" in lost["id"]
    restarted = by_event["restarted"]
    assert restarted["failure_class"] == "infrastructure" and restarted["attempt"] == 1
    assert restarted["text"].startswith(f"job hooked ({job_id}): restarted after attempt 1: ")
    assert "[infrastructure]" in restarted["text"]
    assert receiver.paths.count(TOKEN_PATH) == 4  # three events, one of them tried twice
    # The URL is a secret: in no log, no status, no command line of ours.
    shown = subprocess.run([PYTHON, "-m", "orchestrator", "status", job_id, "--json"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert TOKEN_PATH not in shown.stdout + shown.stderr
    for path in (home / "jobs" / job_id).rglob("*"):
        if path.is_file():
            assert TOKEN_PATH.encode() not in path.read_bytes(), path
    assert_no_job_processes(job_id)


def test_a_failed_job_says_so_and_a_dead_receiver_holds_nothing(home, tmp_path, receiver):
    dead = Receiver()
    dead.close()  # nothing listens there any more: every try is refused
    (tmp_path / "train.py").write_text("import sys\nprint('boom', file=sys.stderr)\n"
                                       "sys.exit(7)\n")
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "doomed", "nodes": [{"host": "local"}], "nproc_per_node": 1,
        "command": [PYTHON, "train.py"], "workdir": str(tmp_path),
        "notify": [{"url": dead.url, "on": ["failed"]},
                   {"url": receiver.url, "on": ["failed", "succeeded"]}]}))
    result = orchestrator.wait(job_id, timeout=90)
    assert result["state"] == "FAILED"
    wait_for(lambda: receiver.events(job_id), 30, what="the failed event")
    (body,) = [b for b in receiver.bodies if b["job_id"] == job_id]
    assert body["event"] == "failed" and body["exit_code"] == 7 and body["rank"] == 0
    assert "rank 0" in body["text"] and "exit" in body["text"]
