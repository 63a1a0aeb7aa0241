"""The web dashboard and Prometheus endpoint: ``orchestrator ui``.

A read-only view of the state store, served by Starlette under uvicorn:

- ``/`` the job list, ``/jobs/<id>`` a job page (static HTML and one script; no build step);
- ``/api/jobs``, ``/api/jobs/<id>`` (the status dict), ``/api/jobs/<id>/samples?rank=R``
  (metric history), ``/api/jobs/<id>/logs?rank=R&lines=N`` (the current attempt's last
  lines); a number out of its bounds (rank 0..MAX_RANK, lines 1..MAX_LINES) is a 400;
- ``/metrics``: Prometheus text, ``orchestrator_*`` (see :mod:`orchestrator.ui.metrics`).

Every request needs the token, on loopback too (as Jupyter does): every
local user can reach 127.0.0.1, and job logs, stacks and the torch store's address are not
for them. A request gives it as ``Authorization: Bearer <token>``, or once as ``?token=``:
that opens a session, whose id (never the token) goes in a cookie named after the port, so
that dashboards on two ports of a host never see each other's; a session ends
SESSION_LIFETIME after it was opened, however much it is used. The token is made at start
and printed, or taken from ``$ORCHESTRATOR_UI_TOKEN`` (at least MIN_TOKEN characters) and
then never printed (a service's log keeps what it prints). It binds 127.0.0.1
unless told otherwise; elsewhere ``certfile``/``keyfile`` serve HTTPS (plain HTTP carries
the token in clear: a warning says so). On loopback the ``Host`` header must name loopback
too, so that a web page cannot reach the dashboard through DNS rebinding.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents.fields import MAX_RANK
from orchestrator import api
from orchestrator.errors import JobNotFoundError, StoreError
from orchestrator.store import Store, check_job_id

STATIC = Path(__file__).resolve().parent / "static"
COOKIE = "orchestrator_ui_{port}"  # one name per port: browsers send cookies to every port
TOKEN_VAR = "ORCHESTRATOR_UI_TOKEN"  # a fixed token for deployments; never on a command line
MIN_TOKEN = 24  # characters: a guessable token is no protection
MAX_SESSIONS = 1024  # the oldest goes first
# A session ends this long after the token opened it, used or not. Absolute, not idle: the
# page polls every few seconds, so an idle limit would never end the session of a tab left
# open on an unlocked screen, nor bound what a copied cookie is worth. Twelve hours covers a
# working day or a night's on-call shift without a second login; the next day needs the token
# again. Enforced here (the cookie's Max-Age only tells the browser to forget it).
SESSION_LIFETIME = 12 * 3600.0
MAX_LINES = 5000  # the most log lines one request returns
_NUMBER = re.compile(r"[0-9]{1,10}")  # ASCII: int() also takes " 3", "+3", other digits
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}
TAIL_BYTES = 4 * 1024 * 1024  # the most of a log the tail endpoint reads per request
# Browsers must run only our own script, and show job text as text (see static/app.js).
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def create_app(home: str | os.PathLike[str] | None = None, *, token: str, port: int,
               loopback: bool = True, secure: bool = False,
               session_lifetime: float = SESSION_LIFETIME,
               clock: Callable[[], float] = time.monotonic) -> Any:
    """The ASGI app; ``token`` is required of every request (see above). ``port`` names the
    session cookie; ``secure``: served over HTTPS (the cookie is then Secure);
    ``session_lifetime``: seconds a session lasts, by ``clock`` (monotonic: a step of the
    wall clock neither ends nor extends one)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    from orchestrator.ui.metrics import exposition

    def page(_request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-store"})

    def jobs(_request: Request) -> Response:
        return JSONResponse(api.list_jobs(home=home))

    def job(request: Request) -> Response:
        return JSONResponse(api.status(_job_id(request), home=home))

    def samples(request: Request) -> Response:
        job_id, rank = _job_id(request), _int_arg(request, "rank", 0, MAX_RANK)
        store = Store(home)
        try:
            store.get_job(job_id)  # 404 for an unknown job, not an empty list
            rows = store.samples(job_id, rank=rank)
        finally:
            store.close()
        return JSONResponse([{"attempt": a, "rank": r, "step": s, "at": at, "metrics": m}
                             for a, r, s, at, m in rows])

    def logs(request: Request) -> Response:
        lines = _int_arg(request, "lines", 1, MAX_LINES)
        rank = _int_arg(request, "rank", 0, MAX_RANK)
        return JSONResponse(api.log_tail(_job_id(request), rank=rank,
                                         lines=200 if lines is None else lines,
                                         max_bytes=TAIL_BYTES, home=home))

    def metrics(_request: Request) -> Response:
        body, content_type = exposition(home)
        return Response(body, media_type=content_type)

    async def not_found(_request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": str(exc)}, status_code=404)

    async def bad_request(_request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": str(exc)}, status_code=400)

    app = Starlette(
        routes=[
            Route("/", page), Route("/jobs/{job_id}", page),
            Route("/api/jobs", jobs), Route("/api/jobs/{job_id}", job),
            Route("/api/jobs/{job_id}/samples", samples),
            Route("/api/jobs/{job_id}/logs", logs),
            Route("/metrics", metrics),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        exception_handlers={JobNotFoundError: not_found, ValueError: bad_request,
                            StoreError: not_found},
    )
    return _Guard(app, token, loopback, COOKIE.format(port=port), secure, session_lifetime,
                  clock)


class _Guard:
    """ASGI middleware: the token or a live session, the Host check on loopback, GET only,
    and the security headers on every answer."""

    def __init__(self, app: Any, token: str, loopback: bool, cookie: str, secure: bool,
                 lifetime: float, clock: Callable[[], float]):
        if len(token) < MIN_TOKEN:
            raise ValueError(f"the dashboard's token must have at least {MIN_TOKEN} characters")
        if not lifetime > 0:
            raise ValueError("a session's lifetime must be positive")
        self.app, self.token, self.loopback = app, token, loopback
        self.cookie, self.secure, self.lifetime, self.clock = cookie, secure, lifetime, clock
        # session id -> when it ends; in the order opened, so also in the order they end
        self.sessions: collections.OrderedDict[str, float] = collections.OrderedDict()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from starlette.requests import Request
        from starlette.responses import PlainTextResponse, RedirectResponse

        request = Request(scope)
        host = (request.headers.get("host") or "").rsplit(":", 1)[0]
        problem: tuple[int, str] | None = None
        given = request.query_params.get("token")
        if request.method not in ("GET", "HEAD"):
            problem = (405, "read-only")
        elif self.loopback and host not in LOOPBACK_HOSTS:
            problem = (400, "this dashboard answers to loopback names only")
        elif not self._authorized(request, given):
            problem = (401, "a token is needed (a session lasts "
                            f"{self.lifetime / 3600:g} h): open the dashboard's URL with "
                            "?token=<its token>")
        if problem is not None:
            response: Any = PlainTextResponse(problem[1], status_code=problem[0])
        elif given is not None:
            # Swap the token in the URL for a session, so that it leaves the address bar and
            # the cookie never holds it.
            url = request.url.remove_query_params("token")
            response = RedirectResponse(str(url.path) + (f"?{url.query}" if url.query else ""),
                                        status_code=303)
            response.set_cookie(self.cookie, self._new_session(), max_age=int(self.lifetime),
                                httponly=True, samesite="strict", secure=self.secure)
        else:
            await self.app(scope, receive, _with_headers(send))
            return
        await response(scope, receive, _with_headers(send))

    def _authorized(self, request: Any, given: str | None) -> bool:
        auth = request.headers.get("authorization") or ""
        offered = [given, auth[len("Bearer "):] if auth.startswith("Bearer ") else None]
        if any(t is not None and hmac.compare_digest(t.encode(), self.token.encode())
               for t in offered):
            return True
        session = request.cookies.get(self.cookie)
        ends = self.sessions.get(session) if session is not None else None
        if ends is None:
            return False
        if self.clock() >= ends:  # over: answered as if it had never been
            del self.sessions[session]
            return False
        return True

    def _new_session(self) -> str:
        now = self.clock()
        while self.sessions and next(iter(self.sessions.values())) <= now:
            self.sessions.popitem(last=False)  # ended: no memory kept for them
        session = secrets.token_urlsafe(32)
        self.sessions[session] = now + self.lifetime
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)
        return session


def _with_headers(send: Any) -> Any:
    async def sender(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message.setdefault("headers", [])
            message["headers"] = list(message["headers"]) + [
                (k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
        await send(message)
    return sender


def _job_id(request: Any) -> str:
    return check_job_id(request.path_params["job_id"])


def _int_arg(request: Any, name: str, low: int, high: int) -> int | None:
    """The query parameter ``name`` as an integer in low..high (None when absent or empty);
    anything else is a ValueError (a 400) that does not repeat the value: a number SQLite
    cannot hold was a 500, and a long one costs int() time."""
    value = request.query_params.get(name)
    if value in (None, ""):
        return None
    if not _NUMBER.fullmatch(value) or not low <= int(value) <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}")
    return int(value)


def serve(host: str = "127.0.0.1", port: int = 8265, *,
          home: str | os.PathLike[str] | None = None, certfile: str | None = None,
          keyfile: str | None = None, announce: Any = print) -> None:
    """Run the dashboard until interrupted, announcing its URL: with the token when it is
    made here; without it when it is taken from ``$ORCHESTRATOR_UI_TOKEN``, whoever set it
    knows it, and what is announced ends up in logs (a service's journal keeps it).
    ``certfile``/``keyfile``: HTTPS."""
    import socket

    import uvicorn

    given = os.environ.get(TOKEN_VAR)
    token = given or secrets.token_urlsafe(32)
    if len(token) < MIN_TOKEN:
        raise ValueError(f"${TOKEN_VAR} is shorter than {MIN_TOKEN} characters: a token that "
                         "short can be guessed")
    if (certfile is None) != (keyfile is None):
        raise ValueError("--certfile and --keyfile go together")
    loopback, secure = is_loopback(host), certfile is not None
    # Bound here, before anything is announced: a port in use is one clear error (OSError).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    app = create_app(home, token=token, port=port, loopback=loopback, secure=secure)
    # A browser's idle keep-alive connection must not hold Ctrl-C up for long.
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            ssl_certfile=certfile, ssl_keyfile=keyfile,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    shown = socket.gethostname() if host in ("0.0.0.0", "::") else (
        f"[{host}]" if ":" in host else host)
    scheme = "https" if secure else "http"
    url = f"{scheme}://{shown}:{port}/"
    hours = f"{SESSION_LIFETIME / 3600:g}"
    if given:
        opening = (f"dashboard: {url}\n"
                   f"token:     from ${TOKEN_VAR} (not printed); open {url}?token=<it> once "
                   f"(a session lasts {hours} h)\n")
    else:
        opening = (f"dashboard: {url}?token={token}\n"
                   f"token:     made at start; a session lasts {hours} h, then open this URL "
                   "again\n")
    announce(opening
             + f"metrics:   {url}metrics  (Authorization: Bearer <the token>)\n"
             + ("loopback only (--host to share it); " if loopback else "")
             + "anyone with this token can read every job's logs: share it as a secret")
    if not loopback and not secure:
        announce("warning: plain HTTP off loopback: the token and every page cross the network "
                 "in clear; give --certfile/--keyfile, or reach it through an SSH tunnel")
    server.run(sockets=[sock])
