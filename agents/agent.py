"""The agent: a daemon (its own session, stdio on /dev/null) that owns one job's workers on
one node.

It listens on ``<private dir>/agent.sock``, in a 0700 directory of the user, and serves one
controller at a time after it proves the job's secret. It outlives every channel: while no
controller is attached it keeps the workers running for ``controller_grace`` seconds,
spooling every message to a bounded file, and replays what the controller has not
acknowledged when one attaches again. When the grace ends it stops the workers (SIGTERM to
each group, a grace period, SIGKILL, the token sweep), records the outcome beside its
directory, removes the directory and exits.

Commands arrive on the main loop (``ops.OPS``, one handler each); slow ones (stop, stacks,
sync, setup) run aside so that heartbeats keep flowing, and a request always gets a reply.
"""

from __future__ import annotations

import fcntl
import hmac
import json
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from agents import cache, containment, leases, ops, preemption
from agents import commands as C
from agents import protocol as P
from agents.checkpoints import Store
from agents.netinfo import gpu_count, torch_version
from agents.outbox import Outbox
from agents.paths import (
    alive_path,
    bind_unix,
    clear_agent_directory,
    close_socket,
    private_base,
    sweep_outcomes,
)
from agents.processes import (
    kill_token_processes,
    processes_with_token,
    raise_open_files,
    signal_name,
    start_watchdog,
)
from agents.standby import Standbys
from agents.workers import Worker, prepare, running, spawn, worker_env

ATTACH_TIMEOUT = 10.0  # seconds a new connection has to prove the secret
# Standbys for the next restart start once every worker called heartbeat() or after this
# many seconds: not while the attempt's own workers start, which they would slow down.
REFILL_AFTER = 5.0
REAP_EVERY = 2.0  # seconds between reaping the exited orphans the agent adopted
# A controller detached this long ago is still told of a notice: the shutdown that SIGTERMs
# the agent can take its relay first (a Slurm allocation's signal reaches every step).
RECENTLY = 5.0


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class Agent:
    def __init__(self, directory: str, outcome_path: str, config: C.Launch):
        self.directory = directory
        self.outcome_path = outcome_path
        self.secret, self.config = config.secret, config
        self.job_id = os.path.basename(directory).rsplit(".", 1)[0]
        self.node_index = int(os.path.basename(directory).rsplit(".", 1)[1])
        self.instance = secrets.token_hex(8)  # tells a controller this is not an older agent
        self.stop_grace = config.stop_grace or 2.0
        self.heartbeat_interval = config.heartbeat_interval or 1.0
        self.node_timeout = config.node_timeout or 5.0
        self.controller_grace = config.controller_grace
        self.outbox = Outbox(os.path.join(directory, "spool"), config.spool_max_bytes)
        self.outbox.hello = self._hello
        self.token = secrets.token_hex(16)
        # SimpleQueue: put() is safe in a signal handler, Queue.put() can deadlock there.
        self.events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.workers: list[Worker] = []
        self.attempt = 0
        self.traces_dir: str | None = None  # this attempt's flight recorder dumps
        self.last_heard = time.monotonic()
        self._stop_lock = threading.Lock()
        self.listener: socket.socket | None = None
        self.socket_id: tuple[int, int] | None = None
        self.alive = -1  # the descriptor of its alive_path lock
        self.workdir: str | None = None  # the running attempt's (a synced tree is kept fresh)
        self._slow: queue.SimpleQueue[tuple[Callable[[], None], str, int | None]] | None = None
        self._touched = 0.0
        self.standbys = Standbys(self.token, directory)
        self.sockets = ops.Sockets()  # what the checks' commands hold open (agents/ops.py)
        self.checkpoints = Store(self.job_id, self.node_index, self.outbox, self.secret)
        self.cgroups = containment.Cgroups(self.job_id, self.node_index, self.instance)
        self._reaped_at = 0.0
        self.notice: P.Notice | None = None  # a SIGTERM the controller plans a move for
        self._ran_under_notice = False  # its workers ran (or were there): leave once stopped

    # --- start ---------------------------------------------------------------------------
    def listen(self) -> None:
        # Orphaned descendants of its workers become its children, not init's.
        containment.become_subreaper()
        raise_open_files()  # its own: what it starts gets the node's back
        # First: it must inherit no socket.
        start_watchdog(self.token, self.directory, self.checkpoints.root, self.cgroups)
        sweep_outcomes(os.path.dirname(self.outcome_path))
        self.checkpoints.start()
        # Held for life (the kernel lets go when the agent dies): relays know it lives.
        self.alive = os.open(alive_path(self.job_id, self.node_index),
                             os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self.alive, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # No other agent of this job lives on this node now: what is left in other agents'
        # cgroups is a predecessor's, killed together with its watchdog.
        self.cgroups.kill_predecessors()
        self._bind()
        check = self.config.preemption_check
        if check:  # a cloud's notice, asked on the node
            threading.Thread(target=preemption.watch, daemon=True, args=(
                self, check, self.config.preemption_check_interval or 5.0)).start()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: self.events.put(("signal", signum)))
        threading.Thread(target=self.outbox.run, daemon=True).start()
        threading.Thread(target=self._beat, daemon=True, name="heartbeat").start()

    def _bind(self) -> None:
        path = os.path.join(self.directory, "agent.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Mode set after the bind (its directory is 0700 anyway), never through the umask:
        # the agent's umask is what its workers inherit, as from torchrun.
        bind_unix(s, path)
        os.chmod(path, 0o600)
        s.listen(16)
        self.listener, self.socket_id = s, _file_id(path)
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: another listener took over (see _keep_listening)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One controller connection: prove the secret, then read its commands."""
        reader = conn.makefile("rb")
        conn.settimeout(ATTACH_TIMEOUT)
        try:
            first = P.decode(reader.readline(P.MAX_MESSAGE))
            attach, _ = C.parse(first or {}, {C.Attach.OP: C.Attach})
        except (OSError, P.ProtocolError):
            close_socket(conn)
            return
        assert isinstance(attach, C.Attach)
        if not hmac.compare_digest(attach.secret.encode(), self.secret.encode()):
            close_socket(conn)
            return
        conn.settimeout(None)
        self.last_heard = time.monotonic()
        self.outbox.attach(conn, attach.ack)
        try:
            for raw in iter(lambda: reader.readline(P.MAX_MESSAGE), b""):
                self.last_heard = time.monotonic()  # here: a slow op must not make pings late
                msg = P.decode(raw)
                if msg is None:
                    continue
                try:
                    command, req = C.parse(msg, ops.TAKEN)
                except P.ProtocolError as exc:  # answered on the main loop, in order
                    self.events.put(("refused", (C.op_name(msg), C.request_id(msg), exc)))
                    continue
                if isinstance(command, C.Ack):
                    self.outbox.ack(command.seq)
                elif isinstance(command, C.Spool):
                    self.outbox.spool_while_attached(conn)
                elif not isinstance(command, C.Ping):
                    self.events.put(("command", (command, req)))
        except OSError:
            pass
        self.outbox.detach(conn)

    def _hello(self) -> dict[str, Any]:
        return {
            "type": P.HELLO, "protocol": P.VERSION, "hostname": socket.gethostname(),
            "python": sys.version.split()[0], "torch": torch_version(), "gpus": gpu_count(),
            "pid": os.getpid(), "instance": self.instance, "attempt": self.attempt,
            "last_seq": self.outbox.seq,
            "workers": [{"rank": w.rank, "local_rank": w.local_rank, "pid": w.proc.pid,
                         "running": w.proc.poll() is None} for w in list(self.workers)],
            "containment": self.cgroups.describe(),
        }

    # --- main loop -------------------------------------------------------------------------
    def run(self) -> int:
        next_beat = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + min(self.heartbeat_interval, 0.5)
                if self._tick(now):
                    return 3
            try:
                kind, msg = self.events.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                continue
            if kind == "signal":
                if self.notice is None and (notice := _notice(self, msg)) is not None:
                    self.notice, self._ran_under_notice = notice, bool(self.workers)
                    continue
                self.finish(f"signal {signal_name(msg)}")
                return 128 + msg
            if kind == "refused":
                op, req, exc = msg
                if exc.field == "op":
                    self._failed(op, req, f"unknown op {op}")
                else:
                    self._failed(op, req, str(exc))
                continue
            command, req = msg
            if isinstance(command, C.Shutdown):
                self.finish(None)
                return 0
            try:
                ops.OPS[type(command)](self, command, req)
            except Exception as exc:  # report, never die: the controller decides
                self._failed(command.OP, req, f"{command.OP}: {exc!r}")

    def _failed(self, op: str, req: int | None, error: str) -> None:
        if req is not None:  # a request: its asker must hear now
            self.reply(P.Failed(req, error))
        else:
            self.outbox.put({"type": P.ERROR, "attempt": self.attempt, "message": error})

    def _tick(self, now: float) -> bool:
        """Progress and grace checks (heartbeats have a thread of their own: ``_beat``).
        True: the agent gave up."""
        _keep_listening(self)
        busy = running(self.workers)
        if self.notice is not None:
            # A spare (no workers since) stays until the deadline, its heartbeats saying so:
            # gone at once, its transport started another agent there, an ordinary spare.
            self._ran_under_notice = self._ran_under_notice or busy
            if time.time() > self.notice.deadline or (self._ran_under_notice and not busy):
                if busy:  # the deadline passed: the grace is spent
                    self.stop_grace = min(self.stop_grace, 1.0)
                self.finish(f"signal SIGTERM ({self.notice.source})")
                return True
        # Here, on the main thread: a child's PDEATHSIG fires when its parent thread ends.
        self.standbys.refill_due(now, all(w.heartbeat_seen for w in self.workers))
        if now - self._reaped_at > REAP_EVERY:
            self._reaped_at = now
            containment.reap_adopted()  # orphans adopted as subreaper, once they exit
        if self.workdir and self.workers and now - self._touched > 60:
            self._touched = now
            try:  # a tree in use must not look unused to another job's pruning
                os.utime(cache.tree_root(self.workdir))
            except OSError:
                pass
        if self.outbox.current() is not None:
            beat, ranks = self._worker_progress()
            if beat or ranks:  # every rank of this node in one message
                self.outbox.put({"type": P.PROGRESS, "attempt": self.attempt,
                                 "beat": beat, "ranks": ranks})
        since = self.outbox.detached_since
        if (since is not None and self.controller_grace is not None
                and now - since > self.controller_grace):
            self.finish(f"no controller for {self.controller_grace:g}s (controller_grace)")
            return True
        return False

    def _beat(self) -> None:
        """The node's heartbeat, on a thread of its own: a main loop busy starting workers,
        reading their files or running a command never delays it (a busy node is not a
        lost one). A controller silent for node_timeout is let go, as a dropped channel.
        Whatever else the agent sent said it is alive (the controller counts any message as
        heard): the next heartbeat is due a period after the last message of any kind (not
        after the last heartbeat, which let two periods pass in silence: a controller calls
        a node UNREACHABLE after max(node_timeout / 2, 1.5 heartbeat_interval), two periods
        at node_timeout 2), unless a notice must ride on it. With ranks that print, that
        halves what a controller of thousands of nodes reads."""
        period = min(self.heartbeat_interval, 0.5)
        due = time.monotonic() + period
        while not self.outbox.closed:
            time.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            due = now + period
            conn = self.outbox.current()
            if conn is None:
                continue
            if now - self.last_heard > self.node_timeout:
                self.outbox.detach(conn)
            elif self.notice is None and now - self.outbox.sent_at < period:
                due = self.outbox.sent_at + period
            else:
                notice = {} if self.notice is None else {"notice": P.plain(self.notice)}
                self.outbox.put({"type": P.HEARTBEAT, "attempt": self.attempt, **notice})

    def finish(self, reason: str | None) -> None:
        """Stop the workers, record why (unless the controller asked), remove our state."""
        running = [w.rank for w in self.workers if w.proc.poll() is None]
        self.stop_workers(grace=self.stop_grace)
        self.standbys.close()
        self.checkpoints.close()
        if reason is not None:
            outcome = {"reason": reason, "at": time.time(), "attempt": self.attempt,
                       "stopped_ranks": running, "last_seq": self.outbox.seq}
            try:
                fd = os.open(self.outcome_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC |
                             os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(outcome, f)
            except OSError:
                pass
        self.outbox.close()
        if self.listener is not None:  # shut down, not only closed: its accept() would
            close_socket(self.listener)  # keep it listening (clear_agent_directory probes it)
        leases.release()  # its tree and blobs may go now (another job's pruning)
        try:
            os.unlink(alive_path(self.job_id, self.node_index))
        except OSError:
            pass
        clear_agent_directory(self.directory)

    def _worker_progress(self) -> tuple[bool, dict[str, Any]]:
        """Whether any worker called heartbeat() since the last look, and each rank's news
        (Worker.news)."""
        touched, ranks = False, dict[str, dict[str, Any]]()
        for w in list(self.workers):
            beat, news = w.news(self.directory)
            touched = touched or beat
            if news:
                ranks[str(w.rank)] = news
        return touched, ranks

    def reply(self, reply: P.Reply) -> None:
        self.outbox.put(P.reply_wire(reply, self.attempt))

    def aside(self, handler: Callable[[], None], command: C.Command, req: int | None) -> None:
        """Run ``handler`` on the one thread for slow ops, in order (hashing and copying can
        take long: heartbeats go on meanwhile)."""
        if self._slow is None:
            self._slow = queue.SimpleQueue()
            threading.Thread(target=self._slow_worker, daemon=True).start()
        self._slow.put((handler, command.OP, req))

    def _slow_worker(self) -> None:
        assert self._slow is not None
        while True:
            handler, op, req = self._slow.get()
            try:
                handler()
            except Exception as exc:
                self._failed(op, req, f"{op}: {exc!r}")

    def on_thread(self, handler: Callable[[], None], command: C.Command,
                  req: int | None) -> None:
        """Run ``handler`` on a thread of its own (it may take minutes); it always replies."""
        def run() -> None:
            try:
                handler()
            except Exception as exc:  # the controller waits for an answer: always give one
                self._failed(command.OP, req, f"{command.OP}: {exc!r}")

        threading.Thread(target=run, daemon=True).start()

    # --- ops: workers ----------------------------------------------------------------------
    def op_start(self, start: C.Start) -> None:
        attempt = start.attempt
        if attempt <= self.attempt:
            return  # already started (a controller re-sent it after reattaching)
        self.stop_workers(grace=start.stop_grace)
        self.attempt = attempt
        workdir = os.path.expanduser(start.workdir or ".")
        self.workdir = workdir
        base_env, self.traces_dir = worker_env(start, self.token, self.directory, self.job_id,
                                               workdir)
        self.checkpoints.install(start.checkpoint.pulls)  # before a worker can load()
        for key, value in self.checkpoints.configure(start.checkpoint, workdir, attempt,
                                                     start.ranks or len(start.workers)).items():
            if value is None:
                base_env.pop(key, None)
            else:
                base_env[key] = value
        attempt_dir = os.path.join(self.directory, f"attempt-{attempt}")
        cgroup = self.cgroups.attempt(attempt)
        imports = start.warm.imports if start.warm is not None else ()
        refills = []
        for given in start.workers:
            local_rank = given.local_rank
            cold_because = None
            try:
                spec = prepare(given, base_env, attempt_dir)
                proc = None
                if start.warm is not None:
                    proc, cold_because = self.standbys.take(
                        local_rank, list(spec.argv), spec.env, workdir, imports,
                        enter=lambda pid: self.cgroups.move(cgroup, pid))
                started_warm = proc is not None
                proc = proc or spawn(spec, workdir, cgroup)
            except Exception as exc:  # the controller must hear of every rank, or it waits
                error = f"{given.argv[0]}: {getattr(exc, 'strerror', None) or exc}"
                self.outbox.put({"type": P.SPAWN_FAILED, "attempt": attempt,
                                 "rank": given.rank, "local_rank": local_rank,
                                 "error": error})
                continue
            # "started" is queued before the first output line can be read.
            self.outbox.put({"type": P.STARTED, "attempt": attempt, "rank": spec.rank,
                             "local_rank": local_rank, "pid": proc.pid, "warm": started_warm})
            if cold_because:
                self.outbox.add_lines(attempt, spec.rank, "stderr",
                                      [f"[orchestrator] started cold: {cold_because}"])
            worker = Worker(self.outbox, attempt, spec, proc)
            self.workers.append(worker)
            worker.start_threads()
            refills.append((local_rank, list(spec.argv), spec.env, workdir, imports))
        if start.warm is None:
            self.standbys.close()
        else:
            self.standbys.schedule(refills, time.monotonic() + REFILL_AFTER)

    def op_stop(self, stop: C.Stop) -> None:
        attempt = self.attempt if stop.attempt is None else stop.attempt
        grace = stop.grace
        if attempt < self.attempt:  # a late stop of an older attempt: those are gone
            self.outbox.put({"type": P.STOPPED, "attempt": attempt})
            return
        # Stopping can take the whole grace period: do it aside so heartbeats keep flowing.
        threading.Thread(target=self._stop_and_report, args=(attempt, grace),
                         daemon=True).start()

    def _stop_and_report(self, attempt: int, grace: float) -> None:
        self.stop_workers(grace)
        self.checkpoints.report_now()  # the next attempt's step is chosen on what is here
        self.outbox.put({"type": P.STOPPED, "attempt": attempt})

    def stop_workers(self, grace: float) -> None:
        """SIGTERM every worker's group, wait up to ``grace``, then SIGKILL what is left."""
        with self._stop_lock:
            workers, self.workers = self.workers, []
            alive = [w for w in workers if w.proc.poll() is None]
            for w in alive:
                w.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(w.proc.poll() is None for w in alive):
                time.sleep(0.02)
            for w in alive:
                w.signal_group(signal.SIGKILL)
            # Whatever their workers started, wherever it went: in their cgroups, or adopted
            # by this agent when its parent died.
            self.cgroups.kill_all()
            containment.kill_adopted()
            # Children that left their worker's group (setsid, torchrun's workers) or outlived
            # it still carry the token (or, of a worker that was a standby, the standbys').
            kill_token_processes(self.token)
            self.standbys.sweep()
            for w in workers:
                w.done.wait(timeout=60.0)  # its exit is queued after its last line
                w.close()
            deadline = time.monotonic() + 5.0
            while processes_with_token(self.token) and time.monotonic() < deadline:
                kill_token_processes(self.token)
                time.sleep(0.05)


def _notice(agent: Agent, signum: int) -> P.Notice | None:
    """The notice ``signum`` is, if any: a SIGTERM (the host's shutdown, the scheduler's
    preemption, forwarded by a Slurm holder) while workers run. The workers go on; the
    heartbeats say so (once a controller is attached again, if its channel went with the
    same shutdown), and the controller moves the job off this node at a step every rank
    saves (orchestrator/drain.py) within the job's stop_grace_period, after which the agent
    leaves (``Agent._tick``). A spare's (no workers, a controller attached) is one too: it
    takes no place meanwhile. Any other signal, or a second one, stops them at once, as
    does a SIGTERM with ``on_sigterm: worker`` (it goes on to them, as from torchrun) and
    one with neither workers nor a controller to tell."""
    if signum != signal.SIGTERM or agent.config.sigterm_to_workers or \
            not (running(agent.workers) or agent.outbox.attached(within=RECENTLY)):
        return None
    return P.Notice("SIGTERM to the agent", time.time() + agent.stop_grace)


def _keep_listening(agent: Agent) -> None:
    """Listen again where the socket was if it was removed under us: systemd removes
    /run/user/<uid> once the user's last session ends, while the agent goes on."""
    path = os.path.join(agent.directory, "agent.sock")
    if _file_id(path) == agent.socket_id:
        return
    try:
        if os.path.dirname(agent.directory) != private_base():
            return  # the runtime base is not the same any more: nothing to find us by
        os.makedirs(agent.directory, mode=0o700, exist_ok=True)
        for w in agent.workers:  # their heartbeat and error files' directories
            os.makedirs(os.path.dirname(w.heartbeat_file), mode=0o700, exist_ok=True)
        old = agent.listener
        agent._bind()
        if old is not None:
            old.close()
    except (OSError, RuntimeError):
        pass  # the base itself is gone: the next login makes it again
