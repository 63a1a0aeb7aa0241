"""The node agent: a thin, obedient supervisor of one job's workers on one node.

Stdlib only, shipped by the controller with ``agents/protocol.py`` (the messages are
described there) to nodes that have nothing but ``python3``; it never imports torch.

One program, two roles:

- The **relay** is what the channel runs (a local pipe, or an SSH exec channel). It reads
  ``connect``, attaches to the job's agent through its Unix socket, starting the agent first
  when asked to, and then copies bytes both ways until either side closes.
- The **agent** is a daemon (its own session, stdio on /dev/null) that owns the workers. It
  listens on ``<private dir>/agent.sock``, in a 0700 directory of the user, and serves one
  controller at a time after it proves the job's secret. It outlives every channel: while
  no controller is attached it keeps the workers running for ``controller_grace`` seconds,
  spooling every message to a bounded file, and replays what the controller has not
  acknowledged when one attaches again. When the grace ends it stops the workers (SIGTERM to
  each group, a grace period, SIGKILL, the token sweep), records the outcome beside its
  directory, removes the directory and exits.

No orphans: every worker is in its own process group with ``PR_SET_PDEATHSIG(SIGKILL)``; a
watchdog process kills the workers when the agent dies, SIGKILL included; and processes that
left their group (``setsid``, torchrun's workers) are found by a per-agent token in their
environment, never by name.

Nothing is dropped silently: output travels in batches of one rank's lines; a reader stops
reading a worker's pipe while the controller is behind (the worker then blocks on write), and
past the spool's cap the agent counts the lines it could not keep and says so.
"""

from __future__ import annotations

import base64
import collections
import ctypes
import fcntl
import hashlib
import hmac
import json
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, BinaryIO

from agents import protocol as P

MAX_ERROR_FILE = 64 * 1024
LINES_CAP = 1024 * 1024  # bytes of read-but-unsent worker output; readers wait beyond it
TOKEN_VAR = "ORCHESTRATOR_AGENT_TOKEN"
PR_SET_PDEATHSIG = 1
JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
ATTACH_TIMEOUT = 10.0  # seconds a new connection has to prove the secret
# Imported by every Python worker at start (it is on their PYTHONPATH): a faulthandler hook
# so that the agent can ask for a stack without ptrace (SIGUSR2 -> a file), a sampler that
# tells how much of the time the rank waits in collectives, then whatever sitecustomize would
# have been imported without this one.
SITECUSTOMIZE = '''import os
import sys


def _orchestrator_hook():
    stack_dir = os.environ.get("ORCHESTRATOR_STACK_DIR")
    if stack_dir and os.environ.get("RANK"):
        import faulthandler
        import signal
        path = os.path.join(stack_dir, "stack-%s.txt" % os.environ["RANK"])
        faulthandler.register(signal.SIGUSR2, file=open(path, "a"), all_threads=True,
                              chain=False)
        open(os.path.join(stack_dir, "hook-%d" % os.getpid()), "w").close()


# Straggler sampling (see orchestrator/diagnosis.stragglers): a few times a second, is the
# main thread inside a collective? Under synchronous collectives the rank that makes the others
# wait is the one seldom seen waiting. Counting starts once the process group is up (imports
# and rendezvous say nothing), over a sliding window; one small file a second for the agent.
_COLLECTIVES = frozenset((
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "batch_isend_irecv", "wait_tensor"))
_COLLECTIVE_FILES = ("distributed_c10d.py", "_functional_collectives.py")


def _orchestrator_sampler():
    sample_dir = os.environ.get("ORCHESTRATOR_STACK_DIR")
    rank = os.environ.get("RANK")
    interval = float(os.environ.get("ORCHESTRATOR_SAMPLE_INTERVAL") or 0.1)
    # One sampler a rank: not in processes this worker starts (they inherit the marker).
    if not (sample_dir and rank and interval > 0) or os.environ.get("ORCHESTRATOR_SAMPLED"):
        return
    os.environ["ORCHESTRATOR_SAMPLED"] = rank
    import collections
    import threading
    import time
    main = threading.main_thread().ident
    path = os.path.join(sample_dir, "waits-%s.json" % rank)
    window = collections.deque(maxlen=max(1, int(30.0 / interval)))

    def waiting():
        frame, depth = sys._current_frames().get(main), 0
        while frame is not None and depth < 256:
            code = frame.f_code
            if code.co_name in _COLLECTIVES and code.co_filename.endswith(_COLLECTIVE_FILES):
                return True
            frame, depth = frame.f_back, depth + 1
        return False

    def started():  # torch.distributed initialized (only looked up, never imported here)
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        # While the main thread imports it, the module is there but half-made.
        initialized = getattr(c10d, "is_initialized", None)
        return initialized is not None and initialized()

    trigger = os.path.join(sample_dir, "flight-recorder-wanted")
    dump_prefix = (os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
                   or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))
    handled = [0.0]

    def dump_flight_recorder():
        # Asked by the agent (a hang): write what this rank's flight recorder holds where
        # torch itself dumps on a collective timeout. The main thread may be stuck inside a
        # collective; this thread is not.
        try:
            asked = os.stat(trigger).st_mtime
        except OSError:
            return
        if asked <= handled[0] or not dump_prefix or not started():
            return
        handled[0] = asked
        from torch._C import _distributed_c10d as c
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        nccl = "nccl" in str(c10d.get_backend()) and hasattr(c, "_dump_nccl_trace")
        dump = c._dump_nccl_trace if nccl else c._dump_fr_trace
        path = dump_prefix + rank
        # First without the call sites (at once), then with them: turning those into text
        # imports parts of torch, a second or more of CPU. Then say it is complete.
        for stack_traces in (False, True):
            data = dump(includeStackTraces=stack_traces)
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
        open(os.path.join(sample_dir, "flight-recorder-done-" + rank), "w").close()

    def run():
        next_write = 0.0
        while True:
            time.sleep(interval)
            try:
                dump_flight_recorder()
                w = waiting()
                if window or w or started():
                    window.append(w)
                now = time.monotonic()
                if window and now >= next_write:
                    next_write = now + 1.0
                    with open(path + ".tmp", "w") as f:
                        f.write('{"samples": %d, "waiting": %d, "interval": %g}'
                                % (len(window), sum(window), interval))
                    os.replace(path + ".tmp", path)
            except Exception:
                pass  # never the worker's problem, never a line in its output

    threading.Thread(target=run, name="orchestrator-sampler", daemon=True).start()


def _next_sitecustomize():
    # The one this file hides, run as it would have been (never put in sys.modules twice).
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


for _step in (_orchestrator_hook, _orchestrator_sampler, _next_sitecustomize):
    try:
        _step()
    except Exception:
        pass  # a worker must start, whatever happens here
'''
# orchestrator.heartbeat for nodes without the package (keep in step with heartbeat.py).
WORKER_MODULE = '''"""orchestrator_worker.heartbeat(step=None, **metrics), from the agent."""
import json
import os


def heartbeat(step=None, **metrics):
    path = os.environ.get("ORCHESTRATOR_HEARTBEAT_FILE")
    if not path:
        return
    if step is None and not metrics:
        open(path, "a").close()
        os.utime(path)
        return
    record = {"step": None if step is None else int(step),
              "metrics": {str(k): float(v) for k, v in metrics.items()}}
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(record))
    os.replace(path + ".tmp", path)
'''


# --- small helpers ---------------------------------------------------------------------------

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


def has_token(pid: int, token: str) -> bool:
    """Does process ``pid`` carry this agent's token in its environment?"""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return False
    return f"{TOKEN_VAR}={token}".encode() in environ.split(b"\0")


def processes_with_token(token: str) -> list[int]:
    """Pids of every process whose environment carries this agent's token."""
    me = os.getpid()
    return [int(e) for e in os.listdir("/proc")
            if e.isdigit() and int(e) != me and has_token(int(e), token)]


def pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (Linux 5.3+): it names that very process, never a recycled pid."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def kill_token_processes(token: str) -> None:
    """SIGKILL every process that carries the token. Each one is pinned with a pidfd and
    its token checked again through that pin, so a pid recycled since the scan is spared."""
    for pid in processes_with_token(token):
        fd = pidfd(pid)
        try:
            if not has_token(pid, token):  # the scan's process is gone; this is another
                continue
            if fd is not None:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            else:  # no pidfds here: the narrow window between check and kill remains
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        finally:
            if fd is not None:
                os.close(fd)


def start_watchdog(token: str, directory: str | None = None) -> None:
    """Fork a process that kills this agent's workers once the agent is gone, however it died,
    and removes the agent's directory if no new agent took it meanwhile."""
    agent_pid = os.getpid()
    if os.fork() != 0:
        return
    # The watchdog must hold nothing of the agent's: no socket, no pipe.
    os.closerange(3, 65536)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while os.getppid() == agent_pid:
        time.sleep(0.2)
    kill_token_processes(token)
    if directory and os.path.isdir(directory):
        try:
            with _lock(directory + ".lock"):  # relays launch under this lock
                probe = _connect_unix(os.path.join(directory, "agent.sock"))
                if probe is None:  # nobody serves there: the dead agent's leftovers
                    shutil.rmtree(directory, ignore_errors=True)
                else:
                    probe.close()
        except OSError:
            pass
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
    or scanning every distribution (importlib.metadata). The agent runs isolated (-I), so
    the places a worker's python also looks (PYTHONPATH, the user's site) are added."""
    import site

    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for entry in [*extra, site.getusersitepackages(), *sys.path]:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith("torch-") and name.endswith(".dist-info"):
                return name[len("torch-"):-len(".dist-info")]
    return None


# torch's flight recorder variables: the TORCH_FR_* names since 2.8 (the old TORCH_NCCL_*
# names still work there, with a deprecation warning in every process that sets them).
FR_SIZE_NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_DUMP_NAMES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def flight_recorder_names(torch: str | None) -> tuple[str, str]:
    """(buffer size, dump file) variable names that this torch reads without a warning."""
    m = re.match(r"(\d+)\.(\d+)", torch or "")
    old = m is not None and (int(m[1]), int(m[2])) < (2, 8)
    return (FR_SIZE_NAMES[1], FR_DUMP_NAMES[1]) if old else (FR_SIZE_NAMES[0], FR_DUMP_NAMES[0])


def machine_id() -> str:
    """This machine, as a short hash: its machine-id and its name (on Slurm, the node's)."""
    try:
        with open("/etc/machine-id", encoding="ascii", errors="replace") as f:
            ident = f.read(64).strip()
    except OSError:
        ident = ""
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return hashlib.sha256(f"{ident}\0{name}".encode()).hexdigest()[:16]


def gpu_count() -> int:
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
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


# --- where an agent lives ----------------------------------------------------------------------

def private_base() -> str:
    """This user's directory for agents: created 0700, and refused unless it is a real
    directory owned by this user that nobody else can enter (never one another user planted)."""
    # Not $TMPDIR: every controller of the job (a resumed one may have another environment)
    # must find the same agent.
    base = f"/tmp/orchestrator-{os.getuid()}"
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{base} is not a private directory of uid {os.getuid()} "
                           "(must be a directory, owned by the user, mode 0700)")
    return base


def agent_paths(job_id: str, node_index: int) -> tuple[str, str]:
    """(the agent's private directory, the outcome file beside it) for a job's node."""
    if not JOB_ID_RE.match(job_id) or not isinstance(node_index, int) or node_index < 0:
        raise ValueError(f"bad job id or node index: {job_id!r} {node_index!r}")
    base = private_base()
    name = f"{job_id}.{node_index}"
    return os.path.join(base, name), os.path.join(base, name + ".outcome")


# --- the relay ------------------------------------------------------------------------------------

def relay_main() -> int:
    """Join this process's stdin/stdout (the channel) to the job's agent socket."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def say(message: dict[str, Any]) -> None:
        stdout.write(P.encode(message))
        stdout.flush()

    first = P.decode(stdin.readline(P.MAX_MESSAGE))
    if first and first.get("op") == P.HOLD:
        return holder_main(str(first.get("job_id")), say)
    if not first or first.get("op") != P.CONNECT:
        say({"type": P.ERROR, "message": "expected connect"})
        return 2
    try:
        index = first.get("node_index")
        if not isinstance(index, int):
            raise ValueError(f"bad node index {index!r}")
        directory, outcome = agent_paths(str(first.get("job_id")), index)
        sock_path = os.path.join(directory, "agent.sock")
        launch = first.get("launch")
        sock = _connect_unix(sock_path)
        launched = False
        if sock is None and launch is not None:
            with _lock(directory + ".lock"):
                sock = _connect_unix(sock_path)  # another relay may have started it meanwhile
                if sock is None:
                    if launch.get("holder"):  # Slurm: the agent belongs to the holder's step
                        _start_agent_by_holder(str(first.get("job_id")), index, launch)
                    else:
                        _start_agent(directory, outcome, launch)
                    sock = _connect_unix(sock_path)
                    launched = True
        if sock is None:
            gone: dict[str, Any] = {"type": P.GONE}
            try:
                with open(outcome, encoding="utf-8") as f:
                    gone["outcome"] = json.loads(f.read(65536))
            except (OSError, ValueError):
                pass
            say(gone)
            if "outcome" in gone:  # told once: nothing of the job is left on the node
                os.unlink(outcome)
            return 0
    except Exception as exc:  # reported on the channel: the controller names the node
        say({"type": P.ERROR, "message": f"relay: {exc}"})
        return 2
    say({"type": P.RELAY, "launched": launched})
    _pump(sock, stdin, stdout)
    return 0


# --- the holder (Slurm) ------------------------------------------------------------------------
# Under ProctrackType=proctrack/cgroup, Slurm kills every process of a job step when the
# step ends, daemon or not: an agent started by a relay's step would die with its channel
# (a dropped connection, a replaced controller). So, on Slurm, each node runs a *holder*: a
# step of its own (kept open by the controller, outliving it) that starts the node's agent
# when a relay asks, so that the agent lives in the holder's step. The holder leaves once
# its controller has gone (its stdin closed) and no agent it started answers any more; a
# second holder on the node (a new controller's) waits on standby until the first leaves.

def holder_path(job_id: str) -> str:
    """The holder's socket on this node (namespaced test nodes share one filesystem: the
    Slurm node name tells them apart)."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if not JOB_ID_RE.match(job_id) or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", node):
        raise ValueError(f"bad job id or node name: {job_id!r} {node!r}")
    return os.path.join(private_base(), f"{job_id}.holder.{node}.sock")


def _start_agent_by_holder(job_id: str, node_index: int, config: dict[str, Any]) -> None:
    sock = _connect_unix(holder_path(job_id))
    if sock is None:
        raise RuntimeError("no holder step of the job on this node (Slurm)")
    with sock, sock.makefile("rwb") as f:
        f.write(P.encode({"op": "start", "node_index": node_index, "launch": config}))
        f.flush()
        reply = P.decode(f.readline(P.MAX_MESSAGE)) or {}
    if not reply.get("ok"):
        raise RuntimeError(f"the holder could not start the agent: {reply.get('error')}")


def holder_main(job_id: str, say: Any) -> int:
    path = holder_path(job_id)
    started: set[int] = set()
    controller = threading.Event()  # set once our stdin (the controller's end) closes

    def watch() -> None:
        try:
            while os.read(0, 65536):
                pass
        except (OSError, ValueError):
            pass
        controller.set()

    threading.Thread(target=watch, daemon=True).start()
    server: socket.socket | None = None
    said = False
    while True:
        if server is None:
            with _lock(path + ".lock"):
                other = _connect_unix(path)
                if other is None:
                    try:
                        os.unlink(path)  # a dead holder's
                    except FileNotFoundError:
                        pass
                    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    server.bind(path)
                    server.listen(16)
                    server.settimeout(1.0)
                else:
                    other.close()
            if not said:
                say({"type": P.HOLDING, "standby": server is None})
                said = True
        if server is None:
            time.sleep(1.0)
        else:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                conn = None
            if conn is not None:
                _serve_start(conn, job_id, started)
        if controller.is_set() and (server is not None or not started) and \
                not any(_agent_answers(job_id, index) for index in started):
            if server is not None:
                server.close()
                os.unlink(path)
            return 0


def _agent_answers(job_id: str, node_index: int) -> bool:
    probe = _connect_unix(os.path.join(agent_paths(job_id, node_index)[0], "agent.sock"))
    if probe is None:
        return False
    probe.close()
    return True


def _serve_start(conn: socket.socket, job_id: str, started: set[int]) -> None:
    conn.settimeout(30.0)
    with conn, conn.makefile("rwb") as f:
        try:
            request = P.decode(f.readline(P.MAX_MESSAGE)) or {}
            index, launch = request.get("node_index"), request.get("launch")
            if request.get("op") != "start" or not isinstance(launch, dict) or \
                    not isinstance(index, int):
                raise ValueError("expected start")
            directory, outcome = agent_paths(job_id, index)
            _start_agent(directory, outcome, launch)
            started.add(index)
            reply: dict[str, Any] = {"ok": True}
        except Exception as exc:  # said to the relay, which tells the controller
            reply = {"ok": False, "error": str(exc)}
        try:
            f.write(P.encode(reply))
            f.flush()
        except OSError:
            pass


def _connect_unix(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        s.close()
        return None
    return s


class _lock:
    """An exclusive flock on ``path``, so that two relays never start two agents."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *_: object) -> None:
        os.close(self.fd)


def _start_agent(directory: str, outcome: str, config: dict[str, Any]) -> None:
    """Start the agent as a daemon and return once its socket listens."""
    shutil.rmtree(directory, ignore_errors=True)  # a dead agent's leftovers
    try:
        os.unlink(outcome)
    except FileNotFoundError:
        pass
    os.mkdir(directory, 0o700)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: detach twice, so the agent is nobody's child and no session's
        try:
            os.close(ready_r)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            os.closerange(3, ready_w)
            os.closerange(ready_w + 1, 65536)
            devnull = os.open(os.devnull, os.O_RDWR)
            log = os.open(os.path.join(directory, "agent.log"),
                          os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)
            os.dup2(log, 2)
            code = 1
            try:
                agent = Agent(directory, outcome, config)
                agent.listen()
                os.write(ready_w, b"ok")
                os.close(ready_w)
                code = agent.run()
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        except BaseException:
            os._exit(1)
    os.close(ready_w)
    os.waitpid(pid, 0)
    with os.fdopen(ready_r, "rb") as ready:
        if ready.read(2) != b"ok":
            tail = ""
            try:
                with open(os.path.join(directory, "agent.log"), encoding="utf-8",
                          errors="replace") as f:
                    tail = " | ".join(f.read()[-2000:].strip().splitlines()[-3:])
            except OSError:
                pass
            raise RuntimeError(f"the agent did not start: {tail or 'no error given'}")


def _pump(sock: socket.socket, stdin: BinaryIO, stdout: BinaryIO) -> None:
    def upstream() -> None:  # controller -> agent
        try:
            while data := stdin.read1(65536):  # type: ignore[attr-defined]
                sock.sendall(data)
        except (OSError, ValueError):
            pass
        os._exit(0)  # the channel closed: the agent sees its connection end

    threading.Thread(target=upstream, daemon=True).start()
    try:
        while data := sock.recv(65536):
            stdout.write(data)
            stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(0)


# --- the outbox: numbering, sending, keeping, spooling -----------------------------------------

class Outbox:
    """Every message of the agent goes out through here, on one sender thread.

    Sequenced messages (protocol.SEQUENCED) get the next ``seq`` when they are sent or
    spooled, and stay in memory until the controller acknowledges them (at most
    ``WINDOW_BYTES`` of output in flight: beyond it output waits, and so do the workers).
    While no controller is attached they are appended to the spool file instead, up to
    ``spool_max_bytes`` for output (control messages are always kept); output past that
    cap is counted, and the count is reported as ``dropped`` messages.

    Control messages go before output that is waiting, except that a rank's ``exited`` is
    only queued once every line that rank printed has been numbered.
    """

    def __init__(self, spool_path: str, spool_max_bytes: int | None):
        self._cond = threading.Condition()
        self._conn: socket.socket | None = None
        self._pending_attach: tuple[socket.socket, int] | None = None
        self._control: collections.deque[dict[str, Any]] = collections.deque()
        # Output read but not yet numbered: per (attempt, rank, stream), oldest first.
        self._lines: collections.OrderedDict[tuple[int, Any, str], list[str]] = \
            collections.OrderedDict()
        self._key_bytes: collections.Counter[tuple[int, Any, str]] = collections.Counter()
        self._line_bytes = 0
        self._lines_since = 0.0
        self._added: collections.Counter[Any] = collections.Counter()  # lines per rank
        self._taken: collections.Counter[Any] = collections.Counter()
        self.seq = 0
        self._unacked: collections.deque[tuple[int, bytes]] = collections.deque()
        self._unacked_bytes = 0
        self._spool_path = spool_path
        self._spool_max = spool_max_bytes
        self._spool: BinaryIO | None = None
        self._spool_bytes = 0  # of output written to the spool since it was last emptied
        self._spool_offset = 0  # replayed up to here
        self._dropped: collections.Counter[tuple[Any, str, int]] = collections.Counter()
        self.detached_since: float | None = time.monotonic()
        self.hello: Any = None  # set by the agent: builds the hello message
        self.closed = False

    # --- producers (any thread) ------------------------------------------------------------
    def put(self, message: dict[str, Any]) -> None:
        with self._cond:
            if message.get("type") == P.EXITED:  # what was lost is said before the exit
                self._control.extend(self._take_dropped(message.get("rank")))
            self._control.append(message)
            self._cond.notify_all()

    def put_live(self, type_: str, lines: list[str]) -> None:
        """Live output (setup's): dropped while detached, and never more than a bounded
        backlog: the producer waits (its process then blocks on write)."""
        with self._cond:
            while len(self._control) > 256 and self._conn is not None and not self.closed:
                self._cond.wait(0.5)
            self._control.append({"type": type_, "attempt": 0, "lines": lines})
            self._cond.notify_all()

    def _take_dropped(self, rank: Any = ...) -> list[dict[str, Any]]:
        """``dropped`` messages for the counted lines of ``rank`` (default: every rank)."""
        out = []
        for key in sorted(self._dropped, key=str):
            r, stream, attempt = key
            if rank is ... or r == rank:
                out.append({"type": P.DROPPED, "attempt": attempt, "rank": r,
                            "stream": stream, "lines": self._dropped.pop(key)})
        return out

    def add_lines(self, attempt: int, rank: Any, stream: str, lines: list[str]) -> None:
        """Queue a worker's lines; blocks while too much output waits (backpressure)."""
        size = sum(map(len, lines)) + len(lines)
        with self._cond:
            while self._line_bytes > LINES_CAP and not self.closed:
                self._cond.wait(0.5)
            if not self._lines:
                self._lines_since = time.monotonic()
            key = (attempt, rank, stream)
            self._lines.setdefault(key, []).extend(lines)
            self._key_bytes[key] += size
            self._line_bytes += size
            self._added[rank] += len(lines)
            self._cond.notify_all()

    def wait_sent(self, rank: Any) -> None:
        """Until every line of ``rank`` queued so far has been numbered (sent or spooled)."""
        with self._cond:
            target = self._added[rank]
            while self._taken[rank] < target and not self.closed:
                self._cond.wait(0.5)

    # --- the controller's side (its connection's reader thread) ----------------------------
    def attach(self, conn: socket.socket, ack: int) -> None:
        with self._cond:
            if self._pending_attach is not None:
                _close(self._pending_attach[0])
            self._pending_attach = (conn, ack)
            old = self._conn
            self._cond.notify_all()
        if old is not None and old is not conn:
            try:  # the newer controller wins; this also frees a sender stuck writing to it
                old.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def ack(self, seq: int) -> None:
        with self._cond:
            self._forget(seq)
            self._cond.notify_all()

    def detach(self, conn: socket.socket) -> None:
        """The connection ended (or went silent): spool from now on."""
        with self._cond:
            if self._conn is conn:
                self._conn = None
                self.detached_since = time.monotonic()
                self._cond.notify_all()
        _close(conn)

    @property
    def attached(self) -> bool:
        return self._conn is not None

    def current(self) -> socket.socket | None:
        return self._conn

    def _forget(self, seq: int) -> None:
        while self._unacked and self._unacked[0][0] <= seq:
            self._unacked_bytes -= len(self._unacked.popleft()[1])

    # --- the sender thread -----------------------------------------------------------------
    def run(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            kind, conn, payload = job
            if kind == "attach":
                self._do_attach(conn, payload)
            elif conn is not None:
                self._write(conn, payload)

    def _next(self) -> tuple[str, Any, Any] | None:
        """The next thing to do: an attach, a control message, or a batch of output."""
        with self._cond:
            while True:
                if self.closed and not self._control:
                    return None
                if self._pending_attach is not None:
                    conn, ack = self._pending_attach
                    self._pending_attach = None
                    return "attach", conn, ack
                if self._control:
                    data = self._number(self._control.popleft())
                    if data is None:
                        continue
                    return "send", self._conn, data
                wait: float | None = None
                if self._lines and (self._conn is None or self._unacked_bytes < P.WINDOW_BYTES):
                    age = time.monotonic() - self._lines_since
                    if self._line_bytes >= P.BATCH_BYTES or age >= P.BATCH_DELAY:
                        data = self._take_batch()
                        if data is None:
                            continue
                        return "send", self._conn, data
                    wait = P.BATCH_DELAY - age
                self._cond.wait(wait)

    def _take_batch(self) -> bytes | None:
        key, lines = next(iter(self._lines.items()))
        if self._key_bytes[key] <= P.BATCH_BYTES * 3 // 2:
            batch, rest, size = lines, [], self._key_bytes[key]
        else:
            taken, size = 0, 0
            while taken < len(lines) and size < P.BATCH_BYTES:
                size += len(lines[taken]) + 1
                taken += 1
            batch, rest = lines[:taken], lines[taken:]
        del self._lines[key]
        if rest:
            self._lines[key] = rest  # to the back: ranks take turns
            self._key_bytes[key] -= size
        else:
            del self._key_bytes[key]
        self._line_bytes -= size
        attempt, rank, stream = key
        self._taken[rank] += len(batch)
        self._cond.notify_all()
        if self._conn is None and self._spool_max is not None and \
                self._spool_bytes + size > self._spool_max:
            self._dropped[(rank, stream, attempt)] += len(batch)
            return None
        return self._number({"type": P.OUTPUT, "attempt": attempt, "rank": rank,
                             "stream": stream, "lines": batch})

    def _number(self, message: dict[str, Any]) -> bytes | None:
        """Encode a message; number, keep or spool it if it is sequenced. None: nothing to
        write now (spooled, or a live-only message with nobody attached)."""
        if message.get("type") not in P.SEQUENCED:
            return P.encode(message) if self._conn is not None else None
        self.seq += 1
        message["seq"] = self.seq
        data = P.encode(message)
        if self._conn is not None and self._spool is None:
            self._unacked.append((self.seq, data))
            self._unacked_bytes += len(data)
            return data
        self._append_spool(data, message.get("type") == P.OUTPUT)
        return None

    def _append_spool(self, data: bytes, is_output: bool) -> None:
        if self._spool is None:
            self._spool = open(self._spool_path, "a+b")  # noqa: SIM115 (kept open)
            self._spool_offset = 0
        self._spool.write(data)
        if is_output:
            self._spool_bytes += len(data)

    def _write(self, conn: socket.socket, data: bytes) -> bool:
        try:
            conn.sendall(data)
            return True
        except OSError:
            self.detach(conn)
            return False

    def _do_attach(self, conn: socket.socket, ack: int) -> None:
        """A controller proved the secret: hello, then everything it has not kept, in order."""
        with self._cond:
            old, self._conn = self._conn, conn
            self.detached_since = None
            self._forget(ack)
            replay = list(self._unacked)
            self._control.extendleft(reversed(self._take_dropped()))
            hello = P.encode(self.hello())
        if old is not None and old is not conn:
            _close(old)
        if not self._write(conn, hello):
            return
        for _, data in replay:
            if not self._write(conn, data):
                return
        self._replay_spool(conn)

    def _replay_spool(self, conn: socket.socket) -> None:
        while True:
            with self._cond:
                if self._spool is None or self._conn is not conn:
                    return
                while self._unacked_bytes >= P.WINDOW_BYTES and self._conn is conn:
                    self._cond.wait(0.5)
                if self._conn is not conn:
                    return
                self._spool.flush()
                self._spool.seek(self._spool_offset)
                chunk = self._spool.readlines(256 * 1024)
                if not chunk:  # caught up: live from here on
                    self._spool.close()
                    self._spool = None
                    self._spool_bytes = 0
                    os.unlink(self._spool_path)
                    self._cond.notify_all()
                    return
                self._spool.seek(0, os.SEEK_END)
                for data in chunk:
                    self._spool_offset += len(data)
                    seq = json.loads(data).get("seq", 0)
                    self._unacked.append((seq, data))
                    self._unacked_bytes += len(data)
            if not self._write(conn, b"".join(chunk)):
                return

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


def _traces() -> str:
    """Where flight recorder dumps are kept, per job and attempt, after the agent is gone
    (a week: see _prune_traces)."""
    path = os.path.join(_cache(), "traces")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _prune_traces(keep_seconds: float = 7 * 24 * 3600) -> None:
    root, old = _traces(), time.time() - keep_seconds
    for job in os.listdir(root):
        path = os.path.join(root, job)
        try:
            if os.lstat(path).st_mtime < old:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _cache() -> str:
    """The agent user's cache (synced trees, blobs, setup markers): 0700, refused unless it
    is a real directory of this user, since synced code may hold secrets."""
    path = os.path.expanduser("~/.cache/orchestrator")
    if not os.path.isdir(path):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a directory of uid {os.getuid()}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _tree_root(workdir: str) -> str:
    """The synced tree a workdir lies in (or the workdir itself)."""
    base = os.path.join(os.path.expanduser("~/.cache/orchestrator"), "sync") + os.sep
    if workdir.startswith(base):
        return base + workdir[len(base):].split(os.sep, 1)[0]
    return workdir


def _blob(sha: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ValueError(f"bad blob name {sha!r}")
    return os.path.join(_cache(), "blobs", sha[:2], sha)


PRUNE_AFTER = 3600.0  # seconds unused before a tree or blob may go: other jobs share the cache


def _prune_trees(base: str, keep: int, current: str) -> None:
    """Keep the ``keep`` most recently used trees (and ``current``), and anything used in the
    last hour: a running agent touches its tree, and another job may be between uploading
    blobs and building its tree. Blobs that no kept tree uses go too, after the same hour."""
    old = time.time() - PRUNE_AFTER
    with _lock(os.path.join(base, ".prune.lock")):  # one pruner at a time per home
        _prune_locked(base, keep, current, old)


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except FileNotFoundError:  # another agent sharing this home removed it
        return 0.0


def _prune_locked(base: str, keep: int, current: str, old: float) -> None:
    for name in os.listdir(base):  # half-built trees of agents that died
        if ".building-" in name and _mtime(os.path.join(base, name)) < old:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    trees = sorted((os.path.join(base, d) for d in os.listdir(base)
                    if re.fullmatch(r"[0-9a-f]{24}", d)), key=_mtime, reverse=True)
    kept = set(trees[:keep]) | {current} | {t for t in trees if _mtime(t) > old}
    for tree in trees:
        if tree not in kept:
            shutil.rmtree(tree, ignore_errors=True)
    used: set[str] = set()
    for tree in kept:
        try:
            with open(os.path.join(tree, ".orchestrator-manifest.json")) as f:
                used.update(sha for _, sha, _ in json.load(f))
        except (OSError, ValueError):
            return  # cannot tell what is used: keep every blob
    blobs = os.path.join(_cache(), "blobs")
    for sub in os.listdir(blobs) if os.path.isdir(blobs) else ():
        for name in os.listdir(os.path.join(blobs, sub)):
            path = os.path.join(blobs, sub, name)
            stale_part = ".part-" in name and _mtime(path) < old
            unused = re.fullmatch(r"[0-9a-f]{64}", name) and name not in used and \
                _mtime(path) < old
            if stale_part or unused:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def _close(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


# --- workers -------------------------------------------------------------------------------------

class Worker:
    """One spawned process and the threads that stream its output and report its exit."""

    def __init__(self, agent: Agent, attempt: int, spec: dict[str, Any], proc: subprocess.Popen):
        self.agent = agent
        self.attempt = attempt
        self.rank = spec.get("rank")
        self.local_rank = spec.get("local_rank")
        self.label = self.rank if self.rank is not None else f"node{agent.node_index}"
        self.error_file = spec["env"].get("TORCHELASTIC_ERROR_FILE")
        self.heartbeat_file = spec["env"]["ORCHESTRATOR_HEARTBEAT_FILE"]
        self.proc = proc
        self.heartbeat_seen = 0.0  # mtime of its heartbeat file at the last look
        self.waits_seen = 0.0  # mtime of its sampler's file at the last look
        self.pidfd = pidfd(proc.pid)  # taken before anyone can reap it
        self.done = threading.Event()
        self._readers = [
            threading.Thread(target=self._read, args=(proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._read, args=(proc.stderr, "stderr"), daemon=True),
        ]

    def start_threads(self) -> None:
        for t in self._readers:
            t.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _read(self, pipe: BinaryIO, stream: str) -> None:
        fd = pipe.fileno()
        add = self.agent.outbox.add_lines
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
                    add(self.attempt, self.rank, stream, [_text(piece)])
                continue
            body, carry = data[:end], data[end + 1:]
            lines = body.decode("utf-8", "replace").split("\n")
            if len(body) > P.MAX_LINE and max(map(len, lines)) > P.MAX_LINE // 4:
                lines = _cut(lines)
            add(self.attempt, self.rank, stream, [ln.rstrip("\r") for ln in lines])
        if carry:
            add(self.attempt, self.rank, stream, _cut([_text(carry)]))
        pipe.close()

    def _wait(self) -> None:
        code = self.proc.wait()
        # Report the exit after the last output line, unless a stray child holds the pipe.
        for t in self._readers:
            t.join(timeout=2.0)
        self.agent.outbox.wait_sent(self.rank)
        exit_code, sig = (code, None) if code >= 0 else (None, signal_name(-code))
        self.agent.outbox.put({
            "type": P.EXITED, "attempt": self.attempt, "rank": self.rank,
            "local_rank": self.local_rank, "exit_code": exit_code, "signal": sig,
            "error_file": self._read_error_file(), "at": time.time(),
        })
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


def _py_spy() -> str | None:
    """py-spy beside this python, else on PATH; ``ORCHESTRATOR_PY_SPY=none`` never uses it
    (a site where ptrace is not wanted), another value names it."""
    chosen = os.environ.get("ORCHESTRATOR_PY_SPY")
    if chosen:
        return None if chosen == "none" else chosen
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def _one_stack(pid: int, rank: int, directory: str, attempt: int) -> dict[str, Any]:
    """One process's stack, and how it was taken."""
    tool = _py_spy()
    error = "py-spy not found"
    if tool:
        try:
            done = subprocess.run([tool, "dump", "--pid", str(pid)], capture_output=True,
                                  text=True, timeout=15, stdin=subprocess.DEVNULL)
            if done.returncode == 0 and done.stdout.strip():
                return {"method": "py-spy", "text": done.stdout[-65536:]}
            error = (done.stderr or done.stdout).strip()[-300:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            error = str(exc)
    stack_dir = os.path.join(directory, f"attempt-{attempt}")
    if os.path.exists(os.path.join(stack_dir, f"hook-{pid}")):  # or SIGUSR2 would kill it
        path = os.path.join(stack_dir, f"stack-{rank}.txt")
        try:
            before = os.path.getsize(path)
            os.kill(pid, signal.SIGUSR2)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and os.path.getsize(path) <= before:
                time.sleep(0.05)
            with open(path, encoding="utf-8", errors="replace") as f:
                f.seek(before)
                text = f.read(65536)
            if text.strip():
                return {"method": "faulthandler", "text": text,
                        "note": f"py-spy could not attach: {error}"}
        except OSError as exc:
            error += f"; faulthandler: {exc}"
    return {"method": "none", "text": "", "error": error}


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace").rstrip("\r")


def _cut(lines: list[str]) -> list[str]:
    """Lines longer than MAX_LINE characters, cut into pieces."""
    out: list[str] = []
    for line in lines:
        while len(line) > P.MAX_LINE:
            out.append(line[:P.MAX_LINE])
            line = line[P.MAX_LINE:]
        out.append(line)
    return out


# --- the agent -----------------------------------------------------------------------------------

class Agent:
    def __init__(self, directory: str, outcome_path: str, config: dict[str, Any]):
        self.directory = directory
        self.outcome_path = outcome_path
        self.secret = str(config["secret"])
        self.job_id = os.path.basename(directory).rsplit(".", 1)[0]
        self.node_index = int(os.path.basename(directory).rsplit(".", 1)[1])
        self.instance = secrets.token_hex(8)  # tells a controller this is not an older agent
        self.stop_grace = float(config.get("stop_grace") or 2.0)
        self.heartbeat_interval = float(config.get("heartbeat_interval") or 1.0)
        self.node_timeout = float(config.get("node_timeout") or 5.0)
        grace = config.get("controller_grace")
        self.controller_grace = None if grace is None else float(grace)
        spool_max = config.get("spool_max_bytes")
        self.outbox = Outbox(os.path.join(directory, "spool"),
                             None if spool_max is None else int(spool_max))
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
        self.preflight_listeners: list[socket.socket] = []
        self.workdir: str | None = None  # the running attempt's (a synced tree is kept fresh)
        self._sync_queue: queue.SimpleQueue[tuple[Any, dict[str, Any]]] | None = None
        self._touched = 0.0

    # --- start ---------------------------------------------------------------------------
    def listen(self) -> None:
        start_watchdog(self.token, self.directory)  # first: it must inherit no socket
        path = os.path.join(self.directory, "agent.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Mode set after the bind (its directory is 0700 anyway), never through the umask:
        # the agent's umask is what its workers inherit, as from torchrun.
        s.bind(path)
        os.chmod(path, 0o600)
        s.listen(16)
        self.listener = s
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: self.events.put(("signal", signum)))
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self.outbox.run, daemon=True).start()

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One controller connection: prove the secret, then read its commands."""
        reader = conn.makefile("rb")
        conn.settimeout(ATTACH_TIMEOUT)
        try:
            first = P.decode(reader.readline(P.MAX_MESSAGE))
        except OSError:
            first = None
        if first is None:
            _close(conn)
            return
        ok = (first.get("op") == P.ATTACH
              and hmac.compare_digest(str(first.get("secret", "")).encode(),
                                      self.secret.encode()))
        if not ok:
            _close(conn)
            return
        conn.settimeout(None)
        self.last_heard = time.monotonic()
        ack = first.get("ack")
        self.outbox.attach(conn, ack if isinstance(ack, int) else 0)
        try:
            for raw in iter(lambda: reader.readline(P.MAX_MESSAGE), b""):
                self.last_heard = time.monotonic()  # here: a slow op must not make pings late
                msg = P.decode(raw)
                if msg is None:
                    continue
                op = msg.get("op")
                if op == P.ACK:
                    seq = msg.get("seq")
                    if isinstance(seq, int):
                        self.outbox.ack(seq)
                elif op != P.PING:
                    self.events.put(("command", msg))
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
                self.finish(f"signal {signal_name(msg)}")
                return 128 + msg
            op = msg.get("op")
            if op == P.SHUTDOWN:
                self.finish(None)
                return 0
            handler = getattr(self, f"op_{op}", None)
            if handler is None:
                self.outbox.put({"type": P.ERROR, "attempt": self.attempt,
                                 "message": f"unknown op {op!r}"})
                continue
            try:
                handler(msg)
            except Exception as exc:  # report, never die: the controller decides
                if isinstance(msg.get("req"), int):  # a request: its asker must hear now
                    self._reply(msg, P.FAILED, error=f"{op}: {exc!r}")
                else:
                    self.outbox.put({"type": P.ERROR, "attempt": self.attempt,
                                     "message": f"{op}: {exc!r}"})

    def _tick(self, now: float) -> bool:
        """Heartbeat, progress, silence and grace checks. True: the agent gave up."""
        if self.workdir and self.workers and now - self._touched > 60:
            self._touched = now
            try:  # a tree in use must not look unused to another job's pruning
                os.utime(_tree_root(self.workdir))
            except OSError:
                pass
        conn = self.outbox.current()
        if conn is not None:
            if now - self.last_heard > self.node_timeout:
                self.outbox.detach(conn)  # silent controller: as if the channel dropped
            else:
                self.outbox.put({"type": P.HEARTBEAT, "attempt": self.attempt})
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

    def finish(self, reason: str | None) -> None:
        """Stop the workers, record why (unless the controller asked), remove our state."""
        running = [w.rank for w in self.workers if w.proc.poll() is None]
        self.stop_workers(grace=self.stop_grace)
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
        if self.listener is not None:
            self.listener.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        try:
            os.unlink(self.directory + ".lock")
        except OSError:
            pass

    def _worker_progress(self) -> tuple[bool, dict[str, Any]]:
        """Whether any worker called heartbeat() since the last look; the step and metrics
        those that gave them wrote (see orchestrator/heartbeat.py), and new sampler
        reports."""
        touched, ranks = False, dict[str, dict[str, Any]]()
        for w in list(self.workers):
            if w.rank is not None:
                waits = self._waits(w)
                if waits is not None:  # not a sign of life: a hung rank's sampler goes on
                    ranks.setdefault(str(w.rank), {})["waits"] = waits
            try:
                st = os.stat(w.heartbeat_file)
            except OSError:
                continue
            if st.st_mtime <= w.heartbeat_seen:
                continue
            w.heartbeat_seen, touched = st.st_mtime, True
            if st.st_size and w.rank is not None:
                try:
                    with open(w.heartbeat_file, encoding="utf-8") as f:
                        record = json.loads(f.read(16384))
                except (OSError, ValueError):
                    continue  # half a record, or not ours: the next look will do
                if isinstance(record, dict):
                    ranks.setdefault(str(w.rank), {}).update(
                        step=record.get("step"), metrics=record.get("metrics") or {},
                        at=st.st_mtime)
        return touched, ranks

    def _waits(self, w: Worker) -> list[int] | None:
        """[samples, of them waiting in a collective] from the rank's sampler, when new."""
        path = os.path.join(self.directory, f"attempt-{w.attempt}", f"waits-{w.rank}.json")
        try:
            mtime = os.stat(path).st_mtime
            if mtime <= w.waits_seen:
                return None
            with open(path, encoding="utf-8") as f:
                record = json.loads(f.read(4096))
            w.waits_seen = mtime
            return [int(record["samples"]), int(record["waiting"])]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # --- ops ---------------------------------------------------------------------------
    def _reply(self, msg: dict[str, Any], type_: str, **fields: Any) -> None:
        self.outbox.put({"type": type_, "req": msg.get("req"), "attempt": self.attempt,
                         **fields})

    def op_free_port(self, msg: dict[str, Any]) -> None:
        """A port free now: ``port`` (0: any), or the first free one of ``range`` [lo, hi]."""
        low, high = (int(x) for x in (msg.get("range") or (msg.get("port", 0),) * 2))
        # From a random place in the range: jobs launching together on one master should
        # not all take its first port.
        start = secrets.randbelow(high - low + 1) if high > low else 0
        for i in range(high - low + 1):
            port, ok = free_port(low + (start + i) % (high - low + 1))
            if ok:
                break
        self._reply(msg, P.PORT, port=port, ok=ok)

    def op_listen(self, msg: dict[str, Any]) -> None:
        """Hold listening sockets on ``port`` (0: any), or on every free port of ``ports``,
        so that peers can test that they reach them (preflight)."""
        for s in self.preflight_listeners:
            s.close()
        self.preflight_listeners = []
        wanted = msg.get("ports") or [msg.get("port", 0)]
        busy, error = [], None
        for port in wanted:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", int(port)))
                s.listen(64)
            except OSError as exc:
                s.close()
                busy.append(port)
                error = str(exc)
                continue
            self.preflight_listeners.append(s)
        ports = [s.getsockname()[1] for s in self.preflight_listeners]
        self._reply(msg, P.LISTENING, port=ports[0] if ports else msg.get("port"),
                    ports=ports, busy=busy, ok=bool(ports), error=error)

    def op_probe(self, msg: dict[str, Any]) -> None:
        """Report the interface toward ``address`` and whether ``address:port`` (or each of
        ``ports``) accepts TCP."""
        address = str(msg["address"])
        ports = [int(p) for p in (msg.get("ports") or [msg["port"]])]
        timeout = float(msg.get("timeout", 3))
        errors: dict[int, str] = {}

        def one(port: int) -> None:
            try:
                with socket.create_connection((address, port), timeout=timeout):
                    pass
            except OSError as exc:
                errors[port] = str(exc)

        threads = [threading.Thread(target=one, args=(p,)) for p in ports]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._reply(msg, P.PROBE_RESULT, interface=interface_for(address),
                    reachable=not errors, unreachable=sorted(errors),
                    error=next(iter(errors.values()), None))

    # --- stacks (see orchestrator/diagnosis.py) ----------------------------------------------
    def op_stacks(self, msg: dict[str, Any]) -> None:
        """Each live rank's Python stack: py-spy (needs ptrace), else the faulthandler hook
        every worker registered at start. On a thread: py-spy takes its time."""
        threading.Thread(target=self._stacks, args=(msg,), daemon=True).start()

    def _stacks(self, msg: dict[str, Any]) -> None:
        try:
            targets = self._rank_pids()
            wanted = bool(msg.get("flight_recorder")) and bool(targets)
            found: dict[str, dict[str, Any]] = {}
            threads = [threading.Thread(target=lambda r=r, p=p: found.__setitem__(
                str(r), _one_stack(p, r, self.directory, self.attempt))) for r, p in targets]
            for t in threads:
                t.start()
            # One deadline for both, inside the controller's: a late reply is a lost one.
            deadline = time.monotonic() + float(msg.get("timeout", 15))
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            traces = {}
            if wanted:
                # After the stacks: a rank's first dump imports parts of torch (a second or
                # more of CPU), which would show in them. Each rank's sampler looks for this
                # file ten times a second.
                asked_at = time.time()
                with open(os.path.join(self.directory, f"attempt-{self.attempt}",
                                       "flight-recorder-wanted"), "w"):
                    pass
                traces = self._trace_files([r for r, _ in targets], asked_at, deadline)
            self._reply(msg, P.STACKS, stacks=found, traces=traces)
        except Exception as exc:
            self._reply(msg, P.FAILED, error=f"stacks: {exc!r}")

    def _trace_files(self, ranks: list[int], since: float, deadline: float) -> dict[str, str]:
        """The flight recorder dumps the ranks wrote since ``since`` (waiting until
        ``deadline``, monotonic, for the last of them)."""
        prefix = os.path.join(self.traces_dir or "", "nccl_trace_rank_")
        done = os.path.join(self.directory, f"attempt-{self.attempt}", "flight-recorder-done-")
        found, complete = dict[str, str](), set[int]()
        while True:
            for r in ranks:
                try:
                    if os.stat(f"{prefix}{r}").st_mtime >= since - 1:
                        found[str(r)] = f"{prefix}{r}"
                    if os.stat(f"{done}{r}").st_mtime >= since - 1:
                        complete.add(r)
                except OSError:
                    pass
            # Complete dumps if they come in time; at the deadline, what there is, copied
            # aside: a dump still being completed must not change under the controller's read.
            if len(complete) == len(ranks) or time.monotonic() > deadline:
                kept = os.path.join(self.traces_dir or "", "on-hang")
                os.makedirs(kept, mode=0o700, exist_ok=True)
                for key, path in found.items():
                    found[key] = os.path.join(kept, os.path.basename(path))
                    shutil.copyfile(path, found[key])
                return found
            time.sleep(0.1)

    def op_read_trace(self, msg: dict[str, Any]) -> None:
        """A piece (up to 1 MiB, base64) of a flight recorder dump under this user's traces
        directory; nothing else is readable this way."""
        root = os.path.realpath(_traces()) + os.sep
        path = os.path.realpath(str(msg.get("path")))
        if not path.startswith(root):
            raise PermissionError(f"not a flight recorder dump: {msg.get('path')!r}")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(int(msg.get("offset") or 0))
            data = f.read(1024 * 1024)
        self._reply(msg, P.TRACE_CHUNK, data=base64.b64encode(data).decode(), size=size)

    def _rank_pids(self) -> list[tuple[int, int]]:
        """(rank, pid) of every live worker; torchrun's workers by their RANK."""
        out = []
        for w in list(self.workers):
            if w.proc.poll() is not None:
                continue
            if w.rank is not None:
                out.append((int(w.rank), w.proc.pid))
                continue
            for pid in processes_with_token(self.token):  # c10d: torchrun's children
                try:
                    with open(f"/proc/{pid}/stat", "rb") as f:
                        parent = int(f.read().rsplit(b")", 1)[1].split()[1])
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
                except (OSError, ValueError):
                    continue
                if parent == w.proc.pid and b"RANK" in env:
                    out.append((int(env[b"RANK"]), pid))
        return out

    # --- code and setup on the node (see orchestrator/sync.py) -----------------------------
    # Hashing and copying can take long: sync ops run in order on a thread of their own, so
    # that heartbeats go on.
    def _in_sync_thread(self, handler: Any, msg: dict[str, Any]) -> None:
        if self._sync_queue is None:
            self._sync_queue = queue.SimpleQueue()
            threading.Thread(target=self._sync_worker, daemon=True).start()
        self._sync_queue.put((handler, msg))

    def _sync_worker(self) -> None:
        assert self._sync_queue is not None
        while True:
            handler, msg = self._sync_queue.get()
            try:
                handler(msg)
            except Exception as exc:
                self._reply(msg, P.FAILED, error=f"{msg.get('op')}: {exc!r}")

    def op_sync_missing(self, msg: dict[str, Any]) -> None:
        self._in_sync_thread(self._sync_missing, msg)

    def op_sync_put(self, msg: dict[str, Any]) -> None:
        self._in_sync_thread(self._sync_put, msg)

    def op_sync_build(self, msg: dict[str, Any]) -> None:
        self._in_sync_thread(self._sync_build, msg)

    def _sync_missing(self, msg: dict[str, Any]) -> None:
        """Which of these blobs (sha256) this node's cache lacks."""
        missing = []
        for sha in msg.get("blobs", []):
            try:
                os.utime(_blob(str(sha)))  # in use again: not for pruning within the hour
            except FileNotFoundError:
                missing.append(sha)
        self._reply(msg, P.SYNC_MISSING, missing=missing)

    def _sync_put(self, msg: dict[str, Any]) -> None:
        """One chunk of a blob; the last one checks the whole blob's sha256."""
        sha, offset = str(msg["sha"]), int(msg["offset"])
        final = _blob(sha)
        # Our own file, unique even across machines sharing this home (NFS).
        part = f"{final}.part-{socket.gethostname()}-{os.getpid()}-{msg.get('part', 0)}"
        os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
        with open(part, "r+b" if offset else "wb") as f:
            f.seek(offset)
            f.write(base64.b64decode(msg["data"]))
        if msg.get("last"):
            digest = hashlib.sha256()
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            if digest.hexdigest() != sha:
                os.unlink(part)
                self._reply(msg, P.SYNC_PUT, ok=False, error=f"blob {sha[:12]} arrived corrupt")
                return
            os.replace(part, final)
        self._reply(msg, P.SYNC_PUT, ok=True)

    def _sync_build(self, msg: dict[str, Any]) -> None:
        """Build tree ``tree`` from cached blobs (once), prune old trees, reply its path.
        Shipped files are read-only: a job that edits its copy would change it for every
        later job of the same tree (outputs belong outside it)."""
        tree, files, keep = str(msg["tree"]), msg["files"], int(msg.get("keep", 5))
        if not re.fullmatch(r"[0-9a-f]{24}", tree):
            raise ValueError(f"bad tree name {tree!r}")
        base = os.path.join(_cache(), "sync")
        os.makedirs(base, mode=0o700, exist_ok=True)
        path = os.path.join(base, tree)
        if not os.path.isdir(path):
            building = tempfile.mkdtemp(prefix=f"{tree}.building-", dir=base)
            for rel, sha, executable in files:
                dest = os.path.join(building, rel)
                if os.path.isabs(rel) or ".." in rel.split("/"):
                    raise ValueError(f"bad path in manifest: {rel!r}")
                os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
                shutil.copyfile(_blob(sha), dest)  # a copy: never the cache's own blob
                os.chmod(dest, 0o555 if executable else 0o444)
            with open(os.path.join(building, ".orchestrator-manifest.json"), "w") as f:
                json.dump(files, f)
            try:
                os.rename(building, path)
            except OSError:  # another agent sharing this home built it meanwhile
                shutil.rmtree(building, ignore_errors=True)
        os.utime(path)
        _prune_trees(base, keep, path)
        self._reply(msg, P.SYNC_BUILT, path=path)

    def op_setup(self, msg: dict[str, Any]) -> None:
        """Run the job's setup script once per (script, tree): on this node it is skipped
        when that key succeeded before. Output streams as ``setup_output`` while it runs."""
        threading.Thread(target=self._setup, args=(msg,), daemon=True).start()

    def _setup(self, msg: dict[str, Any]) -> None:
        try:
            self._run_setup(msg)
        except Exception as exc:  # the controller waits for an answer: always give one
            self._reply(msg, P.FAILED, error=f"setup: {exc!r}")

    def _run_setup(self, msg: dict[str, Any]) -> None:
        key = str(msg["key"])
        if not re.fullmatch(r"[0-9a-f]{32}", key):
            raise ValueError(f"bad setup key {key!r}")
        marks = os.path.join(_cache(), "setup")
        os.makedirs(marks, mode=0o700, exist_ok=True)
        # The key names the node as the controller does; the machine is added here: nodes
        # that share a home (NFS, every Slurm site) each run their own setup.
        marker = f"{key}.{machine_id()}"
        done = os.path.join(marks, f"{marker}.ok")
        with _lock(os.path.join(marks, f"{marker}.lock")):  # one run per key and machine
            if os.path.exists(done):
                self._reply(msg, P.SETUP_DONE, exit_code=0, cached=True, tail=[])
                return
            env = dict(os.environ)
            env.update(msg.get("env") or {})
            env[TOKEN_VAR] = self.token  # whatever it starts is found by the token sweep
            tail: collections.deque[str] = collections.deque(maxlen=20)
            try:
                proc = subprocess.Popen(["/bin/sh", "-c", str(msg["script"])],
                                        cwd=os.path.expanduser(msg.get("workdir") or "."),
                                        env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=_set_pdeathsig)
            except OSError as exc:
                self._reply(msg, P.SETUP_DONE, exit_code=127, cached=False, tail=[str(exc)])
                return
            out = proc.stdout
            assert out is not None
            batch: list[str] = []
            sent = time.monotonic()
            for raw in iter(lambda: out.readline(P.MAX_LINE), b""):
                line = _text(raw.rstrip(b"\n"))
                tail.append(line)
                batch.append(line)
                if len(batch) >= 200 or time.monotonic() - sent > 0.1:
                    self.outbox.put_live(P.SETUP_OUTPUT, batch)  # waits if far behind
                    batch, sent = [], time.monotonic()
            if batch:
                self.outbox.put_live(P.SETUP_OUTPUT, batch)
            code = proc.wait()
            if code == 0:
                open(done, "w").close()
            self._reply(msg, P.SETUP_DONE, exit_code=code, cached=False, tail=list(tail))

    def op_start(self, msg: dict[str, Any]) -> None:
        attempt = int(msg["attempt"])
        if attempt <= self.attempt:
            return  # already started (a controller re-sent it after reattaching)
        self.stop_workers(grace=float(msg.get("stop_grace", 5.0)))
        self.attempt = attempt
        workdir = os.path.expanduser(msg.get("workdir") or ".")
        self.workdir = workdir
        # The node's world, as torchrun started here would pass it on: the agent's own
        # environment, which it never changes (see worker_world()).
        base_env = dict(os.environ)
        base_env.update(msg.get("env") or {})
        for key, value in (msg.get("defaults") or {}).items():
            base_env.setdefault(key, value)
        # Several nodes: gloo and NCCL must not bind the hostname's address (often 127.0.x.1).
        iface = interface_for(msg["route_to"]) if msg.get("route_to") else None
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if iface and var not in base_env:
                base_env[var] = iface
        if "PWD" in base_env:  # a shell keeps PWD at its cwd: torchrun run from the workdir
            base_env["PWD"] = os.path.abspath(workdir)
        base_env[TOKEN_VAR] = self.token
        self._flight_recorder_env(base_env, attempt, int(msg.get("flight_recorder") or 0))
        shim = self._worker_module()
        base_env["ORCHESTRATOR_STACK_DIR"] = os.path.join(self.directory,
                                                          f"attempt-{attempt}")
        base_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (base_env.get("PYTHONPATH"), shim) if p)  # last: the user's win
        attempt_dir = os.path.join(self.directory, f"attempt-{self.attempt}")
        for spec in msg["workers"]:
            try:
                proc, spec = self._spawn(spec, base_env, attempt_dir, workdir)
            except Exception as exc:  # the controller must hear of every rank, or it waits
                error = f"{spec['argv'][0]}: {getattr(exc, 'strerror', None) or exc}"
                self.outbox.put({"type": P.SPAWN_FAILED, "attempt": attempt,
                                 "rank": spec.get("rank"), "local_rank": spec.get("local_rank"),
                                 "error": error})
                continue
            # "started" is queued before the first output line can be read.
            self.outbox.put({"type": P.STARTED, "attempt": attempt, "rank": spec.get("rank"),
                             "local_rank": spec.get("local_rank"), "pid": proc.pid})
            worker = Worker(self, attempt, spec, proc)
            self.workers.append(worker)
            worker.start_threads()

    def _flight_recorder_env(self, env: dict[str, str], attempt: int, entries: int) -> None:
        """torch's flight recorder on (the last ``entries`` collectives of each process group,
        NCCL or gloo), unless the job set it; dumps, on a collective timeout (torch) or a hang
        (the agent asks), go to a directory that outlives this agent."""
        directory = os.path.join(_traces(), self.job_id, f"attempt-{attempt}")
        self.traces_dir = directory
        if entries <= 0:
            return
        _prune_traces()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        # One name each, the one this torch reads: setting both the new and the deprecated
        # name makes every rank print a deprecation warning.
        size, dump = flight_recorder_names(torch_version())
        if not any(name in env for name in FR_SIZE_NAMES):
            env[size] = str(entries)
        env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        if not any(name in env for name in FR_DUMP_NAMES):
            env[dump] = os.path.join(directory, "nccl_trace_rank_")  # torch's own file names


    def _worker_module(self) -> str:
        """A directory holding ``orchestrator_worker.py`` (heartbeat with steps and metrics)
        for workers on nodes where the orchestrator is not installed."""
        path = os.path.join(self.directory, "pythonpath")
        os.makedirs(path, mode=0o700, exist_ok=True)
        for name, text in (("orchestrator_worker.py", WORKER_MODULE),
                           ("sitecustomize.py", SITECUSTOMIZE)):
            with open(os.path.join(path, name), "w", encoding="utf-8") as f:
                f.write(text)
        return path

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
        if attempt < self.attempt:  # a late stop of an older attempt: those are gone
            self.outbox.put({"type": P.STOPPED, "attempt": attempt})
            return
        # Stopping can take the whole grace period: do it aside so heartbeats keep flowing.
        threading.Thread(target=self._stop_and_report, args=(attempt, grace), daemon=True).start()

    def _stop_and_report(self, attempt: int, grace: float) -> None:
        self.stop_workers(grace)
        self.outbox.put({"type": P.STOPPED, "attempt": attempt})

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
                w.done.wait(timeout=60.0)  # its exit is queued after its last line
                w.close()
            deadline = time.monotonic() + 5.0
            while processes_with_token(self.token) and time.monotonic() < deadline:
                kill_token_processes(self.token)
                time.sleep(0.05)


def main() -> int:
    return relay_main()


if __name__ == "__main__":
    sys.exit(main())
