"""Log files: written by the controller (LogSink, CappedLog), read by everyone else (Follower,
tail_lines), with no silent gap between the two.

Each rank's output goes to ``rank-<label>.log`` and, prefixed ``[host:label] ``, to
``combined.log``. A capped log keeps its head (the first half of the cap) in its file and,
once that is full, its tail in segments beside it (``<stem>.tail<k>.log``, the oldest dropped
and counted as cut when a third starts); when the attempt ends the kept tail is put back into
the file after a marker that says how much was cut. While a log is cut, a small sidecar
(``<file>.cut.json``, rewritten only when a segment starts, is dropped, or the file closes)
says where the head ends, which segments hold which lines and, once closed, where the tail
went: so a reader shows the marker with its count at the place lines were cut, follows lines
into the segments while the attempt runs, and finds its place again after the close.
Below ``logs.min_free_bytes`` free on its filesystem a sink writes nothing more and raises
ENOSPC: the controller pauses (orchestrator/pause.py) and the lines wait in the agents'
spools. ``labels`` says on which host each label ran.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

STDERR_TAIL = 20  # lines of a failing rank's stderr kept for the failure message
LABELS = "labels"


def cut_marker(lines: int, cut_bytes: int | None, cap: int | None) -> str:
    """The line that stands where lines were cut (no newline)."""
    size = f" ({cut_bytes} bytes)" if cut_bytes is not None else ""
    return (f"[orchestrator] {lines} lines{size} cut here: this log keeps its first and last "
            f"part, {cap} bytes in all (logs.max_bytes_per_rank)")


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".cut.json")


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class CappedLog:
    """One log file that keeps its first half of ``cap`` bytes and, past that, the last
    quarter to half: lines go to tail segments beside it (``<stem>.tail<k>.log``), the
    oldest of which is dropped, and counted, when a third one starts. ``close`` puts the
    tail back after a marker that says how much was cut. ``cap`` None: no cap. The sidecar
    (see the module's docstring) tells readers the layout while it is cut.

    Writes are kept in memory and reach the files at the next ``sizes()`` (a checkpoint,
    which runs that on a pool of threads for many files at once), or when a file has more
    than FLUSH_AT waiting: the controller's loop does no file system call per line, and
    opens no file itself for the thousands of ranks that print their first line at once
    (each call lets go of the GIL, and with other busy threads the loop waits to get it
    back: a convoy that made a 4,000-rank launch take seconds of opens)."""

    FLUSH_AT = 1 << 20  # bytes waiting for one file before they are written at once

    def __init__(self, path: Path, cap: int | None, state: dict[str, Any] | None = None,
                 buffering: int = -1, *, fresh: bool = False):
        self.path = path
        self.cap = cap
        self._buffering = buffering
        state = state or {}
        self.segments: list[int] = [int(k) for k in state.get("segments", [])]
        self.segment_lines = {int(k): int(v) for k, v in state.get("segment_lines", {}).items()}
        self.cut_lines = int(state.get("cut_lines", 0))
        self.cut_bytes = int(state.get("cut_bytes", 0))
        self.head_lines = int(state.get("head_lines", 0))
        self.head_bytes = state.get("head_bytes")
        # The number of each segment's first line in the whole output (head line 0 is 0).
        self.starts = {int(k): int(v) for k, v in state.get("starts", {}).items()}
        # A dropped segment's file goes only once a checkpoint has counted it as cut: a
        # replaced controller must not count the replayed lines twice.
        self._synced: dict[str, int] = {}  # file name -> size at its last fsync
        self._dropped: list[Path] = []  # not yet in any state()
        self._deletable: list[Path] = []  # in the last state(): gone at the next flush
        self._waiting: list[tuple[int | None, bytes]] = []  # (segment, or None: the head)
        self._waiting_bytes = 0
        self._open: dict[int | None, Any] = {}  # the head's and the current segment's files
        # ``fresh``: a new attempt's file, which has no strays, no sidecar and no size.
        self.main_size = self.current_size = 0
        if not fresh and path.exists():
            for stray in path.parent.glob(f"{path.stem}.tail*.log"):  # begun after a checkpoint
                if stray.name not in {self._segment(k).name for k in self.segments}:
                    stray.unlink()
            self.main_size = path.stat().st_size
            if self.segments:
                self.current_size = self._segment(self.segments[-1]).stat().st_size \
                    if self._segment(self.segments[-1]).exists() else 0
        self.segment_bytes = {k: 0 for k in self.segments}  # of segments written by us
        if self.segments:
            self.segment_bytes[self.segments[-1]] = self.current_size
            self._restore_layout()
        elif not fresh:
            sidecar(path).unlink(missing_ok=True)  # one begun after the checkpoint

    def _restore_layout(self) -> None:
        """After a checkpoint of an older version: what its state did not hold yet."""
        if self.head_bytes is None:
            self.head_bytes = self.main_size
            with open(self.path, "rb") as f:
                self.head_lines = sum(block.count(b"\n") for block in iter(
                    lambda: f.read(1 << 20), b""))
        if not all(k in self.starts for k in self.segments):
            start = self.head_lines + self.cut_lines
            for k in self.segments:
                self.starts[k] = start
                start += self.segment_lines.get(k, 0)
        self._write_layout()

    def _segment(self, k: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.tail{k}.log")

    def _put(self, target: int | None, data: bytes) -> None:
        self._waiting.append((target, data))
        self._waiting_bytes += len(data)
        if self._waiting_bytes > self.FLUSH_AT:
            self._drain()

    def _drain(self) -> None:
        """Write what waits, to the head or its segment (opening files as needed)."""
        for target, data in self._waiting:
            f = self._open.get(target)
            if f is None:
                if target is not None:  # a newer segment: the older one is complete
                    for old in [k for k in self._open if k is not None]:
                        self._open.pop(old).close()
                path = self.path if target is None else self._segment(target)
                f = self._open[target] = open(path, "ab",  # noqa: SIM115
                                              self._buffering if target is None else -1)
            f.write(data)
        self._waiting, self._waiting_bytes = [], 0

    def write(self, data: bytes) -> None:
        """Whole lines (``data`` ends with a newline); split at line ends where a part of
        the file fills up."""
        if self.cap is None:
            self._put(None, data)
            self.main_size += len(data)
            return
        while data:
            if not self.segments:  # still in the head
                room = self.cap // 2 - self.main_size
                if len(data) <= room:
                    self._put(None, data)
                    self.main_size += len(data)
                    self.head_lines += data.count(b"\n")
                    return
                cut = data.rfind(b"\n", 0, max(0, room)) + 1
                self._put(None, data[:cut])
                self.main_size += cut
                self.head_lines += data.count(b"\n", 0, cut)
                data = data[cut:]
                self._next_segment()
                continue
            room = self.cap // 4 - self.current_size
            cut = len(data) if len(data) <= room else data.rfind(b"\n", 0, max(0, room)) + 1
            if cut == 0:
                if self.current_size > 0:
                    self._next_segment()
                    continue
                cut = data.find(b"\n") + 1 or len(data)  # one line longer than a segment
            k = self.segments[-1]
            self._put(k, data[:cut])
            self.current_size += cut
            self.segment_bytes[k] += cut
            self.segment_lines[k] += data.count(b"\n", 0, cut)
            data = data[cut:]
            if data:
                self._next_segment()

    def _next_segment(self) -> None:
        if not self.segments:
            self.head_bytes = self.main_size
        k = self.segments[-1] + 1 if self.segments else 0
        self.starts[k] = self.head_lines + self.cut_lines + sum(
            self.segment_lines[j] for j in self.segments)
        self.segments.append(k)
        self.segment_lines[k] = self.segment_bytes[k] = 0
        self.current_size = 0
        while len(self.segments) > 2:
            old = self.segments.pop(0)
            self.cut_bytes += self.segment_bytes.pop(old)
            self.cut_lines += self.segment_lines.pop(old)
            self.starts.pop(old, None)
            self._waiting = [(t, d) for t, d in self._waiting if t != old]  # never written
            self._waiting_bytes = sum(len(d) for _, d in self._waiting)
            if old in self._open:
                self._open.pop(old).close()
            self._dropped.append(self._segment(old))
        self._write_layout()

    def _write_layout(self) -> None:
        """The sidecar while the tail is in segments (rewritten per segment, not per line)."""
        _write_json(sidecar(self.path), {
            "closed": False, "cap": self.cap, "head_bytes": self.head_bytes,
            "head_lines": self.head_lines, "cut_lines": self.cut_lines,
            "cut_bytes": self.cut_bytes, "segments": [[k, self.starts[k]] for k in self.segments]})

    def sizes(self, sync: bool = True) -> dict[str, int]:
        """Written, flushed and on disk (fsync; ``sync`` False: the caller syncs the whole
        filesystem): a checkpoint records these sizes, and then the agents forget what they
        sent, so the bytes must survive a crash of this host."""
        for path in self._deletable:
            path.unlink(missing_ok=True)
        self._deletable = []
        self._drain()
        out = {self.path.name: self.main_size}
        if self.segments:
            out[self._segment(self.segments[-1]).name] = self.current_size
        for target, f in self._open.items():
            f.flush()
            name = self.path.name if target is None else self._segment(target).name
            size = out.get(name)
            if size is not None and size != self._synced.get(name):
                if sync:
                    os.fsync(f.fileno())
                self._synced[name] = size
        return out

    def state(self) -> dict[str, Any]:
        """For the checkpoint, taken after sizes()."""
        self._deletable += self._dropped
        self._dropped = []
        return {"segments": list(self.segments), "segment_lines": dict(self.segment_lines),
                "cut_lines": self.cut_lines, "cut_bytes": self.cut_bytes,
                "head_lines": self.head_lines, "head_bytes": self.head_bytes,
                "starts": dict(self.starts)}

    @property
    def descriptors(self) -> int:
        return len(self._open)

    def release(self) -> None:
        """Close the files (after a checkpoint wrote and synced them): they open again at
        the next write that reaches them. Descriptors are a budget (LogSink)."""
        for f in self._open.values():
            f.close()
        self._open.clear()

    def close(self) -> None:
        """Put the kept tail back after the marker."""
        self._drain()
        for k in [k for k in self._open if k is not None]:
            self._open.pop(k).close()
        main = self._open.pop(None, None) or open(self.path, "ab")  # noqa: SIM115
        marker = b""
        if self.cut_lines:
            marker = (cut_marker(self.cut_lines, self.cut_bytes, self.cap) + "\n").encode()
            main.write(marker)
        tail = []
        for k in self.segments:
            with open(self._segment(k), "ab+") as f:  # (created if it never got a line)
                f.seek(0)
                tail.append([k, self.starts.get(k, 0), os.fstat(f.fileno()).st_size])
                shutil.copyfileobj(f, main)
        main.close()
        if self.segments:  # where a reader that was in a segment finds its place again
            _write_json(sidecar(self.path), {
                "closed": True, "cap": self.cap, "head_bytes": self.head_bytes,
                "head_lines": self.head_lines, "cut_lines": self.cut_lines,
                "marker_bytes": len(marker), "tail": tail})
        for k in self.segments:
            self._segment(k).unlink(missing_ok=True)
        for path in self._dropped + self._deletable:
            path.unlink(missing_ok=True)
        self.segments = []


_pool: ThreadPoolExecutor | None = None
SYNCFS_AT = 256  # files due at one checkpoint beyond which the filesystem is synced once


def _load_syncfs() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not Linux
        return None


_syncfs = _load_syncfs()


SYNC_THREADS = 16


def _sync_pool() -> ThreadPoolExecutor:
    """Threads that flush and fsync log files at a checkpoint (made at first use, so never
    before the supervisor forks the controller)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=SYNC_THREADS, thread_name_prefix="log-sync")
    return _pool


def _on_pool(files: list[CappedLog], step: Callable[[CappedLog], dict[str, int]]
             ) -> list[dict[str, int]]:
    """``step`` of every file, in order, on the pool: a task per thread, each a slice of the
    files, not a task per file (4,000 tasks cost the loop's thread 0.7 s of the pool's own
    locks at the end of a 4,000-rank attempt, benchmarks/scale.md)."""
    size = max(1, -(-len(files) // SYNC_THREADS))
    slices = [files[first:first + size] for first in range(0, len(files), size)]
    done = _sync_pool().map(lambda part: [step(f) for f in part], slices)
    return [sizes for part in done for sizes in part]


class LogSink:
    """Each rank's output, written in batches to ``rank-<label>.log`` and ``combined.log``.

    Writes are buffered; :meth:`flush` returns every file's size, which the controller
    records in its checkpoint. Opening with ``sizes`` cuts every file back to its recorded
    size, so that what the agents replay after a checkpoint is written exactly once. Each
    rank's log is capped at ``cap`` bytes (CappedLog; ``combined.log`` at ``cap`` times the
    ranks). When the filesystem has less than ``min_free`` bytes free, ``write`` raises
    ENOSPC instead of writing (the state database shares that filesystem): the controller
    pauses rather than lose or half-write a line.
    """

    def __init__(self, directory: Path, sizes: dict[str, int] | None = None, *,
                 cap: int | None = None, ranks: int = 1, min_free: int = 0,
                 state: dict[str, Any] | None = None, max_open: int | None = None):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory = directory
        self._restored = dict(sizes or {})  # files this process has not reopened keep these
        # A new attempt's directory: its files are new too (a resumed one's are not).
        self._fresh = sizes is None and not any(directory.glob("*.log"))
        if sizes is not None:
            for path in directory.glob("*.log"):
                with open(path, "r+b") as f:
                    f.truncate(min(sizes.get(path.name, 0), path.stat().st_size))
        self.cap = cap
        self.combined_cap = None if cap is None else cap * max(1, ranks)
        self.min_free = min_free
        state = state or {}
        self._states: dict[str, Any] = dict(state.get("files", {}))
        self.labels = labels(directory)
        # Open log files at most (None: no bound): past it, those written longest ago are
        # closed after a checkpoint, and open again when written to (see release()).
        self.max_open = max_open
        self._recent: dict[str, None] = {}  # file names, least recently written first
        self._labels_file: Any = None  # appended to, kept open while the attempt runs
        self._files: dict[str, CappedLog] = {}
        # Only files written since the last checkpoint are flushed and asked for their state:
        # with thousands of ranks, most are quiet between two checkpoints.
        self._dirty: set[str] = set()
        self._sizes: dict[str, dict[str, int]] = {}  # file -> its last sizes()
        self.stderr: dict[str, deque[str]] = {}
        self._since_check = 0
        self._check_space()

    def _file(self, name: str) -> CappedLog:
        f = self._files.get(name)
        if f is None:
            combined = name == "combined.log"
            # combined.log takes every line: a large buffer, fewer writes (see sizes()).
            state = self._states.get(name)
            f = self._files[name] = CappedLog(self.directory / name,
                                              self.combined_cap if combined else self.cap,
                                              state, buffering=1 << 20 if combined else -1,
                                              fresh=self._fresh and state is None)
        return f

    def _check_space(self) -> None:
        """ENOSPC below ``min_free`` bytes free: nothing more is written here for now."""
        if not self.min_free:
            return
        st = os.statvfs(self.directory)
        if st.f_bavail * st.f_frsize < self.min_free:
            raise OSError(errno.ENOSPC, f"less than {self.min_free} bytes free "
                                        "(logs.min_free_bytes)", str(self.directory))

    def write(self, host: str, label: str, stream: str, lines: list[str]) -> None:
        if not lines:
            return
        if label not in self.labels:  # before its first line can reach the file
            self.labels[label] = host
            if self._labels_file is None:
                self._labels_file = open(self.directory / LABELS, "a", encoding="utf-8")  # noqa: SIM115
            self._labels_file.write(f"{label} {host}\n")
            self._labels_file.flush()
        if stream == "stderr":
            self.stderr.setdefault(label, deque(maxlen=STDERR_TAIL)).extend(lines[-STDERR_TAIL:])
        body = ("\n".join(lines) + "\n").encode()
        name = f"rank-{label}.log"
        self._file(name).write(body)
        if self.max_open is not None:
            self._recent.pop(name, None)
            self._recent[name] = None
        self._dirty.add(name)
        self._dirty.add("combined.log")
        prefix = f"[{host}:{label}] "
        self._file("combined.log").write("".join([prefix + ln + "\n" for ln in lines]).encode())
        self._since_check += len(body)
        if self._since_check > 4 * 1024 * 1024:  # statvfs is cheap, but not per line
            self._since_check = 0
            self._check_space()

    def flush(self) -> dict[str, int]:
        sizes = dict(self._restored)
        due = [(name, f) for name, f in self._files.items()
               if name in self._dirty or f._dropped or f._deletable or name not in self._sizes]
        # Within the descriptor budget: in groups, each closed again once written.
        group = max(1, len(due) if self.max_open is None else self.max_open // 2)
        for first in range(0, len(due), group):
            self._write(due[first:first + group])
            self._release()
        for name in self._files:
            sizes.update(self._sizes[name])
        return sizes

    def _write(self, due: list[tuple[str, CappedLog]]) -> None:
        if len(due) > SYNCFS_AT and _syncfs is not None:
            # Thousands of files (a launch of thousands of ranks): written on the pool, then
            # the filesystem synced once, instead of a journal commit per file.
            written = _on_pool([f for _, f in due], lambda f: f.sizes(sync=False))
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                if _syncfs(fd) != 0:  # refused (an old kernel, a FUSE mount): file by file
                    for _, f in due:  # (the first pass took them as synced)
                        f._synced.clear()
                    written = [f.sizes() for _, f in due]
            finally:
                os.close(fd)
        elif len(due) > 8:
            # fsync lets go of the GIL and, with thousands of busy threads, waits to get it
            # back: a few threads waiting at once instead of the main thread once per file.
            written = _on_pool([f for _, f in due], CappedLog.sizes)
        else:
            written = [f.sizes() for _, f in due]
        for (name, _), got in zip(due, written, strict=True):
            self._sizes[name] = got

    def _release(self) -> None:
        """Keep the open files within ``max_open``: close the least recently written."""
        if self.max_open is None:
            return
        held = sum(f.descriptors for f in self._files.values())
        for name in list(self._recent):
            if held <= self.max_open:
                break
            f = self._files.get(name)
            if f is None:
                del self._recent[name]
            elif f.descriptors and not f._waiting:  # written and synced: close it
                held -= f.descriptors
                f.release()

    def state(self) -> dict[str, Any]:
        """For the checkpoint, taken after flush()."""
        for name in self._dirty:
            f = self._files.get(name)
            if f is not None:
                self._states[name] = f.state()
        for name, f in self._files.items():
            if name not in self._states:
                self._states[name] = f.state()
        self._dirty = set()
        return {"files": dict(self._states)}

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
        if self._labels_file is not None:
            self._labels_file.close()
            self._labels_file = None


def labels(directory: Path) -> dict[str, str]:
    """The host each label's lines came from (``labels``: a line "label host" per label,
    appended before the label's first line is written)."""
    try:
        text = (directory / LABELS).read_text(encoding="utf-8")
    except OSError:
        return {}
    whole = text[:text.rfind("\n") + 1]  # not a line still being written
    return dict(line.split(" ", 1) for line in whole.splitlines() if " " in line)
