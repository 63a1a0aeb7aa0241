"""The workers of one attempt on this node: their world (see
docs/reference/worker-environment.md), their start, their output and their exit.

A worker starts from the agent's own environment, which the agent never changes (the node's:
the login's over SSH, the step's on Slurm, the submitter's on a local node), and umask; plus
the attempt's variables, torchrun's defaults where the node has none, the flight recorder's,
and the shim directory last on PYTHONPATH. Each runs in its own process group.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from typing import Any, BinaryIO

from agents import commands as C
from agents import containment, rankfiles, shims
from agents import protocol as P
from agents.cache import prune_traces
from agents.netinfo import (
    FR_DUMP_NAMES,
    FR_SIZE_NAMES,
    flight_recorder_names,
    interface_for,
    torch_version,
)
from agents.outbox import Outbox
from agents.paths import traces
from agents.processes import TOKEN_VAR, as_launched, pidfd, signal_name
from agents.text import cut, text


def worker_env(start: C.Start, token: str, agent_dir: str, job_id: str,
               workdir: str) -> tuple[dict[str, str], str | None]:
    """The environment common to an attempt's workers on this node, and where its flight
    recorder dumps go (None: off)."""
    attempt = start.attempt
    env = dict(os.environ)  # the node's world, as torchrun started here would pass it on
    env.update(start.env)
    for key, value in start.defaults.items():
        env.setdefault(key, value)
    # Several nodes: gloo and NCCL must not bind the hostname's address (often 127.0.x.1).
    iface = interface_for(start.route_to) if start.route_to else None
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if iface and var not in env:
            env[var] = iface
    if "PWD" in env:  # a shell keeps PWD at its cwd: torchrun run from the workdir
        env["PWD"] = os.path.abspath(workdir)
    env[TOKEN_VAR] = token
    dumps = _flight_recorder_env(env, job_id, attempt, start.flight_recorder)
    env["ORCHESTRATOR_STACK_DIR"] = os.path.join(agent_dir, f"attempt-{attempt}")
    env["PYTHONPATH"] = os.pathsep.join(  # last: the user's win
        p for p in (env.get("PYTHONPATH"), shims.install(agent_dir)) if p)
    return env, dumps


def _flight_recorder_env(env: dict[str, str], job_id: str, attempt: int,
                         entries: int) -> str | None:
    """torch's flight recorder on (the last ``entries`` collectives of each process group,
    NCCL or gloo), unless the job set it; dumps, on a collective timeout (torch) or a hang
    (the agent asks), go to a directory that outlives this agent."""
    directory = os.path.join(traces(), job_id, f"attempt-{attempt}")
    if entries <= 0:
        return directory
    prune_traces()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    # One name each, the one this torch reads: setting both the new and the deprecated
    # name makes every rank print a deprecation warning.
    size, dump = flight_recorder_names(torch_version())
    if not any(name in env for name in FR_SIZE_NAMES):
        env[size] = str(entries)
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if not any(name in env for name in FR_DUMP_NAMES):
        env[dump] = os.path.join(directory, "nccl_trace_rank_")  # torch's own file names
    return directory


def prepare(given: C.WorkerStart, base_env: dict[str, str], attempt_dir: str
            ) -> C.WorkerStart:
    """One worker's start as the controller gave it, with its whole environment (its own
    error and heartbeat files, in a directory of its rank)."""
    env = dict(base_env)
    env.update(given.env)
    label = given.rank if given.rank is not None else "node"
    rank_dir = os.path.join(attempt_dir, f"rank-{label}")
    os.makedirs(rank_dir, mode=0o700, exist_ok=True)
    env["TORCHELASTIC_ERROR_FILE"] = os.path.join(rank_dir, "error.json")  # never shared
    env["ORCHESTRATOR_HEARTBEAT_FILE"] = os.path.join(rank_dir, "heartbeat")
    return dataclasses.replace(given, env=env)


def spawn(spec: C.WorkerStart, workdir: str, cgroup: str | None = None
          ) -> subprocess.Popen[bytes]:
    """Start one worker cold (its own process group, in its attempt's ``cgroup``; killed
    with the agent)."""
    def in_child() -> None:  # between fork and exec: before the worker can start anything
        as_launched()
        containment.join(cgroup)

    return containment.spawn(
        list(spec.argv), cwd=workdir, env=spec.env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,  # own process group: one killpg reaches its children
        preexec_fn=in_child,
    )


class Worker:
    """One spawned process and the threads that stream its output and report its exit."""

    def __init__(self, outbox: Outbox, attempt: int, spec: C.WorkerStart,
                 proc: subprocess.Popen[bytes]):
        self.outbox = outbox
        self.attempt = attempt
        self.rank = spec.rank
        self.local_rank = spec.local_rank
        self.error_file = spec.env.get("TORCHELASTIC_ERROR_FILE")
        self.heartbeat_file = spec.env["ORCHESTRATOR_HEARTBEAT_FILE"]
        self.proc = proc
        self.heartbeat_seen = 0.0  # change time of its heartbeat file at the last look
        self.waits_seen = 0.0  # mtime of its sampler's file at the last look
        self.problems_said: set[str] = set()  # of its files, told in its log already
        self.pidfd = pidfd(proc.pid)  # taken before anyone can reap it
        self.done = threading.Event()
        self._readers = [
            threading.Thread(target=self._read, args=(proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._read, args=(proc.stderr, "stderr"), daemon=True),
        ]

    def news(self, agent_dir: str) -> tuple[bool, dict[str, Any]]:
        """Whether it called heartbeat() since the last look; the step and metrics it wrote
        (see agents/shims/orchestrator_worker.py) and its sampler's new report. A file the
        agent cannot use is this rank's problem: a line in its log."""
        news: dict[str, Any] = {}
        if self.rank is not None:
            waits = self._waits(agent_dir)
            if waits is not None:  # not a sign of life: a hung rank's sampler goes on
                news["waits"] = waits
        try:
            st = os.stat(self.heartbeat_file)
        except OSError:
            return False, news
        # The change time, not the mtime: a worker can set its file's mtime to anything
        # (utime), while the kernel sets the change time to the node's clock.
        if st.st_ctime == self.heartbeat_seen:
            return False, news
        self.heartbeat_seen = st.st_ctime
        if st.st_size and self.rank is not None:
            record, problems = rankfiles.heartbeat(self.heartbeat_file)
            for problem in problems:
                self._problem(problem)
            if record is not None:
                at = min(max(st.st_ctime, 0.0), time.time())
                news.update(record, at=at)
        return True, news

    def _waits(self, agent_dir: str) -> list[int] | None:
        """[samples, of them waiting in a collective] from the rank's sampler, when new."""
        path = os.path.join(agent_dir, f"attempt-{self.attempt}", f"waits-{self.rank}.json")
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return None
        if mtime <= self.waits_seen:
            return None
        self.waits_seen = mtime
        waits, problem = rankfiles.waits(path)
        if problem is not None:
            self._problem(problem)
        return waits

    def _problem(self, problem: str) -> None:
        """Say once per attempt, in the rank's own log, what of its files was not used."""
        key = " ".join(problem.split(" ", 2)[:2])
        if key not in self.problems_said:
            self.problems_said.add(key)
            self.outbox.add_lines(self.attempt, self.rank, "stderr",
                                  [f"[orchestrator] {problem}"])

    def start_threads(self) -> None:
        for t in self._readers:
            t.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _read(self, pipe: BinaryIO, stream: str) -> None:
        fd = pipe.fileno()
        add = self.outbox.add_lines
        carry = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            data = carry + chunk
            end = data.rfind(b"\n")
            if end < 0:
                carry = data
                if len(carry) >= P.MAX_LINE:  # a line too long to wait for: cut it
                    piece, carry = carry[:P.MAX_LINE], carry[P.MAX_LINE:]
                    add(self.attempt, self.rank, stream, [text(piece)])
                continue
            body, carry = data[:end], data[end + 1:]
            lines = body.decode("utf-8", "replace").split("\n")
            if len(body) > P.MAX_LINE and max(map(len, lines)) > P.MAX_LINE // 4:
                lines = cut(lines)
            add(self.attempt, self.rank, stream, [ln.rstrip("\r") for ln in lines])
        if carry:
            add(self.attempt, self.rank, stream, cut([text(carry)]))
        pipe.close()

    def _wait(self) -> None:
        code = self.proc.wait()
        # Report the exit after the last output line, unless a stray child holds the pipe.
        for t in self._readers:
            t.join(timeout=2.0)
        self.outbox.wait_sent(self.rank)
        exit_code, sig = (code, None) if code >= 0 else (None, signal_name(-code))
        self.outbox.put({
            "type": P.EXITED, "attempt": self.attempt, "rank": self.rank,
            "local_rank": self.local_rank, "exit_code": exit_code, "signal": sig,
            "error_file": rankfiles.error_file(self.error_file), "at": time.time(),
        })
        self.done.set()

    def signal_group(self, sig: int) -> None:
        """Signal the worker's process group while its leader is alive: a live leader holds
        the group id, so it cannot name anybody else's group. Without it, group members
        left behind are found by the token sweep instead."""
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, 0)  # raises once the leader is gone
            elif self.proc.returncode is not None:
                return
            os.killpg(self.proc.pid, sig)
        except OSError:
            pass

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def running(workers: list[Worker]) -> bool:
    """Whether any of ``workers`` still runs."""
    return any(w.proc.poll() is None for w in list(workers))
