"""The web dashboard and Prometheus endpoint: ``orchestrator ui``.

A read-only view of the state store, served by Starlette under uvicorn:

- ``/`` the job list, ``/jobs/<id>`` a job page (static HTML and one script; no build step);
- ``/api/jobs``, ``/api/jobs/<id>`` (the status dict), ``/api/jobs/<id>/samples`` (metric
  history), ``/api/jobs/<id>/logs?rank=R&lines=N`` (the current attempt's last lines);
- ``/metrics``: Prometheus text, ``orchestrator_*`` (see :mod:`orchestrator.ui.metrics`).

It binds 127.0.0.1 unless told otherwise. On any other address every request needs the token
printed at start (``Authorization: Bearer``, or ``?token=`` once, which sets a cookie): job
logs and stacks are not for everyone on the network. On loopback the ``Host`` header must name
loopback too, so that a web page cannot reach the dashboard through DNS rebinding.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from pathlib import Path
from typing import Any

from orchestrator import api
from orchestrator.errors import JobNotFoundError, StoreError
from orchestrator.store import Store, check_job_id

STATIC = Path(__file__).resolve().parent / "static"
COOKIE = "orchestrator_ui_token"
TOKEN_VAR = "ORCHESTRATOR_UI_TOKEN"  # a fixed token for deployments; never on a command line
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


def create_app(home: str | os.PathLike[str] | None = None, *, token: str | None = None,
               loopback: bool = True) -> Any:
    """The ASGI app. ``token``: required of every request (None: none required)."""
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
        job_id, rank = _job_id(request), _int_arg(request, "rank")
        store = Store(home)
        try:
            store.get_job(job_id)  # 404 for an unknown job, not an empty list
            rows = store.samples(job_id, rank=rank)
        finally:
            store.close()
        return JSONResponse([{"attempt": a, "rank": r, "step": s, "at": at, "metrics": m}
                             for a, r, s, at, m in rows])

    def logs(request: Request) -> Response:
        lines = min(_int_arg(request, "lines") or 200, 5000)
        return JSONResponse(api.log_tail(_job_id(request), rank=_int_arg(request, "rank"),
                                         lines=lines, max_bytes=TAIL_BYTES, home=home))

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
    return _Guard(app, token, loopback)


class _Guard:
    """ASGI middleware: the token (when one is set), the Host check on loopback, GET only,
    and the security headers on every answer."""

    def __init__(self, app: Any, token: str | None, loopback: bool):
        self.app, self.token, self.loopback = app, token, loopback

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
        elif self.token is not None and not self._authorized(request, given):
            problem = (401, "a token is needed: open the URL `orchestrator ui` printed")
        if problem is not None:
            response: Any = PlainTextResponse(problem[1], status_code=problem[0])
        elif given is not None and self.token is not None:
            # Swap the token in the URL for a cookie, so that it leaves the address bar.
            url = request.url.remove_query_params("token")
            response = RedirectResponse(str(url.path) + (f"?{url.query}" if url.query else ""),
                                        status_code=303)
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
        else:
            await self.app(scope, receive, _with_headers(send))
            return
        await response(scope, receive, _with_headers(send))

    def _authorized(self, request: Any, given: str | None) -> bool:
        assert self.token is not None
        auth = request.headers.get("authorization") or ""
        offered = [given, request.cookies.get(COOKIE),
                   auth[len("Bearer "):] if auth.startswith("Bearer ") else None]
        return any(t is not None and hmac.compare_digest(t.encode(), self.token.encode())
                   for t in offered)


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


def _int_arg(request: Any, name: str) -> int | None:
    value = request.query_params.get(name)
    if value in (None, ""):
        return None
    if not value.lstrip("-").isdigit():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def serve(host: str = "127.0.0.1", port: int = 8265, *,
          home: str | os.PathLike[str] | None = None, announce: Any = print) -> None:
    """Run the dashboard until interrupted. Off loopback, a token is made (or taken from
    ``$ORCHESTRATOR_UI_TOKEN``) and the URL holding it is announced."""
    import uvicorn

    loopback = is_loopback(host)
    token = None if loopback else (os.environ.get(TOKEN_VAR) or secrets.token_urlsafe(24))
    app = create_app(home, token=token, loopback=loopback)
    import socket

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
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    shown = socket.gethostname() if host in ("0.0.0.0", "::") else (
        f"[{host}]" if ":" in host else host)
    if token is None:
        announce(f"dashboard: http://{shown}:{port}/  (loopback only; --host to share it)")
    else:
        announce(f"dashboard: http://{shown}:{port}/?token={token}\n"
                 f"metrics:   http://{shown}:{port}/metrics  (Authorization: Bearer {token})\n"
                 "anyone with this token can read every job's logs: share it as a secret")
    server.run(sockets=[sock])
