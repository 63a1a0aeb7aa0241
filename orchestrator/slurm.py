"""Slurm allocations: request one (``salloc --no-shell``), find the one we run inside
(``SLURM_JOB_ID``), read its nodes, and release it (``scancel``) when it is ours.

An allocation is a record the job keeps in the store (``Allocation.to_dict``): the Slurm job
id, whether the orchestrator requested it (``owned``: then it releases it) and, once granted,
the node names and their addresses. The controller requests it before its first attempt and
records the id as soon as salloc prints it, so a replaced controller (``--resume``) finds the
same allocation, pending or granted, instead of asking for another one. The transport that
reaches the agents through ``srun --overlap`` is ``transport/slurm.py``.

Every Slurm command runs as an argv list (no shell), with ``SLURM_CONF`` from the environment
and no other ``SLURM_*`` variable: those of an enclosing job (an sbatch script that runs
``orchestrator submit``) would otherwise change what salloc and srun request.

Parsing is kept in small pure functions (``parse_*``) so that it can be tested without Slurm.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.errors import AllocationRefused, LaunchError, SpecError
from orchestrator.spec import JobSpec, NodeSpec, SlurmSpec

log = logging.getLogger("orchestrator.controller")

COMMAND_TIMEOUT = 30.0  # seconds for one scontrol/squeue/scancel: slurmctld answers in ms
_ALLOCATION_RE = re.compile(r"(?:Granted|Pending) job allocation (\d+)")
_JOB_ID_RE = re.compile(r"^\d+(_\d+)?$")
# Node names come from Slurm and go to `srun -w`: checked anyway (argv, but no surprises).
_NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ENDED = {"CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
          "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}


class AllocationWaitStopped(Exception):
    """Waiting for an allocation was given up on request (a cancel, or the controller told
    to exit): the pending request was cancelled. Not an error: the job does not go on."""


@dataclass
class Allocation:
    """A Slurm allocation that the job runs on."""

    job_id: str
    owned: bool  # requested by the orchestrator: released when the job ends
    nodes: list[str] = field(default_factory=list)  # empty while not granted
    addresses: list[str | None] = field(default_factory=list)  # NodeAddr, in nodes' order
    released: bool = False  # scancel'd by us

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "owned": self.owned, "nodes": self.nodes,
                "addresses": self.addresses, "released": self.released}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Allocation:
        return cls(str(data["job_id"]), bool(data["owned"]), list(data.get("nodes") or []),
                   list(data.get("addresses") or []), bool(data.get("released")))


# --- pure parsing ----------------------------------------------------------------------------

def parse_salloc_line(line: str) -> str | None:
    """The Slurm job id in a line salloc prints (``Granted/Pending job allocation J``)."""
    m = _ALLOCATION_RE.search(line)
    return m.group(1) if m else None


def parse_hostnames(text: str) -> list[str]:
    """``scontrol show hostnames LIST``: one node name per line."""
    names = [line.strip() for line in text.splitlines() if line.strip()]
    for name in names:
        if not _NODE_NAME_RE.match(name):
            raise LaunchError(f"slurm: unexpected node name {name!r} from scontrol")
    return names


def parse_job(text: str) -> dict[str, str]:
    """``scontrol -o show job J``: the fields this module needs (JobState, NodeList,
    Partition), by exact key (``ReqNodeList=`` is not ``NodeList=``)."""
    out = {}
    for key in ("JobState", "NodeList", "Partition", "NumNodes"):
        m = re.search(rf"(?:^|\s){key}=(\S*)", text)
        if m:
            out[key] = m.group(1)
    return out


def parse_node_addresses(text: str) -> dict[str, str]:
    """``scontrol -o show node LIST``: NodeName -> NodeAddr, one node per line."""
    out = {}
    for line in text.splitlines():
        name = re.search(r"(?:^|\s)NodeName=(\S+)", line)
        addr = re.search(r"(?:^|\s)NodeAddr=(\S+)", line)
        if name and addr:
            out[name.group(1)] = addr.group(1)
    return out


def salloc_error(spec: SlurmSpec, stderr: str) -> SpecError | AllocationRefused:
    """salloc's refusal as one line naming the setting at fault."""
    errors = [ln.split("error:", 1)[1].strip() for ln in stderr.splitlines() if "error:" in ln]
    detail = errors[-1] if errors else (stderr.strip().splitlines() or ["no output"])[-1]
    low = " ".join(errors).lower()
    for key, setting in (("partition", "partition"), ("account", "account"),
                         ("gres", "gres"), ("generic resource", "gres"),
                         ("time limit", "time")):
        if key in low:
            value = getattr(spec, setting)
            return SpecError(f"slurm.{setting}", f"refused by Slurm: {detail}", value,
                             has_value=value is not None)
    return AllocationRefused(f"slurm: salloc failed: {detail}")


def salloc_argv(spec: SlurmSpec, name: str, exclude: Sequence[str] = ()) -> list[str]:
    """The allocation request: ``salloc --no-shell`` with the spec's settings; ``exclude``:
    nodes not to allocate (quarantined ones), joined to the spec's own ``--exclude``."""
    argv = ["salloc", "--no-shell", f"--nodes={spec.nodes}", f"--job-name={name}"]
    for option, value in (("--partition", spec.partition), ("--time", spec.time),
                          ("--account", spec.account), ("--gres", spec.gres)):
        if value is not None:
            argv.append(f"{option}={value}")
    extra = list(spec.extra)
    if exclude:
        # Slurm takes the last of several --exclude: the spec's own names join ours.
        own = [item for item in extra if item.startswith(("--exclude=", "-x"))]
        extra = [item for item in extra if item not in own]
        names = [item.split("=", 1)[1] if item.startswith("--") else item[2:] for item in own]
        argv.append(f"--exclude={','.join([*names, *exclude])}")
    return argv + extra


def slurm_nodes() -> set[str] | None:
    """The nodes this Slurm cluster has (sinfo), or None when it cannot be asked."""
    try:
        run = _run("sinfo", "--noheader", "--Node", "--format=%N")
    except LaunchError:
        return None
    return set(run.stdout.split()) if run.returncode == 0 else None


def spec_with_nodes(spec: JobSpec, allocation: Allocation | None) -> JobSpec:
    """The job spec with ``nodes`` filled from the allocation (node names, and NodeAddr as
    the address peers use), or placeholders before it is known (``--dry-run``)."""
    assert spec.slurm is not None
    if allocation is None or not allocation.nodes:
        nodes = [NodeSpec(host=f"slurm-node-{i}") for i in range(spec.slurm.nodes)]
    else:
        nodes = []
        for name, addr in zip(allocation.nodes, allocation.addresses or
                              [None] * len(allocation.nodes), strict=True):
            try:
                nodes.append(NodeSpec(host=name, address=addr))
            except ValueError:  # a NodeAddr we would not hand out: peers use the name
                nodes.append(NodeSpec(host=name))
    # Not validated again: the spec was, and slurm + nodes is only ever made here.
    return spec.model_copy(update={"nodes": tuple(nodes)})


# --- talking to Slurm --------------------------------------------------------------------------

def slurm_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for Slurm's commands: ours without the SLURM_* of an enclosing job,
    SLURM_CONF kept (it says which cluster)."""
    env = dict(os.environ if base is None else base)
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def require(*commands: str) -> None:
    """Each command must be on PATH: else one line saying which."""
    for command in commands:
        if shutil.which(command) is None:
            raise LaunchError(f"slurm: `{command}` is not on PATH (the job asks for Slurm: "
                              "install its client commands, or load its module)")


def _run(*argv: str, timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env=slurm_env(), stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise LaunchError(f"slurm: `{argv[0]}` is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"slurm: `{' '.join(argv[:3])}` did not answer within "
                          f"{timeout:g}s (is slurmctld up?)") from None


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1].strip()


def check_partition(spec: SlurmSpec) -> None:
    """A partition that Slurm does not know is refused, naming slurm.partition."""
    if spec.partition is None:
        return
    run = _run("scontrol", "-o", "show", "partition", spec.partition)
    if run.returncode != 0 or not run.stdout.strip():
        detail = _first_line(run.stderr or run.stdout)
        raise SpecError("slurm.partition", f"no such partition in this Slurm cluster ({detail})",
                        spec.partition, has_value=True)


def quick_check(spec: JobSpec, env: Mapping[str, str] | None = None) -> None:
    """What ``submit`` checks before recording a Slurm job: the commands are there, and the
    partition exists (outside an existing allocation: inside one it is not asked for)."""
    assert spec.slurm is not None
    inside = bool((os.environ if env is None else env).get("SLURM_JOB_ID"))
    require(*(("srun", "scontrol") if inside else ("salloc", "srun", "scontrol", "scancel")))
    if not inside:
        check_partition(spec.slurm)


def job_info(job_id: str) -> dict[str, str] | None:
    """JobState and NodeList of a Slurm job; None when Slurm no longer knows it."""
    run = _run("scontrol", "-o", "show", "job", job_id)
    if run.returncode != 0:
        if "invalid job id" in (run.stderr + run.stdout).lower():
            return None
        raise LaunchError(f"slurm: cannot read job {job_id}: {_first_line(run.stderr)}")
    return parse_job(run.stdout)


def read_nodes(allocation: Allocation) -> None:
    """Fill in the node names and addresses of a granted allocation."""
    info = job_info(allocation.job_id)
    if info is None or info.get("JobState") != "RUNNING" or not info.get("NodeList"):
        state = (info or {}).get("JobState", "gone")
        raise LaunchError(f"slurm: allocation {allocation.job_id} is not running ({state})")
    run = _run("scontrol", "show", "hostnames", info["NodeList"])
    if run.returncode != 0:
        raise LaunchError(f"slurm: cannot expand {info['NodeList']}: {_first_line(run.stderr)}")
    names = parse_hostnames(run.stdout)
    shown = _run("scontrol", "-o", "show", "node", ",".join(names))
    addresses = parse_node_addresses(shown.stdout) if shown.returncode == 0 else {}
    allocation.nodes = names
    allocation.addresses = [addresses.get(n) for n in names]


def existing_allocation(spec: JobSpec, env: Mapping[str, str] | None = None
                        ) -> Allocation | None:
    """The allocation ``submit`` runs inside (``SLURM_JOB_ID``), with its first
    ``slurm.nodes`` nodes; None outside one. It stays the user's: never released."""
    assert spec.slurm is not None
    job_id = (os.environ if env is None else env).get("SLURM_JOB_ID", "").strip()
    if not job_id:
        return None
    if not _JOB_ID_RE.match(job_id):
        raise LaunchError(f"slurm: SLURM_JOB_ID={job_id!r} is not a Slurm job id")
    allocation = Allocation(job_id, owned=False)
    read_nodes(allocation)
    want = spec.slurm.nodes
    if len(allocation.nodes) < want:
        raise SpecError("slurm.nodes", f"the allocation {job_id} (SLURM_JOB_ID) has only "
                        f"{len(allocation.nodes)} node(s)", want, has_value=True)
    allocation.nodes = allocation.nodes[:want]
    allocation.addresses = allocation.addresses[:want]
    return allocation


def request(spec: SlurmSpec, name: str, timeout: float, *,
            record: Callable[[Allocation], None],
            stop: Callable[[], bool] = lambda: False, exclude: Sequence[str] = ()
            ) -> Allocation:
    """Request an allocation with ``salloc --no-shell`` and wait up to ``timeout`` for it to
    be granted. ``record`` is called with the allocation as soon as its id is known (pending
    or granted) and again with its nodes. Not granted in time, or ``stop()`` true: the
    pending request is cancelled (scancel), then LaunchError or AllocationWaitStopped.
    ``exclude``: nodes to keep out of it (quarantined: orchestrator/reputation.py), those
    Slurm knows; when Slurm refuses the request with them out (AllocationRefused), it is
    asked again with them in."""
    require("salloc", "scontrol", "scancel")
    known = slurm_nodes() if exclude else None
    exclude = sorted(set(exclude) & known) if known is not None else []
    if exclude:
        log.info("slurm: asking for nodes other than the quarantined %s", ",".join(exclude))
        try:
            return _request(spec, name, timeout, record, stop, exclude)
        except AllocationRefused as exc:
            log.warning("slurm refused the allocation without the quarantined node(s) %s "
                        "(%s): asking again with them", ",".join(exclude), exc)
    return _request(spec, name, timeout, record, stop, [])


def _request(spec: SlurmSpec, name: str, timeout: float, record: Callable[[Allocation], None],
             stop: Callable[[], bool], exclude: Sequence[str]) -> Allocation:
    proc = subprocess.Popen(salloc_argv(spec, name, exclude), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=slurm_env(), start_new_session=True)
    assert proc.stderr is not None
    stderr: list[str] = []
    seen: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            stderr.append(line)
            job_id = parse_salloc_line(line)
            if job_id and not seen:
                seen.append(job_id)
                record(Allocation(job_id, owned=True))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    why = None
    while proc.poll() is None:
        if stop():
            why = "stop"
        elif time.monotonic() > deadline:
            why = "timeout"
        if why:
            break
        time.sleep(0.1)
    if why:
        proc.kill()  # salloc leaves its pending job behind when killed: scancel it
        proc.wait()
        reader.join(2)
        if seen:
            _give_back(Allocation(seen[0], owned=True), record)
        if why == "stop":
            raise AllocationWaitStopped()
        pending = f"{seen[0]} " if seen else ""
        raise LaunchError(f"slurm: allocation {pending}not granted within launch_timeout "
                          f"({timeout:g}s); the pending request was cancelled")
    reader.join(5)
    text = "".join(stderr)
    if proc.returncode != 0:
        if seen:
            _give_back(Allocation(seen[0], owned=True), record)
        raise salloc_error(spec, text)
    job_id = seen[0] if seen else None
    if job_id is None:
        raise LaunchError(f"slurm: salloc granted no allocation: {_first_line(text)}")
    allocation = Allocation(job_id, owned=True)
    try:
        read_nodes(allocation)
    except LaunchError:
        _give_back(allocation, record)
        raise
    record(allocation)
    return allocation


def _give_back(allocation: Allocation, record: Callable[[Allocation], None]) -> None:
    allocation.released = release(allocation)
    record(allocation)


def wait_granted(allocation: Allocation, timeout: float,
                 stop: Callable[[], bool] = lambda: False) -> bool:
    """Wait for a recorded allocation (a replaced controller's) to run; True once it does,
    False when Slurm ended it or it did not start within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(allocation.job_id)
        state = (info or {}).get("JobState")
        if state == "RUNNING":
            return True
        if info is None or state in _ENDED:
            return False
        if stop():
            raise AllocationWaitStopped()
        time.sleep(0.5)
    return False


def is_running(allocation: Allocation) -> bool:
    info = job_info(allocation.job_id)
    return info is not None and info.get("JobState") == "RUNNING"


def release(allocation: Allocation) -> bool:
    """scancel an allocation the orchestrator requested (never the user's own). True if
    asked; a failure is not an error here (the caller has nothing better to do)."""
    if not allocation.owned:
        return False
    try:
        run = _run("scancel", allocation.job_id)
    except LaunchError:
        return False
    return run.returncode == 0


def acquire(spec: JobSpec, name: str, saved: Mapping[str, Any] | None, *,
            record: Callable[[Allocation], None],
            stop: Callable[[], bool] = lambda: False, exclude: Sequence[str] = ()
            ) -> Allocation:
    """The job's allocation: the recorded one (the user's own, or one a controller before
    this one requested), else a new one. A recorded allocation is never swapped for
    another: its agents and workers run there. Raises LaunchError, SpecError,
    AllocationWaitStopped."""
    assert spec.slurm is not None
    if saved is not None:
        allocation = Allocation.from_dict(saved)
        if allocation.nodes:
            if allocation.released:
                raise LaunchError(f"slurm: allocation {allocation.job_id} was released (the "
                                  "controller's supervisor gave up); submit the job again")
            if not is_running(allocation):
                state = (job_info(allocation.job_id) or {}).get("JobState", "gone")
                raise LaunchError(f"slurm: allocation {allocation.job_id} has ended ({state})")
            return allocation
        if not allocation.released:
            # Requested by a controller that died before it was granted: wait for that one.
            if wait_granted(allocation, spec.launch_timeout, stop):
                read_nodes(allocation)
                record(allocation)
                return allocation
            if (job_info(allocation.job_id) or {}).get("JobState") == "PENDING":
                _give_back(allocation, record)
                raise LaunchError(f"slurm: allocation {allocation.job_id} not granted within "
                                  f"launch_timeout ({spec.launch_timeout:g}s); the pending "
                                  "request was cancelled")
        # Cancelled before it was granted (by us on the way out, or by someone): ask again.
    return request(spec.slurm, name, spec.launch_timeout, record=record, stop=stop,
                   exclude=exclude)
