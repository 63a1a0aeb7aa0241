"""Warm restarts: per local rank, a standby interpreter that has started and imported torch
(and ``restart.warm_imports``); the next attempt's worker of that local rank is that process
instead of a new interpreter. The standby's side is ``agents/shims/standby_boot.py``.

A standby is started as its local rank's last worker was (the same interpreter and flags,
cwd, umask, environment), less what is read at a worker's start and never at import
(``START_KEYS``: ranks and sizes, the master's address, torchelastic's and our own
variables). A start whose command or import-time environment differs from its standby's, or
whose command is not ``python [flags] script`` or ``python [flags] -m module``, is cold, and
the rank's log says why. Standbys are started on the agent's main thread (a child's
PDEATHSIG fires when the thread that forked it ends) and carry a token of their own, so that
stopping an attempt's workers spares them; a worker that was a standby keeps that token in
``/proc/<pid>/environ`` (the kernel's copy of its first environment), so the stop's sweep
also looks for it, sparing the standbys.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agents import source
from agents.containment import spawn
from agents.processes import TOKEN_VAR, as_launched, kill_token_processes, standby_token

# Read by torch, torchelastic and the shims when a worker starts, never at import: they may
# differ between a standby and the worker it becomes.
START_KEYS = frozenset({
    "RANK", "LOCAL_RANK", "ROLE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"})
START_PREFIXES = ("ORCHESTRATOR_", "TORCHELASTIC_")
KEPT = frozenset({"ORCHESTRATOR_JOB_ID"})  # the same for every attempt: finds the job's processes
DEFAULT_IMPORTS = ("torch",)
# Imported if they can be: torch imports its compiler lazily at the first call of anything it
# wraps against dynamo, which every optimizer's constructor is (0.85 s of a restart on a
# 2-core machine, for a module the cold worker would import all the same).
LIKELY_IMPORTS = ("torch._dynamo",)
_NO_ARGUMENT_FLAGS = set("bBdEIOPqsSuv")


@dataclass(frozen=True)
class PythonCommand:
    """``python [flags] script args`` or ``python [flags] -m module args``."""

    interpreter: str
    flags: tuple[str, ...]
    module: str | None
    script: str | None
    args: tuple[str, ...]

    def sys_argv(self) -> list[str]:
        """sys.argv when the script starts (runpy puts the module's file in [0] for -m)."""
        return ["-m" if self.module else str(self.script), *self.args]

    def path0(self, cwd: str) -> str:
        """What Python puts first on sys.path (unless -P, -I or PYTHONSAFEPATH)."""
        if self.module:
            return os.path.abspath(cwd)
        return os.path.dirname(os.path.realpath(os.path.join(cwd, str(self.script))))


def parse(argv: list[str]) -> PythonCommand | None:
    """The command as a Python start a standby can take, or None (-c, stdin, not python)."""
    if not argv or not os.path.basename(argv[0]).startswith("python"):
        return None
    flags, i = list[str](), 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" or (arg.startswith("-m") and len(arg) > 2):
            module = arg[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[i + 1 + (arg == "-m"):]
            return PythonCommand(argv[0], tuple(flags), module, None, tuple(rest)) \
                if module else None
        if not arg.startswith("-") or arg == "-":
            if arg == "-":
                return None
            return PythonCommand(argv[0], tuple(flags), None, arg, tuple(argv[i + 1:]))
        if arg[1:2] in ("X", "W"):
            if len(arg) > 2:
                flags.append(arg)
            elif i + 1 < len(argv):
                flags += [arg, argv[i + 1]]
                i += 1
            else:
                return None
        elif len(arg) > 1 and set(arg[1:]) <= _NO_ARGUMENT_FLAGS:
            flags.append(arg)
        else:
            return None
        i += 1
    return None


def import_env(env: dict[str, str]) -> dict[str, str]:
    """What of a worker's environment its interpreter and imports may read."""
    return {k: v for k, v in env.items()
            if k in KEPT or (k not in START_KEYS and not k.startswith(START_PREFIXES))}


def runnable_script(command: PythonCommand, cwd: str) -> bool:
    """A source file Python would run as it is (not a directory, a zip or a .pyc)."""
    if command.module:
        return True
    path = os.path.join(cwd, str(command.script))
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return os.path.isfile(path) and head != b"PK\x03\x04" and not path.endswith(".pyc")


@dataclass
class Standby:
    proc: subprocess.Popen[bytes]
    channel: socket.socket
    key: tuple[Any, ...]

    def failure(self) -> str:
        """Why the standby ended on its own (an import failed), as it said."""
        self.channel.setblocking(False)
        said = b""
        try:
            said = self.channel.recv(65536)
        except OSError:
            pass
        for line in said.splitlines():
            try:
                failed = json.loads(line).get("failed")
            except (ValueError, AttributeError):
                continue
            if failed:
                return str(failed)
        return f"the standby ended (exit {self.proc.returncode})"

    def end(self) -> None:
        """Kill the standby (its group, while it leads it) and reap it."""
        self.channel.close()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class Standbys:
    """An agent's standbys, one per local rank."""

    def __init__(self, agent_token: str, directory: str):
        self.token = standby_token(agent_token)
        self.directory = directory
        self.lock = threading.Lock()  # spawning vs the stop's sweep
        self._by_local: dict[int, Standby] = {}
        self._failed: dict[tuple[Any, ...], str] = {}  # a key whose imports failed
        self._due: tuple[float, list[tuple[Any, ...]]] | None = None  # see schedule()
        self._ever = False  # any standby started: only then is there anything to sweep

    @staticmethod
    def key(command: PythonCommand, env: dict[str, str], cwd: str,
            imports: tuple[str, ...]) -> tuple[Any, ...]:
        return (command.interpreter, command.flags, command.module, command.script,
                os.path.abspath(cwd), tuple(sorted(import_env(env).items())), imports)

    def take(self, local_rank: int, argv: list[str], env: dict[str, str], cwd: str,
             imports: tuple[str, ...], enter: Callable[[int], None] | None = None
             ) -> tuple[subprocess.Popen[bytes] | None, str | None]:
        """The worker ``argv`` started from this local rank's standby, or None and why not
        (None, None: there was none yet, as before the first start). ``enter(pid)`` runs
        before the standby is told to go (its attempt's cgroup: its children follow)."""
        command = parse(argv)
        with self.lock:
            standby = self._by_local.pop(local_rank, None)
        if command is None:
            if standby is not None:
                standby.end()
            return None, "the command is not `python [flags] script` or `python -m module`"
        key = self.key(command, env, cwd, imports)
        if standby is None:
            return None, self._failed.get(key)
        if standby.key != key:
            standby.end()
            return None, _what_changed(standby.key, key)
        if standby.proc.poll() is not None:
            reason = standby.failure()
            self._failed[key] = reason
            standby.end()
            return None, reason
        start = {"env": env, "cwd": os.path.abspath(cwd), "argv": argv,
                 "sys_argv": command.sys_argv(), "module": command.module,
                 "script": command.script}
        if enter is not None:
            enter(standby.proc.pid)
        try:
            standby.channel.sendall((json.dumps(start) + "\n").encode())
        except OSError as exc:
            standby.end()
            return None, f"the standby could not be told: {exc}"
        standby.channel.close()
        return standby.proc, None

    def refill(self, local_rank: int, argv: list[str], env: dict[str, str], cwd: str,
               imports: tuple[str, ...]) -> None:
        """Start this local rank's next standby, unless it has one for the same start or it
        cannot be warm. One for another start (a spare told of a new place) is replaced."""
        command = parse(argv)
        if command is None or not runnable_script(command, cwd):
            return
        key = self.key(command, env, cwd, imports)
        with self.lock:
            old = self._by_local.get(local_rank)
            if old is not None and old.key == key:
                return
            if old is not None:
                del self._by_local[local_rank]
        if old is not None:
            old.end()
        if key in self._failed:
            return
        try:  # never the agent's problem: the next start is cold, that is all
            self._spawn(local_rank, command, env, cwd, imports, key)
        except OSError as exc:
            self._failed[key] = f"no standby could be started: {exc}"

    def _spawn(self, local_rank: int, command: PythonCommand, env: dict[str, str], cwd: str,
               imports: tuple[str, ...], key: tuple[Any, ...]) -> None:
        boot = os.path.join(self.directory, "standby_boot.py")
        if not os.path.exists(boot):
            with open(boot, "w", encoding="utf-8") as f:
                f.write(source("agents.shims.standby_boot"))
        parent, child = socket.socketpair()
        standby_env = {**import_env(env), TOKEN_VAR: self.token}
        with self.lock:
            try:
                proc = spawn(
                    [command.interpreter, *command.flags, boot, str(child.fileno())],
                    cwd=cwd, env=standby_env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(child.fileno(),),
                    start_new_session=True, preexec_fn=as_launched)
            except OSError:
                parent.close()
                raise
            finally:
                child.close()
            self._by_local[local_rank] = Standby(proc, parent, key)
            self._ever = True
        prepare = {"path0": command.path0(cwd), "imports": [*DEFAULT_IMPORTS, *imports],
                   "likely": list(LIKELY_IMPORTS)}
        parent.sendall((json.dumps(prepare) + "\n").encode())

    def schedule(self, refills: list[tuple[Any, ...]], at: float) -> None:
        """Refill these (``refill``'s arguments) at monotonic time ``at``, or sooner once every
        worker is under way (``refill_due``)."""
        self._due = (at, refills)

    def refill_due(self, now: float, workers_under_way: bool) -> None:
        """Start the scheduled standbys if their time came. Call it from the agent's main
        thread: a child's PDEATHSIG fires when the thread that started it ends."""
        if self._due is None or (now < self._due[0] and not workers_under_way):
            return
        refills, self._due = self._due[1], None
        for args in refills:
            self.refill(*args)

    def sweep(self) -> None:
        """Kill what carries the standby token and is no standby: workers that were
        standbys, and their children, once their attempt is stopped. A scan of /proc: not
        for an agent that never started a standby (restart.warm off)."""
        if not self._ever:
            return
        with self.lock:
            kill_token_processes(self.token, spare={s.proc.pid for s in self._by_local.values()})

    def close(self) -> None:
        self._due = None
        with self.lock:
            standbys, self._by_local = list(self._by_local.values()), {}
        for s in standbys:
            s.end()
        if self._ever:
            kill_token_processes(self.token)


def _what_changed(before: tuple[Any, ...], now: tuple[Any, ...]) -> str:
    names = ("the interpreter", "its flags", "the module", "the script", "the workdir")
    for name, a, b in zip(names, before, now):  # noqa: B905 (any python3)
        if a != b:
            return f"{name} changed"
    if before[5] != now[5]:
        old, new = dict(before[5]), dict(now[5])
        keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        return f"the environment changed since the standby started ({', '.join(keys[:5])})"
    return "restart.warm_imports changed"
