"""The small files a worker writes for its agent: its heartbeat (``heartbeat()``: step and
metrics), its sampler's counts (``waits-<rank>.json``) and torch's error file.

They are the worker's, so they may hold anything: any depth, size, encoding or type, a FIFO
or a device in their place. Whatever they hold is that rank's problem, never the agent's:
each reader returns what it could use and, for anything it could not, a one-line problem the
agent puts in that rank's log. What leaves here is always of the shape the protocol checks
(``agents/protocol.py``), so a worker's file can never make its node look broken.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from agents.fields import MAX_COUNT, finite, unicode

MAX_HEARTBEAT = 16 * 1024  # bytes read of a heartbeat file
MAX_WAITS = 4 * 1024
MAX_ERROR_FILE = 64 * 1024
MAX_METRICS = 256  # as the protocol allows
MAX_METRIC_NAME = 128


def read_small(path: str, limit: int) -> bytes | None:
    """At most ``limit`` bytes of a regular file; None when it is missing, unreadable or not
    a regular file (a FIFO would block the reader, a device never end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def small_json(path: str, limit: int) -> Any:
    """The JSON document of a small regular file, or None (missing, larger, not JSON)."""
    data = read_small(path, limit + 1)
    if not data or len(data) > limit:
        return None
    return _json(data)[0]


def _json(data: bytes) -> tuple[Any, str | None]:
    """The decoded document, or (None, why not)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "is not UTF-8"
    try:
        return json.loads(text), None
    except RecursionError:
        return None, "is nested too deep"
    except ValueError as exc:  # also integers of more than 4,300 digits
        return None, f"is not JSON ({str(exc)[:80]})"


def heartbeat(path: str) -> tuple[dict[str, Any] | None, list[str]]:
    """``({"step": int | None, "metrics": {name: finite float}}, problems)``, with
    ``total_steps`` (a positive int) when the worker gave one; the record is
    None when there was nothing to use (an empty file is a plain heartbeat, no problem)."""
    data = read_small(path, MAX_HEARTBEAT + 1)
    if not data:
        return None, []
    if len(data) > MAX_HEARTBEAT:
        return None, [f"heartbeat file is over {MAX_HEARTBEAT} bytes: ignored"]
    record, why = _json(data)
    if why is not None:  # heartbeat() replaces the file whole: a half-written one is not it
        return None, [f"heartbeat file {why}"]
    if not isinstance(record, dict):
        return None, [f"heartbeat file holds a {type(record).__name__}, not an object"]
    problems = []
    step = record.get("step")
    if step is not None and (type(step) is not int or abs(step) >= MAX_COUNT):
        problems.append(f"heartbeat step {_short(step)} is not an integer below 2**62")
        step = None
    raw = record.get("metrics") or {}
    if not isinstance(raw, dict):
        problems.append(f"heartbeat metrics are a {type(raw).__name__}, not an object")
        raw = {}
    metrics: dict[str, float] = {}
    for name, value in raw.items():
        if len(metrics) == MAX_METRICS:
            problems.append(f"heartbeat has {len(raw)} metrics: only the first "
                            f"{MAX_METRICS} are kept")
            break
        number = finite(value)
        if not unicode(str(name)):  # a lone surrogate ("\\ud800"): no JSON line holds it
            problems.append(f"heartbeat metric {_short(name)} has a name that is not valid "
                            "Unicode: not kept")
            continue
        if number is None:
            problems.append(f"heartbeat metric {_short(name)} = {_short(value)} is not a "
                            "finite number: not kept")
            continue
        metrics[str(name)[:MAX_METRIC_NAME]] = number
    kept: dict[str, Any] = {"step": step, "metrics": metrics}
    total = record.get("total_steps")
    if total is not None:
        if type(total) is int and 0 < total < MAX_COUNT:
            kept["total_steps"] = total
        else:
            problems.append(f"heartbeat total_steps {_short(total)} is not an integer "
                            "from 1 to 2**62: ignored")
    return kept, problems


def waits(path: str) -> tuple[list[int] | None, str | None]:
    """The sampler's ``[samples, of them waiting]``, or (None, the problem)."""
    data = read_small(path, MAX_WAITS + 1)
    if data is None:
        return None, None
    record, why = _json(data[:MAX_WAITS])
    if why is not None:
        return None, f"sampler file {why}"
    try:
        samples, waiting = record["samples"], record["waiting"]
    except (TypeError, KeyError, IndexError):
        return None, "sampler file lacks samples/waiting"
    if not all(type(n) is int and 0 <= n < MAX_COUNT for n in (samples, waiting)):
        return None, "sampler counts are not integers"
    return [samples, waiting], None


def error_file(path: str | None) -> str | None:
    """The first ``MAX_ERROR_FILE`` bytes of torch's error file, as text whatever its bytes
    (the controller reads torch's message out of it, and survives any content)."""
    if not path:
        return None
    data = read_small(path, MAX_ERROR_FILE)
    return None if data is None else data.decode("utf-8", "replace")


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # deep lists; ints past the str limit
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."
