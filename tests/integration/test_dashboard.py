"""The web dashboard (`orchestrator ui`), served by real uvicorn and rendered by a real headless
chromium: the job list, a job page (ranks, attempts, a metric plot across a restart, the log
tail), Prometheus /metrics, loopback-only by default and a token elsewhere.

The job page's screenshot is kept in tests/artifacts/ (not in git)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

import orchestrator
from tests.helpers import PYTHON, WORKERS, write_spec

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
HOSTILE = "<img src=x onerror=alert(1)><script>alert(2)</script>"


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """``orchestrator ui`` on a free port. With ``auth``, the helpers give the token it
    printed: ``get`` as a Bearer header (unless the call gives its own), ``url`` as the
    ``?token=`` a browser opens."""

    def __init__(self, home: Path, *args: str, auth: bool = False):
        self.port, self.auth = _free_port(), auth
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "ui", "--port", str(self.port), *args],
            env={**os.environ, "ORCHESTRATOR_HOME": str(home)}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        self.banner = ""
        deadline = time.monotonic() + 20
        while "dashboard:" not in self.banner or ("token" in args and "metrics:" not in
                                                   self.banner):
            line = self.proc.stderr.readline() if self.proc.stderr else ""
            if not line and self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"ui did not start: {self.banner}")
            self.banner += line
        found = re.search(r"\?token=([\w-]+)", self.banner)
        self.token = found.group(1) if found else None
        while True:  # the banner comes before uvicorn listens
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None, self.banner
                time.sleep(0.05)

    def url(self, path: str) -> str:
        if not self.auth:
            return self._url(path)
        return self._url(path) + ("&" if "?" in path else "?") + f"token={self.token}"

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str, headers: dict[str, str] | None = None,
            method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        headers = dict(headers or {})
        if self.auth and not {"Authorization", "Cookie"} & set(headers):
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self._url(path), headers=headers, method=method)

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args, **kwargs):
                return None

        opener = urllib.request.build_opener(NoRedirect)
        try:
            with opener.open(request, timeout=10) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()


class _Dom(HTMLParser):
    """The rendered page's elements as (tag, attributes, text inside it)."""

    def __init__(self, html: str):
        super().__init__()
        self.elements: list[tuple[str, dict[str, str | None], list[str]]] = []
        self._open: list[list[str]] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        text: list[str] = []
        self.elements.append((tag, dict(attrs), text))
        if tag not in ("img", "br", "meta", "link", "input", "circle", "line", "rect",
                       "polyline"):
            self._open.append(text)

    def handle_endtag(self, tag):
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        for text in self._open:
            text.append(data)

    def find(self, tag: str, **attrs: str) -> list[tuple[dict[str, str | None], str]]:
        return [(a, "".join(t)) for g, a, t in self.elements
                if g == tag and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]


def _render(chromium: str, url: str, screenshot: Path | None = None) -> _Dom:
    argv = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--window-size=1300,1700", "--virtual-time-budget=5000"]
    dom = subprocess.run(argv + ["--dump-dom", url], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    if screenshot is not None:
        subprocess.run(argv + [f"--screenshot={screenshot}", url], capture_output=True,
                       timeout=60, check=True)
    return _Dom(dom)


@pytest.fixture(scope="module")
def restarted_job(tmp_path_factory):
    """A finished job: 2 nodes x 2 ranks, loss and tokens/s by step, rank 1 crashing at step
    12 of attempt 1, attempt 2 resuming from the checkpoint at step 10."""
    home, work = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("work")
    old = os.environ.get("ORCHESTRATOR_HOME")
    os.environ["ORCHESTRATOR_HOME"] = str(home)
    try:
        job_id = orchestrator.submit(write_spec(work, {
            "name": "pretrain", "nodes": [{"host": "local"}, {"host": "local"}],
            "nproc_per_node": 2, "command": [PYTHON, str(WORKERS / "trainer.py")],
            "workdir": str(work), "max_restarts": 1, "health": {"heartbeat_interval": 0.5},
            "env": {"STEPS": "24", "CRASH_AT": "12", "STEP_SLEEP": "0.25", "SAY": HOSTILE}}))
        result = orchestrator.wait(job_id, timeout=120)
    finally:
        if old is None:
            os.environ.pop("ORCHESTRATOR_HOME", None)
        else:
            os.environ["ORCHESTRATOR_HOME"] = old
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 1, result
    return home, job_id


@pytest.fixture(scope="module")
def server(restarted_job):
    s = _Server(restarted_job[0], auth=True)
    yield s
    s.close()


def test_the_job_list_renders_in_a_browser(restarted_job, server):
    dom = _render(_chromium(), server.url("/"))
    rows = dom.find("tr", data_job=restarted_job[1])
    assert len(rows) == 1 and rows[0][0]["data-state"] == "SUCCEEDED", dom.find("tr")
    assert restarted_job[1] in rows[0][1] and "pretrain" in rows[0][1]


def test_a_job_page_shows_ranks_attempts_metric_plots_and_logs(restarted_job, server):
    _, job_id = restarted_job
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard-job.png"
    shot.unlink(missing_ok=True)
    dom = _render(_chromium(), server.url(f"/jobs/{job_id}"), screenshot=shot)
    # The grid: 2 nodes, 4 ranks of attempt 2, all done at the last step.
    assert len(dom.find("div", **{"class": "node"})) == 2
    ranks = dom.find("div", **{"class": "rank"})
    assert sorted(a["data-rank"] for a, _ in ranks) == ["0", "1", "2", "3"], ranks
    assert {a["data-state"] for a, _ in ranks} == {"SUCCEEDED"}
    assert all(text.endswith("@23") for _, text in ranks), ranks
    # The timeline: attempt 1 failed (the crash), attempt 2 succeeded, a restart marked.
    bars = {a["data-attempt"]: a["data-outcome"] for a, _ in dom.find("rect")}
    assert bars == {"1": "FAILED", "2": "SUCCEEDED"}, bars
    assert len(dom.find("line", **{"class": "restart"})) == 1
    assert "exited with code 3" in " ".join(t for _, t in dom.find("td"))
    # The loss plot: one line per attempt; attempt 2 starts at the checkpoint (step 10).
    loss = [a for a, _ in dom.find("polyline") if a.get("data-attempt")]
    assert {a["data-attempt"] for a in loss} >= {"1", "2"}, loss
    assert dom.find("svg", data_metric="loss") and dom.find("svg", data_metric="tokens_per_s")
    # The log tail, and the worker's markup shown as text, never run as markup.
    log = dom.find("pre", id="log")
    assert log and "[local:0] rank 0 done" in log[0][1], log
    assert HOSTILE in log[0][1]
    assert not dom.find("img") and len(dom.find("script")) == 1
    # The screenshot is a real picture of the page.
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, len(data)


def test_the_job_page_says_what_the_restart_cost(restarted_job, server):
    _, job_id = restarted_job
    shown = orchestrator.status(job_id, home=restarted_job[0])["time_lost"]
    (incident,) = shown["incidents"]
    assert incident["attempt"] == 1 and incident["cause"] == "WORKER_FAILED"
    dom = _render(_chromium(), server.url(f"/jobs/{job_id}"))
    (line,) = [text for _, text in dom.find("p", id="time-lost")]
    assert line.startswith(f"time lost: {shown['seconds']} s ({shown['gpu_seconds']} GPU-s) "
                           "in 1 incident(s)"), line
    cells = [text for _, text in dom.find("td")]
    assert any(f"{incident['steps_redone']} steps redone" in c for c in cells), cells
    # Attempt 1's class, and what the policy did about it.
    assert [text for _, text in dom.find("td", **{"class": "failure-class"})][:1] == ["user"]
    assert any("restarted: restart 1 of max_restarts 1" in c for c in cells), cells


def test_metric_samples_span_both_attempts(restarted_job, server):
    import json

    status, _, body = server.get(f"/api/jobs/{restarted_job[1]}/samples?rank=0")
    assert status == 200
    samples = json.loads(body)
    first = [s["step"] for s in samples if s["attempt"] == 1]
    second = [s["step"] for s in samples if s["attempt"] == 2]
    assert first and second and max(first) <= 12, samples
    assert min(second) >= 10 and max(second) == 23, second  # resumed from the checkpoint
    assert all("loss" in s["metrics"] for s in samples)


def test_prometheus_metrics_parse_and_tell_the_truth(restarted_job, server):
    from prometheus_client.parser import text_string_to_metric_families

    _, job_id = restarted_job
    status, headers, body = server.get("/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))

    def value(name, **labels):
        found = [v for lab, v in samples[name] if all(lab.get(k) == w for k, w in labels.items())]
        assert len(found) == 1, (name, labels, samples.get(name))
        return found[0]

    assert value("orchestrator_jobs", state="SUCCEEDED") == 1
    assert value("orchestrator_jobs", state="RUNNING") == 0
    assert value("orchestrator_job_restarts_total", job_id=job_id) == 1
    assert value("orchestrator_job_attempt", job_id=job_id) == 2
    # Rank 1 exited with code 3 in attempt 1: the program's own failure.
    assert value("orchestrator_attempt_failures_total", job_id=job_id, **{"class": "user"}) == 1
    assert value("orchestrator_attempt_failures_total", job_id=job_id,
                 **{"class": "infrastructure"}) == 0
    assert value("orchestrator_job_infra_restarts_total", job_id=job_id) == 0
    assert value("orchestrator_attempt_duration_seconds", job_id=job_id, attempt="1",
                 outcome="FAILED") > 0
    assert 4 < value("orchestrator_attempt_duration_seconds", job_id=job_id, attempt="2",
                     outcome="SUCCEEDED") < 60
    for rank in "0123":
        assert value("orchestrator_rank_step", job_id=job_id, rank=rank) == 23
        assert value("orchestrator_rank_steps_per_second", job_id=job_id, rank=rank) > 1
        assert value("orchestrator_rank_straggler", job_id=job_id, rank=rank) == 0
    for node in "01":
        assert value("orchestrator_node_state", job_id=job_id, node=node, state="DONE") == 1
        assert value("orchestrator_node_state", job_id=job_id, node=node, state="LOST") == 0


def _listening(port: int) -> set[str]:
    """Local addresses listening on ``port`` (/proc/net/tcp and tcp6, state 0A)."""
    found = set()
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_loopback_only_by_default_and_read_only(server):
    assert _listening(server.port) == {"0100007F"}  # 127.0.0.1, nothing else
    assert server.get("/api/jobs")[0] == 200
    # A page elsewhere reaching us by DNS rebinding names its own host: refused.
    assert server.get("/api/jobs", {"Host": "attacker.example:80"})[0] == 400
    assert server.get("/api/jobs", method="POST")[0] == 405
    assert server.get("/api/jobs/no-such-job")[0] == 404
    assert server.get("/api/jobs/..%2F..%2Fetc")[0] in (400, 404)
    status, headers, _ = server.get("/")
    assert status == 200 and "default-src 'self'" in headers["content-security-policy"]


def test_another_address_needs_the_printed_token(restarted_job):
    s = _Server(restarted_job[0], "--host", "0.0.0.0")
    try:
        m = re.search(r"\?token=([\w-]+)", s.banner)
        assert m, s.banner
        token = m.group(1)
        assert _listening(s.port) == {"00000000"}
        assert s.get("/api/jobs")[0] == 401
        assert s.get("/metrics")[0] == 401
        assert s.get("/api/jobs", {"Authorization": "Bearer wrong"})[0] == 401
        assert s.get("/api/jobs", {"Authorization": f"Bearer {token}"})[0] == 200
        assert s.get("/metrics", {"Authorization": f"Bearer {token}"})[0] == 200
        # The URL's token becomes a cookie and leaves the address bar.
        status, headers, _ = s.get(f"/jobs/{restarted_job[1]}?token={token}")
        assert status == 303 and headers["location"] == f"/jobs/{restarted_job[1]}", headers
        cookie = headers["set-cookie"].split(";")[0]
        assert "httponly" in headers["set-cookie"].lower()
        assert s.get("/api/jobs", {"Cookie": cookie})[0] == 200
    finally:
        s.close()


def _as_nobody(url: str, *headers: str) -> int:
    """The HTTP status another local user (uid 65534) gets from ``url`` with curl."""
    run = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                          "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time",
                          "10", *[a for h in headers for a in ("-H", h)], url],
                         capture_output=True, text=True, timeout=30)
    return int(run.stdout or 0)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("curl"),
                    reason="needs root to act as another user, and curl")
@pytest.mark.parametrize("where", ["loopback", "0.0.0.0"])
def test_another_local_user_reads_nothing_without_the_token(restarted_job, where):
    _, job_id = restarted_job
    s = _Server(restarted_job[0], *(["--host", "0.0.0.0"] if where == "0.0.0.0" else []))
    try:
        assert s.token and len(s.token) >= 32, s.banner
        for path in ("/", "/api/jobs", f"/api/jobs/{job_id}", f"/api/jobs/{job_id}/logs",
                     f"/api/jobs/{job_id}/samples", "/metrics", "/static/app.js"):
            assert _as_nobody(s._url(path)) == 401, path
            assert _as_nobody(s._url(path), "Authorization: Bearer wrong-" + "x" * 30) == 401
            # a cookie holding the token is not a session
            assert _as_nobody(s._url(path), f"Cookie: orchestrator_ui_{s.port}={s.token}") == 401
        assert _as_nobody(s._url("/api/jobs"), f"Authorization: Bearer {s.token}") == 200
    finally:
        s.close()


def test_the_cookie_is_a_session_of_this_port_never_the_token(restarted_job):
    one, two = _Server(restarted_job[0]), _Server(restarted_job[0])
    try:
        status, headers, _ = one.get(f"/api/jobs?token={one.token}")
        assert status == 303 and headers["location"] == "/api/jobs", headers
        set_cookie = headers["set-cookie"]
        name, _, session = set_cookie.split(";")[0].partition("=")
        assert name == f"orchestrator_ui_{one.port}" and session and one.token not in set_cookie
        assert "httponly" in set_cookie.lower() and "samesite=strict" in set_cookie.lower()
        assert one.get("/api/jobs", {"Cookie": f"{name}={session}"})[0] == 200
        # The browser sends it to the other port too: there it is nobody's session.
        assert two.get("/api/jobs", {"Cookie": f"{name}={session}"})[0] == 401
        assert two.get("/api/jobs", {"Cookie": f"orchestrator_ui_{two.port}={session}"})[0] == 401
        assert one.get("/api/jobs", {"Cookie": f"{name}=made-up"})[0] == 401
    finally:
        one.close()
        two.close()


def test_a_short_token_is_refused(restarted_job):
    run = subprocess.run([sys.executable, "-m", "orchestrator", "ui", "--port", "0"],
                         env={**os.environ, "ORCHESTRATOR_HOME": str(restarted_job[0]),
                              "ORCHESTRATOR_UI_TOKEN": "hunter2"},
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 2
    assert run.stderr.strip() == ("error: ui: $ORCHESTRATOR_UI_TOKEN is shorter than 24 "
                                  "characters: a token that short can be guessed")


def _self_signed(directory: Path) -> tuple[Path, Path]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "ui.crt", directory / "ui.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


def test_https_with_certfile_and_keyfile(restarted_job, tmp_path):
    import ssl

    cert, key = _self_signed(tmp_path)
    s = _Server(restarted_job[0], "--certfile", str(cert), "--keyfile", str(key))
    try:
        assert f"dashboard: https://127.0.0.1:{s.port}/?token=" in s.banner, s.banner
        context = ssl.create_default_context(cafile=str(cert))
        url = f"https://127.0.0.1:{s.port}/api/jobs"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {s.token}"})
        with urllib.request.urlopen(request, context=context, timeout=10) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, context=context, timeout=10)
        assert refused.value.code == 401
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # no plain HTTP
            urllib.request.urlopen(s._url("/api/jobs"), timeout=10)

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args, **kwargs):
                return None

        opener = urllib.request.build_opener(NoRedirect, urllib.request.HTTPSHandler(
            context=context))
        with pytest.raises(urllib.error.HTTPError) as redirected:
            opener.open(f"{url}?token={s.token}", timeout=10)
        assert redirected.value.code == 303
        assert "secure" in redirected.value.headers["set-cookie"].lower()
    finally:
        s.close()


def test_a_running_jobs_page_shows_its_progress_and_eta(home, tmp_path):
    """While the job runs: a progress bar at its percent, the step of the total, steps/s and
    the ETA, as status --json has them; Prometheus has the ratio and the ETA too."""
    from prometheus_client.parser import text_string_to_metric_families

    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "long", "nodes": [{"host": "local"}], "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "progress_train.py")], "workdir": str(tmp_path),
        "health": {"heartbeat_interval": 0.3},
        "env": {"STEPS": "3000", "GIVE_TOTAL": "1", "STEP_SLEEP": "0.05"}}))
    s = _Server(home, auth=True)
    try:
        def paced() -> bool:
            p = orchestrator.status(job_id)["progress"]
            return bool(p and p["eta_s"] and p["step"] >= 10)
        deadline = time.monotonic() + 60
        while not paced():
            assert time.monotonic() < deadline, orchestrator.status(job_id)["progress"]
            time.sleep(0.3)
        dom = _render(_chromium(), s.url(f"/jobs/{job_id}"))
        shown = orchestrator.status(job_id)["progress"]
        (bar,) = [a for a, _ in dom.find("progress")]
        assert 0 < float(bar["value"] or 0) <= shown["percent"] and bar["max"] == "100", bar
        (line,) = [text for _, text in dom.find("div", id="progress")]
        assert re.fullmatch(r"step [\d,]+ of 3,000 \([\d.]+%\) · [\d.]+ steps/s · ETA "
                            r"\d+m \d\ds \(.+\)", line), line
        _, _, body = s.get("/metrics")
        values = {x.name: x.value for f in text_string_to_metric_families(body.decode())
                  for x in f.samples if x.labels.get("job_id") == job_id}
        assert 0 < values["orchestrator_job_progress_ratio"] < 1, values
        assert values["orchestrator_job_eta_seconds"] > 0, values
    finally:
        s.close()
        orchestrator.cancel(job_id, wait_seconds=30)


def test_a_nodes_card_says_what_it_holds_and_what_a_save_held_the_training(home, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "saving", "nodes": [{"host": "local"}], "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "ckpt_train.py")], "workdir": str(tmp_path),
        "env": {"OUT": str(out), "STEPS": "400", "STEP_SLEEP": "0.1", "STATE_MB": "1"}}))
    s = _Server(home, auth=True)
    try:
        deadline = time.monotonic() + 60
        while not (orchestrator.status(job_id)["nodes"][0].get("checkpoint") or {}).get(
                "last_save"):
            assert time.monotonic() < deadline, orchestrator.status(job_id)["nodes"]
            time.sleep(0.2)
        dom = _render(_chromium(), s.url(f"/jobs/{job_id}"))
        (line,) = [text for a, text in dom.find("div") if "checkpoint" in (a.get("class") or "")]
        assert re.fullmatch(r"checkpoints \d+ MiB, step \d+ · save of \d+ MiB held [\d.]+ s",
                            line), line
    finally:
        s.close()
        orchestrator.cancel(job_id, wait_seconds=30)


def test_a_drained_nodes_card_says_so_and_why(home, tmp_path):
    """A drain the job cannot do without (no spare) leaves the node running: its card says
    it is drained and why, while the job runs."""
    from tests.integration.test_drain import train_spec

    out = tmp_path / "out"
    out.mkdir()
    spec = train_spec(tmp_path, [{"host": "local"}] * 2, out)
    spec["env"]["STEPS"] = "1000"  # runs while the page is looked at
    job_id = orchestrator.submit(write_spec(tmp_path, spec))
    s = _Server(home, auth=True)
    try:
        deadline = time.monotonic() + 120
        while orchestrator.status(job_id)["state"] != "RUNNING":
            assert time.monotonic() < deadline, orchestrator.status(job_id)["failure"]
            time.sleep(0.2)
        orchestrator.drain_node("1", job=job_id, reason="maintenance")
        dom = _render(_chromium(), s.url(f"/jobs/{job_id}"))
        badges = [text for a, text in dom.find("span") if "drained" in (a.get("class") or "")]
        assert badges == ["drained: maintenance"], badges
    finally:
        s.close()
        orchestrator.cancel(job_id, wait_seconds=30)
