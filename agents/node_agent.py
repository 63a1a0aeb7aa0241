"""The node agent: a thin, obedient supervisor of one node's workers.

Stdlib only and one file, because the controller ships its source to nodes that have
nothing but ``python3``; it never imports torch, so it starts in tens of milliseconds.

It speaks JSON lines with the controller over stdin/stdout.

Controller -> agent (``op``)::

    init      {"job_id", "node_index", "heartbeat_interval", "peer_timeout"}
    start     {"attempt", "workdir", "master_addr", "env", "workers": [{"rank", "local_rank",
               "argv", "env"}], "stop_grace"}
    stop      {"attempt", "grace"}
    free_port {"port"}             (0: pick one; otherwise check that this one is free)
    listen    {"port"}             (preflight: hold a listening socket)
    probe     {"address", "port"}  (preflight: route and TCP reachability toward the master)
    ping      {}                   (the controller's heartbeat)
    shutdown  {}

Agent -> controller (``type``), every message with the attempt it belongs to::

    hello      {hostname, python, torch, gpus, pid, protocol}
    port       {port, ok}
    listening  {port, ok, error}
    probe      {interface, reachable, error}
    started    {rank, local_rank, pid}
    spawn_failed {rank, local_rank, error}
    output     {rank, stream, line}
    exited     {rank, local_rank, exit_code, signal, error_file}
    stopped    {}
    heartbeat  {}
    progress   {}                  (a worker touched its ORCHESTRATOR_HEARTBEAT_FILE)
    error      {message}

The agent stops its workers (SIGTERM to each process group, a grace period, SIGKILL) on
``stop``, on ``shutdown``, when its stdin closes, when the controller's pings stop, and when
it is signalled. A watchdog process forked at start kills the workers if the agent itself is
SIGKILLed. Every worker carries ``ORCHESTRATOR_AGENT_TOKEN`` in its environment, so processes
that left the worker's process group (``setsid``, torchrun's own workers) are found and
killed too: by that unique token, never by name.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, BinaryIO

PROTOCOL = 1
MAX_LINE = 8192  # bytes of one worker output line; longer lines are split
MAX_ERROR_FILE = 64 * 1024
MAX_COMMAND = 16 * 1024 * 1024
TOKEN_VAR = "ORCHESTRATOR_AGENT_TOKEN"
PR_SET_PDEATHSIG = 1


class Channel:
    """Writes JSON lines to the controller; shared by threads, so writes are serialised."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._lock = threading.Lock()
        self.broken = False

    def send(self, type_: str, attempt: int, **fields: Any) -> None:
        data = json.dumps({"type": type_, "attempt": attempt, **fields}).encode() + b"\n"
        with self._lock:
            if self.broken:
                return
            try:
                self._stream.write(data)
                self._stream.flush()
            except (OSError, ValueError):
                self.broken = True


_prctl: Any
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the watchdog alone guards against orphans
    _prctl = None


def _set_pdeathsig() -> None:
    # Runs in the child between fork and exec (so prctl was looked up beforehand, in the
    # parent): if the agent dies, the kernel kills the worker.
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # real-time signals have no name
        return f"SIG{number}"


def processes_with_token(token: str) -> list[int]:
    """Pids of every process whose environment carries this agent's token."""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def kill_token_processes(token: str) -> None:
    for pid in processes_with_token(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def start_watchdog(token: str) -> None:
    """Fork a process that kills this agent's workers once the agent is gone, however it died."""
    agent_pid = os.getpid()
    if os.fork() != 0:
        return
    # The watchdog must not hold the controller's pipes open, or a dead agent would look alive.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.getppid() == agent_pid:
        time.sleep(0.2)
    kill_token_processes(token)
    os._exit(0)


def interface_for(address: str) -> str | None:
    """Name of the network interface this node uses to reach ``address``.

    gloo and NCCL otherwise bind to the address of the machine's hostname, which on common
    images resolves to 127.0.x.1 and breaks every cross-node job.
    """
    try:
        infos = socket.getaddrinfo(address, 9, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # UDP connect sends nothing: it only picks the route
            local_ip = probe.getsockname()[0]
        if local_ip.startswith("127.") or local_ip == "::1":
            return "lo"
        return _interface_with_address(local_ip)
    except OSError:
        return None


def _interface_with_address(ip: str) -> str | None:
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, request)
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


def torch_version() -> str | None:
    """torch's version from its dist-info folder's name, without importing it (2 s of CPU)
    or scanning every distribution (importlib.metadata)."""
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith("torch-") and name.endswith(".dist-info"):
                return name[len("torch-"):-len(".dist-info")]
    return None


def gpu_count() -> int:
    try:
        return len([d for d in os.listdir("/proc/driver/nvidia/gpus")])
    except OSError:
        pass
    try:
        return len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])
    except OSError:
        return 0


def free_port(port: int) -> tuple[int, bool]:
    """Bind ``port`` (0: any) on all addresses to show it is free now; return it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return port, False
        return s.getsockname()[1], True


class Worker:
    """One spawned process and the threads that stream its output and report its exit."""

    def __init__(self, agent: Agent, attempt: int, spec: dict[str, Any], proc: subprocess.Popen):
        self.agent = agent
        self.attempt = attempt
        self.rank = spec.get("rank")
        self.local_rank = spec.get("local_rank")
        self.error_file = spec["env"].get("TORCHELASTIC_ERROR_FILE")
        self.heartbeat_file = spec["env"]["ORCHESTRATOR_HEARTBEAT_FILE"]
        self.proc = proc
        self.done = threading.Event()
        self._readers = [
            threading.Thread(target=self._pump, args=(proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, "stderr"), daemon=True),
        ]
        for t in self._readers:
            t.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _pump(self, pipe: BinaryIO, stream: str) -> None:
        send = self.agent.channel.send
        for raw in iter(lambda: pipe.readline(MAX_LINE), b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            send("output", self.attempt, rank=self.rank, stream=stream, line=line)
        pipe.close()

    def _wait(self) -> None:
        code = self.proc.wait()
        # Report the exit after the last output line, unless a stray child holds the pipe.
        for t in self._readers:
            t.join(timeout=2.0)
        exit_code, sig = (code, None) if code >= 0 else (None, signal_name(-code))
        self.agent.channel.send(
            "exited",
            self.attempt,
            rank=self.rank,
            local_rank=self.local_rank,
            exit_code=exit_code,
            signal=sig,
            error_file=self._read_error_file(),
        )
        self.done.set()

    def _read_error_file(self) -> str | None:
        if not self.error_file:
            return None
        try:
            with open(self.error_file, encoding="utf-8", errors="replace") as f:
                return f.read(MAX_ERROR_FILE)
        except OSError:
            return None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except OSError:
            pass


class Agent:
    def __init__(self, channel: Channel):
        self.channel = channel
        self.token = secrets.token_hex(16)
        # SimpleQueue: put() is safe in a signal handler, Queue.put() can deadlock there.
        self.events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.workers: list[Worker] = []
        self.attempt = 0
        self.job_id = ""
        self.node_index = 0
        self.heartbeat_interval = 1.0
        self.peer_timeout = 0.0  # 0: until init says otherwise, only EOF ends the agent
        self.last_heard = time.monotonic()
        self._stop_lock = threading.Lock()
        self.state_dir = ""
        self.listener: socket.socket | None = None
        self._last_progress = 0.0

    # --- input -------------------------------------------------------------------------
    def read_commands(self, stream: BinaryIO) -> None:
        for raw in iter(lambda: stream.readline(MAX_COMMAND), b""):
            self.last_heard = time.monotonic()  # here, not in the main loop: a slow op
            try:                                # must not make queued pings look late
                msg = json.loads(raw)
            except ValueError:
                self.channel.send("error", self.attempt, message="unparsable command line")
                continue
            self.events.put(("command", msg))
        self.events.put(("eof", None))

    # --- main loop ---------------------------------------------------------------------
    def run(self) -> int:
        next_beat = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self.channel.send("heartbeat", self.attempt)
                next_beat = now + self.heartbeat_interval
                if self._workers_touched_heartbeat():
                    self.channel.send("progress", self.attempt)
            try:
                kind, msg = self.events.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                continue
            if kind == "eof":
                self.stop_workers(grace=2.0)
                return 0
            if kind == "signal":
                self.stop_workers(grace=2.0)
                return 128 + msg
            op = msg.get("op")
            if op == "shutdown":
                self.stop_workers(grace=2.0)
                return 0
            handler = getattr(self, f"op_{op}", None)
            if handler is None:
                self.channel.send("error", self.attempt, message=f"unknown op {op!r}")
                continue
            try:
                handler(msg)
            except Exception as exc:  # report, never die: the controller decides
                self.channel.send("error", self.attempt, message=f"{op}: {exc!r}")

    def watch_controller(self) -> None:
        """Stop the workers and exit once the controller has been silent for peer_timeout.

        Its own thread, touching neither the channel nor the event queue: when the link to
        the controller is cut, a write to stdout can block the main loop for good.
        """
        while True:
            time.sleep(0.2)
            if self.peer_timeout and time.monotonic() - self.last_heard > self.peer_timeout:
                self.stop_workers(grace=0.0)  # nobody is left to stop them
                if self.state_dir:
                    shutil.rmtree(self.state_dir, ignore_errors=True)
                os._exit(3)

    def _workers_touched_heartbeat(self) -> bool:
        """Did any worker call orchestrator.heartbeat() since the last check?"""
        newest = self._last_progress
        for w in self.workers:
            try:
                newest = max(newest, os.stat(w.heartbeat_file).st_mtime)
            except OSError:
                continue
        touched, self._last_progress = newest > self._last_progress, newest
        return touched

    # --- ops ---------------------------------------------------------------------------
    def op_ping(self, msg: dict[str, Any]) -> None:
        pass

    def op_init(self, msg: dict[str, Any]) -> None:
        self.job_id = str(msg["job_id"])
        self.node_index = int(msg.get("node_index", 0))
        self.heartbeat_interval = float(msg.get("heartbeat_interval", 1.0))
        self.peer_timeout = float(msg.get("peer_timeout", 0.0))
        if not self.state_dir:
            # Our own fresh 0700 directory: never one another user could have planted.
            self.state_dir = tempfile.mkdtemp(prefix=f"orchestrator-{self.job_id[:40]}-")
        self.channel.send(
            "hello",
            self.attempt,
            hostname=socket.gethostname(),
            python=sys.version.split()[0],
            torch=torch_version(),
            gpus=gpu_count(),
            pid=os.getpid(),
            protocol=PROTOCOL,
        )

    def op_free_port(self, msg: dict[str, Any]) -> None:
        port, ok = free_port(int(msg.get("port", 0)))
        self.channel.send("port", self.attempt, port=port, ok=ok)

    def op_listen(self, msg: dict[str, Any]) -> None:
        """Hold a listening socket on ``port`` (0: any) so peers can test that they reach it."""
        if self.listener is not None:
            self.listener.close()
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", int(msg.get("port", 0))))
            s.listen(64)
        except OSError as exc:
            s.close()
            self.channel.send("listening", self.attempt, port=msg.get("port"), ok=False,
                              error=str(exc))
            return
        self.listener = s
        self.channel.send("listening", self.attempt, port=s.getsockname()[1], ok=True)

    def op_probe(self, msg: dict[str, Any]) -> None:
        """Report the interface toward ``address`` and whether ``address:port`` accepts TCP."""
        address, port = str(msg["address"]), int(msg["port"])
        reachable, error = False, None
        try:
            with socket.create_connection((address, port), timeout=float(msg.get("timeout", 3))):
                reachable = True
        except OSError as exc:
            error = str(exc)
        self.channel.send("probe", self.attempt, interface=interface_for(address),
                          reachable=reachable, error=error)

    def op_start(self, msg: dict[str, Any]) -> None:
        self.stop_workers(grace=float(msg.get("stop_grace", 5.0)))
        self.attempt = int(msg["attempt"])
        workdir = os.path.expanduser(msg.get("workdir") or ".")
        base_env = dict(os.environ)
        base_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, unless set here
        base_env.update(msg.get("env", {}))
        iface = interface_for(msg["master_addr"]) if msg.get("master_addr") else None
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if iface and var not in base_env:
                base_env[var] = iface
        base_env[TOKEN_VAR] = self.token
        attempt_dir = os.path.join(self.state_dir, f"attempt-{self.attempt}")
        for spec in msg["workers"]:
            try:
                proc, spec = self._spawn(spec, base_env, attempt_dir, workdir)
            except Exception as exc:  # the controller must hear of every rank, or it waits
                error = f"{spec['argv'][0]}: {getattr(exc, 'strerror', None) or exc}"
                self.channel.send("spawn_failed", self.attempt, rank=spec.get("rank"),
                                  local_rank=spec.get("local_rank"), error=error)
                continue
            self.channel.send("started", self.attempt, rank=spec.get("rank"),
                              local_rank=spec.get("local_rank"), pid=proc.pid)
            self.workers.append(Worker(self, self.attempt, spec, proc))

    def _spawn(self, spec: dict[str, Any], base_env: dict[str, str], attempt_dir: str,
               workdir: str) -> tuple[subprocess.Popen, dict[str, Any]]:
        env = dict(base_env)
        env.update(spec.get("env", {}))
        label = spec.get("rank") if spec.get("rank") is not None else "node"
        rank_dir = os.path.join(attempt_dir, f"rank-{label}")
        os.makedirs(rank_dir, mode=0o700, exist_ok=True)
        env["TORCHELASTIC_ERROR_FILE"] = os.path.join(rank_dir, "error.json")  # never shared
        env["ORCHESTRATOR_HEARTBEAT_FILE"] = os.path.join(rank_dir, "heartbeat")
        spec = {**spec, "env": env}
        proc = subprocess.Popen(
            spec["argv"],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # own process group: one killpg reaches its children
            preexec_fn=_set_pdeathsig,
        )
        return proc, spec

    def op_stop(self, msg: dict[str, Any]) -> None:
        attempt = int(msg.get("attempt", self.attempt))
        grace = float(msg.get("grace", 5.0))
        if attempt != self.attempt:  # a late stop of an older attempt: those are gone
            self.channel.send("stopped", attempt)
            return
        # Stopping can take the whole grace period: do it aside so heartbeats keep flowing.
        threading.Thread(target=self._stop_and_report, args=(attempt, grace), daemon=True).start()

    def _stop_and_report(self, attempt: int, grace: float) -> None:
        self.stop_workers(grace)
        self.channel.send("stopped", attempt)

    # --- stopping ----------------------------------------------------------------------
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
            # Children that left their worker's group (setsid, torchrun's workers) or outlived
            # it still carry the token.
            kill_token_processes(self.token)
            for w in workers:
                w.done.wait(timeout=5.0)
            deadline = time.monotonic() + 5.0
            while processes_with_token(self.token) and time.monotonic() < deadline:
                kill_token_processes(self.token)
                time.sleep(0.05)


def main() -> int:
    channel = Channel(sys.stdout.buffer)
    agent = Agent(channel)
    start_watchdog(agent.token)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: agent.events.put(("signal", signum)))
    threading.Thread(target=agent.read_commands, args=(sys.stdin.buffer,), daemon=True).start()
    threading.Thread(target=agent.watch_controller, daemon=True).start()
    try:
        return agent.run()
    finally:
        if agent.state_dir:
            shutil.rmtree(agent.state_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
