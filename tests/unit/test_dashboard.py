"""The dashboard's doors without a job running (tests/integration/test_dashboard.py renders real
jobs): what ``orchestrator ui`` prints of its token, how long a session lasts (a fake clock,
not hours of sleep), and the query parameters (bounded; a bad one is a 400, never a 500).
The app is driven as ASGI directly (no server, no HTTP client); the banner is a real
``orchestrator ui``'s stderr."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from orchestrator.spec import validate_jobspec
from orchestrator.state import JobState
from orchestrator.store import Store
from orchestrator.ui import create_app

TOKEN = "a-fixed-token-of-enough-characters-0123"
PORT = 8265
SPEC = {"name": "doors", "nodes": [{"host": "local"}], "nproc_per_node": 2,
        "command": ["python3", "-c", "pass"], "workdir": "/tmp"}


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _call(app: Any, path: str, query: str = "", headers: dict[str, str] | None = None,
          ) -> tuple[int, dict[str, str], bytes]:
    """One GET through the ASGI app: (status, headers, body). An exception the app lets out
    after it answered is what a server would send: that answer (a 500)."""
    raw = [(b"host", f"127.0.0.1:{PORT}".encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(),
             "query_string": query.encode(), "headers": raw, "scheme": "http",
             "server": ("127.0.0.1", PORT), "client": ("127.0.0.1", 40000), "root_path": "",
             "http_version": "1.1", "asgi": {"version": "3.0"}}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    try:
        asyncio.run(app(scope, receive, send))
    except Exception:
        if not sent:
            return 500, {}, b""
    start = sent[0]
    assert start["type"] == "http.response.start", sent
    return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in sent[1:]))


@pytest.fixture
def home(tmp_path: Path) -> tuple[Path, str]:
    """A store with one running job of two ranks, a line in each rank's log."""
    store = Store(tmp_path / "home")
    try:
        spec = validate_jobspec(SPEC)
        job_id = "doors-000001"
        store.create_job(job_id, "doors", spec.model_dump_json(), str(tmp_path), 0, ["local"])
        store.set_state(job_id, JobState.LAUNCHING, started_at=time.time())
        store.start_attempt(job_id, 1, "127.0.0.1", 29500, 2, [(0, 0, 0), (1, 0, 1)])
        store.set_state(job_id, JobState.RUNNING)
        logs = store.log_dir(job_id, 1)
        logs.mkdir(parents=True, exist_ok=True)
        for rank in (0, 1):
            (logs / f"rank-{rank}.log").write_text(f"rank {rank} says hello\n")
        (logs / "combined.log").write_text("[local:0] rank 0 says hello\n")
    finally:
        store.close()
    return tmp_path / "home", job_id


# --- 1. the token, printed only where we made it ---------------------------------------------

def _banner(tmp_path: Path, token: str | None) -> str:
    """What ``orchestrator ui`` writes to stderr (a service's log) before it serves."""
    env = {k: v for k, v in os.environ.items() if k != "ORCHESTRATOR_UI_TOKEN"}
    env["ORCHESTRATOR_HOME"] = str(tmp_path / "home")
    if token is not None:
        env["ORCHESTRATOR_UI_TOKEN"] = token
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "ui", "--port", "0"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    banner, deadline = "", time.monotonic() + 30
    try:
        assert proc.stderr is not None
        while "dashboard:" not in banner:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, banner
            assert time.monotonic() < deadline, banner
            banner += line
        # The whole banner is out once it serves (it announces, then listens).
        port = int(re.search(r"dashboard: http://127\.0\.0\.1:(\d+)/", banner).group(1))
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, banner
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stderr is not None:  # what the readline above buffered, and the rest
            banner += proc.stderr.read()
            proc.stderr.close()
    return banner


def test_a_token_from_the_environment_is_never_printed(tmp_path):
    banner = _banner(tmp_path, TOKEN)
    assert TOKEN not in banner and "?token=" + TOKEN[:8] not in banner, banner
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/\s", banner), banner
    # Where to find it instead.
    assert "token:     from $ORCHESTRATOR_UI_TOKEN (not printed)" in banner, banner


def test_a_token_made_at_start_is_printed(tmp_path):
    banner = _banner(tmp_path, None)
    found = re.search(r"dashboard: http://127\.0\.0\.1:\d+/\?token=([\w-]+)", banner)
    assert found and len(found.group(1)) >= 32, banner
    assert "token:     made at start" in banner, banner
    assert "ORCHESTRATOR_UI_TOKEN" not in banner.split("dashboard:")[1].split("\n")[0]


# --- 2. sessions end -------------------------------------------------------------------------

def _login(app: Any, lifetime: float | None = None) -> str:
    """A session opened with ``?token=``: its cookie (``name=id``)."""
    from orchestrator.ui import SESSION_LIFETIME

    status, headers, _ = _call(app, "/api/jobs", f"token={TOKEN}")
    assert status == 303, headers
    cookie = headers["set-cookie"]
    # The browser forgets it then too (the server does not count on that).
    assert f"max-age={int(lifetime or SESSION_LIFETIME)}" in cookie.lower(), cookie
    return cookie.split(";")[0]


def test_a_session_ends_after_its_lifetime_however_much_it_is_used(home):
    from orchestrator.ui import SESSION_LIFETIME

    clock = _Clock()
    app = create_app(home[0], token=TOKEN, port=PORT, clock=clock)
    cookie = _login(app)
    unauthenticated = _call(app, "/api/jobs")
    assert unauthenticated[0] == 401
    # Used all along (a page polls every few seconds): still, it ends at its lifetime.
    while clock.now < 1000.0 + SESSION_LIFETIME - 60:
        assert _call(app, "/api/jobs", headers={"Cookie": cookie})[0] == 200, clock.now
        clock.now += 3600
    clock.now = 1000.0 + SESSION_LIFETIME - 1
    assert _call(app, "/api/jobs", headers={"Cookie": cookie})[0] == 200
    clock.now = 1000.0 + SESSION_LIFETIME
    expired = _call(app, "/api/jobs", headers={"Cookie": cookie})
    assert (expired[0], expired[2]) == (unauthenticated[0], unauthenticated[2])
    assert _call(app, "/", headers={"Cookie": cookie})[0] == 401
    # The token still opens a new one; the old one stays dead.
    fresh = _login(app)
    assert fresh != cookie and _call(app, "/api/jobs", headers={"Cookie": fresh})[0] == 200
    assert _call(app, "/api/jobs", headers={"Cookie": cookie})[0] == 401
    assert _call(app, "/api/jobs", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200


def test_ended_sessions_are_forgotten(home):
    clock = _Clock()
    app = create_app(home[0], token=TOKEN, port=PORT, clock=clock, session_lifetime=60)
    old = [_login(app, 60) for _ in range(5)]
    clock.now += 30
    middle = _login(app, 60)
    clock.now += 31
    newest = _login(app, 60)
    assert len(app.sessions) == 2  # the ended ones hold no memory, even if never seen again
    assert all(_call(app, "/api/jobs", headers={"Cookie": c})[0] == 401 for c in old)
    assert _call(app, "/api/jobs", headers={"Cookie": middle})[0] == 200
    assert _call(app, "/api/jobs", headers={"Cookie": newest})[0] == 200


# --- 3. numeric parameters: bounded, 400 when bad --------------------------------------------

BAD_NUMBERS = ["9" * 23, "9" * 5000, "-1", "1e3", "0x10", " 1", "1 ", "+1", "1.0", "\u0663",
               "\u00b2", "nan", "true", "16777217"]


@pytest.mark.parametrize("value", [pytest.param(v, id=f"{len(v)}:{ascii(v)[1:9]}")
                                   for v in BAD_NUMBERS])
@pytest.mark.parametrize("endpoint,name", [("samples", "rank"), ("logs", "rank"),
                                           ("logs", "lines")])
def test_a_bad_number_is_a_short_400(home, endpoint, name, value):
    app = create_app(home[0], token=TOKEN, port=PORT)
    status, _, body = _call(app, f"/api/jobs/{home[1]}/{endpoint}",
                            f"{name}={urllib.parse.quote(value)}",
                            {"Authorization": f"Bearer {TOKEN}"})
    assert status == 400, (status, body[:200])
    assert len(body) < 200 and name.encode() in body, body


def test_the_rank_23_digits_long_is_a_400_not_a_500(home):
    app = create_app(home[0], token=TOKEN, port=PORT)
    status, _, body = _call(app, f"/api/jobs/{home[1]}/samples", "rank=" + "1" * 23,
                            {"Authorization": f"Bearer {TOKEN}"})
    assert status == 400, (status, body)


@pytest.mark.parametrize("endpoint,query", [
    ("samples", ""), ("samples", "rank="), ("samples", "rank=0"), ("samples", "rank=16777216"),
    ("logs", ""), ("logs", "rank=1"), ("logs", "lines=1"), ("logs", "lines=5000&rank=0"),
    ("logs", "rank=16777216")])
def test_numbers_within_bounds_are_answered(home, endpoint, query):
    app = create_app(home[0], token=TOKEN, port=PORT)
    status, _, body = _call(app, f"/api/jobs/{home[1]}/{endpoint}", query,
                            {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, (status, body)


def test_lines_beyond_the_bound_are_refused_and_a_rank_reads_its_own_log(home):
    app = create_app(home[0], token=TOKEN, port=PORT)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert _call(app, f"/api/jobs/{home[1]}/logs", "lines=5001", auth)[0] == 400
    assert _call(app, f"/api/jobs/{home[1]}/logs", "lines=0", auth)[0] == 400
    status, _, body = _call(app, f"/api/jobs/{home[1]}/logs", "rank=1&lines=5", auth)
    assert status == 200 and b"rank 1 says hello" in body, body
