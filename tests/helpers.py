"""Helpers shared by the test layers: spec files, process scans, waiting."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
PYTHON = sys.executable


def write_spec(directory: Path, data: dict, name: str = "job.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def job_processes(job_id: str) -> list[int]:
    """Pids of live processes whose environment names this job (its workers, any node)."""
    needle = f"ORCHESTRATOR_JOB_ID={job_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
        except OSError:
            continue
        if needle in env:
            found.append(int(entry))
    return found


def agent_processes(job_id: str) -> list[int]:
    """Pids of live processes holding one of the job's agents' alive files open (its agents,
    on any node of this machine: agents carry no job id in their environment)."""
    prefix, found = f"{job_id}.", []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                parent, _, name = os.readlink(f"/proc/{entry}/fd/{fd}").rpartition("/")
            except OSError:  # closed meanwhile
                continue
            if parent.endswith("/agents") and name.startswith(prefix) and name.endswith(".alive"):
                found.append(int(entry))
                break
    return found


def standby_processes(job_id: str) -> list[int]:
    """The job's warm standby interpreters (agents/standby.py), found by its job id."""
    out = []
    for pid in job_processes(job_id):
        try:
            if b"standby_boot.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out


def command_lines() -> list[bytes]:
    """Every live process's command line, as ``ps`` shows it to any local user."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found.append(f.read().replace(b"\0", b" "))
            except OSError:
                continue
    return found


def assert_no_job_processes(job_id: str, within: float = 5.0) -> None:
    """Every process of the job, its workers and its agents, must be gone (within a short
    settling time)."""
    deadline = time.monotonic() + within
    while True:
        left = sorted(set(job_processes(job_id)) | set(agent_processes(job_id)))
        if not left:
            return
        if time.monotonic() > deadline:
            cmdlines = {}
            for pid in left:
                try:
                    cmdlines[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    pass
                try:
                    os.kill(pid, signal.SIGKILL)  # ours: it carries the test's job id
                except OSError:
                    pass
            raise AssertionError(f"processes of {job_id} left behind: {cmdlines}")
        time.sleep(0.1)


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_for_output(job_id: str, text: str, count: int, timeout: float = 60) -> None:
    """Wait until ``count`` log lines of the job contain ``text`` (e.g. every rank's start
    line: a worker's signal handlers are in place only once its script runs)."""
    import orchestrator

    wait_for(lambda: sum(text in ln for ln in orchestrator.logs(job_id)) >= count, timeout,
             what=f"{count} lines with {text!r}")


class CommandLineScan:
    """While in use, scans every process's command line on this machine (the namespace
    nodes' processes too) every 20 ms for any of ``needles``: ``hits`` holds what matched,
    ``scans`` how many scans ran."""

    def __init__(self, *needles: str):
        import threading

        self.needles = [n.encode() for n in needles]
        self.hits: list[bytes] = []
        self.scans = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.is_set():
            for line in command_lines():
                if any(n in line for n in self.needles):
                    self.hits.append(line)
            self.scans += 1
            self._done.wait(0.02)

    def __enter__(self) -> CommandLineScan:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()
