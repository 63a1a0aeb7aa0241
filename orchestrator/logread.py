"""Reading the log files the controller writes (orchestrator/logfiles.py), with no silent
gap: a :class:`Follower` reads one file's lines as they come, across the head, the tail
segments and the close, with a cut marker naming how many lines wherever lines were cut
before it saw them; :func:`tail_lines` reads a file's last lines from its end."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.logfiles import cut_marker, read_json, sidecar


class Follower:
    """Reads one log file's lines as they are written, across the head, the tail segments
    and the close (see the module's docstring), with a cut marker, naming how many lines,
    wherever lines were cut before this reader saw them."""

    def __init__(self, path: Path):
        self.path = path
        self.line = 0  # the number (in the whole output) of the next line to read
        self.segment: int | None = None  # reading this tail segment, else the file itself
        self.offset = 0  # in the segment, or in the file
        self.plain = False  # past the head of a closed file: just its remaining bytes

    def read(self) -> list[str]:
        """Every complete line written since the last read (cut markers included)."""
        out: list[str] = []
        while self._step(read_json(sidecar(self.path)), out):
            pass
        return out

    def _step(self, layout: dict[str, Any] | None, out: list[str]) -> bool:
        """Read what one source has; True when the reader moved on (call again)."""
        if layout is None or self.plain or (self.segment is None and
                                            self.offset < int(layout["head_bytes"])):
            end = None if layout is None or self.plain else int(layout["head_bytes"])
            got, self.offset = _lines(self.path, self.offset, end)
            self.line += len(got)
            out += got
            at_head_end = end is not None and self.offset >= end
            return bool(got) and not at_head_end or at_head_end
        if layout["closed"]:
            return self._into_closed(layout, out)
        starts = {int(k): int(s) for k, s in layout["segments"]}
        if self.segment not in starts:  # past the head, or its segment was dropped meanwhile
            first = min(starts, key=starts.get)  # type: ignore[arg-type]
            self._cut(starts[first] - self.line, layout, out)
            self.segment, self.offset, self.line = first, 0, starts[first]
            return True
        got, self.offset = _lines(self._segment_path(self.segment), self.offset, None)
        self.line += len(got)
        out += got
        after = [k for k in starts if k > self.segment]
        if after and self.line >= starts[min(after)]:  # that one is complete: the next
            self.segment, self.offset = min(after), 0
            return True
        return bool(got)

    def _into_closed(self, layout: dict[str, Any], out: list[str]) -> bool:
        """The file closed while this reader was past its head: the kept tail now follows the
        marker in the file itself."""
        base = int(layout["head_bytes"]) + int(layout["marker_bytes"])
        tail = [(int(k), int(s), int(n)) for k, s, n in layout["tail"]]
        before = 0
        for k, _, size in tail:
            if k == self.segment:
                self.offset = base + before + self.offset
                break
            before += size
        else:  # its segment was dropped before the close
            first = tail[0][1] if tail else self.line
            self._cut(first - self.line, layout, out)
            self.offset, self.line = base, max(self.line, first)
        self.plain, self.segment = True, None
        return True

    def _cut(self, count: int, layout: dict[str, Any], out: list[str]) -> None:
        if count > 0:
            out.append(cut_marker(count, None, layout.get("cap")))
            self.line += count

    def _segment_path(self, k: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.tail{k}.log")


def _lines(path: Path, offset: int, end: int | None) -> tuple[list[str], int]:
    """Complete lines of ``path`` from ``offset`` (up to ``end``), and the new offset."""
    try:
        f = open(path, "rb")  # noqa: SIM115
    except OSError:
        return [], offset
    with f:
        f.seek(offset)
        data = f.read() if end is None else f.read(max(0, end - offset))
    cut = data.rfind(b"\n") + 1
    if cut == 0:
        return [], offset
    return data[:cut - 1].decode("utf-8", "replace").split("\n"), offset + cut


def tail_lines(path: Path, count: int, max_bytes: int,
               keep: Callable[[str], bool] = lambda _: True) -> tuple[list[str], bool]:
    """The last ``count`` lines of a log that ``keep`` accepts (a cut marker where lines were
    cut), read from the end: at most ``max_bytes``, so that a poll costs the same whatever the
    log's size. Returns the lines and whether the read stopped at ``max_bytes`` first."""
    layout = read_json(sidecar(path))
    parts: list[tuple[Path, int, int | None] | str] = [(path, 0, None)]
    if layout is not None and not layout["closed"]:
        parts = [(path, 0, int(layout["head_bytes"]))]
        first = min((int(s) for _, s in layout["segments"]), default=0)
        cut = first - int(layout["head_lines"])
        if cut > 0:
            parts.append(cut_marker(cut, None, layout.get("cap")))
        parts += [(path.with_name(f"{path.stem}.tail{int(k)}.log"), 0, None)
                  for k, _ in sorted(layout["segments"])]
    found: deque[str] = deque(maxlen=max(0, count))
    budget, partial = max_bytes, False
    for part in reversed(parts):
        if len(found) >= count:
            break
        if isinstance(part, str):
            if keep(part):
                found.appendleft(part)
            continue
        lines, used, stopped = _read_back(*part, budget)
        budget -= used
        for line in reversed(lines):
            if len(found) >= count:
                break
            if keep(line):
                found.appendleft(line)
        if stopped:
            partial = len(found) < count
            break
    return list(found), partial


def _read_back(path: Path, start: int, end: int | None, budget: int
               ) -> tuple[list[str], int, bool]:
    """The complete lines of ``path`` between ``start`` and ``end`` that fit in the last
    ``budget`` bytes; the bytes read; whether the budget ended the read."""
    try:
        f = open(path, "rb")  # noqa: SIM115
    except OSError:
        return [], 0, False
    with f:
        size = f.seek(0, os.SEEK_END)
        stop = size if end is None else min(end, size)
        begin = max(start, stop - max(0, budget))
        f.seek(begin)
        data = f.read(stop - begin)
    stopped = begin > start
    if stopped:
        data = data[data.find(b"\n") + 1:]  # a line cut by the window is not shown
    data = data[:data.rfind(b"\n") + 1]  # nor a line still being written
    text = data.decode("utf-8", "replace")
    return (text[:-1].split("\n") if text else []), stop - begin, stopped

