"""Job specs: frozen pydantic models, and loading them safely from YAML.

A spec is data: it says what to run where, never how. Loading is strict, because a typo in a
spec should cost a second at submit time, not an hour of a cluster: unknown keys (with a
"did you mean"), duplicate keys, several documents, files over 1 MiB or not UTF-8, deep
nesting and alias bombs are refused, and every error is one ``SpecError`` naming the field
path and the value.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from orchestrator import placeholders
from orchestrator.errors import SpecError

MAX_SPEC_BYTES = 1024 * 1024
MAX_DEPTH = 32  # a real spec nests 3 deep; PyYAML's composer recurses once per level
MAX_EXPANDED_NODES = 100_000  # values after expanding aliases: far above any real spec

RESERVED_ENV: frozenset[str] = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
})
RESERVED_ENV_PREFIXES: tuple[str, ...] = ("TORCHELASTIC_", "ORCHESTRATOR_")
# Old NCCL knobs that the recipes still recommend, and the names torch reads today.
DEPRECATED_ENV = {
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
}

_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
_IPV6_RE = re.compile(r"^[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*$")
_SECRET_RE = re.compile(r"TOKEN|KEY|PASSWORD|PASSWD|SECRET|CREDENTIAL", re.IGNORECASE)
_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]*$")
# The interpreter name goes into a remote shell command line: no spaces, no metacharacters,
# and no leading "-" that would read as an option.
_PYTHON_RE = re.compile(r"^[A-Za-z0-9_./+][A-Za-z0-9_./+-]*$")

Port = Annotated[StrictInt, Field(ge=1, le=65535)]
# inf would reach time.sleep() and deadlines, where it raises or never fires.
Seconds = Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)]


class _FieldError(ValueError):
    """A check that knows which field is at fault, relative to where pydantic reports it
    (``"nodes[1].host"`` from JobSpec, ``"user"`` from a NodeSpec, ``"FOO"`` from ``env``)."""

    def __init__(self, field: str, message: str, value: Any = ...):
        super().__init__(message)
        self.field, self.message, self.value = field, message, value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_path(value: str) -> str:
    if "\0" in value or "\n" in value or "\r" in value:
        raise ValueError("a path must not contain NUL or newline characters")
    return value


def _check_user(value: str) -> str:
    if not _USER_RE.match(value):
        raise ValueError("invalid user name (allowed: [A-Za-z_][A-Za-z0-9._-]*)")
    return value


def _check_hostname(value: str) -> str:
    """A DNS name, an IPv4 address, or an IPv6 literal: nothing a shell would interpret."""
    if _HOSTNAME_RE.match(value) or _IPV6_RE.match(value):
        return value
    raise ValueError("not a valid host name or address")


def split_host(text: str) -> tuple[str | None, str, int | None]:
    """``[user@]hostname[:port]`` (IPv6 as ``[addr]:port``) -> (user, hostname, port)."""
    user = None
    if "@" in text:
        user, text = text.split("@", 1)
        _check_user(user)
    port_text: str | None = None
    if text.startswith("["):
        addr, sep, rest = text[1:].partition("]")
        if not sep or not _IPV6_RE.match(addr) or (rest and not rest.startswith(":")):
            raise ValueError("invalid bracketed IPv6 address")
        text, port_text = addr, rest[1:] if rest else None
    elif text.count(":") == 1:
        text, port_text = text.split(":")
    port: int | None = None
    if port_text is not None:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"invalid port {port_text!r}")
        port = int(port_text)
    return user, _check_hostname(text), port


User = Annotated[str, AfterValidator(_check_user)]
PathText = Annotated[str, AfterValidator(_check_path)]
Address = Annotated[str, AfterValidator(_check_hostname)]


class SSHOptions(_Model):
    """Job-wide defaults for SSH nodes; a node's own fields win."""

    user: User | None = None
    identity_file: PathText | None = None
    known_hosts: PathText | None = Field(default=None, description="default: ~/.ssh/known_hosts")
    host_key_policy: Literal["reject", "accept-new"] = "reject"
    connect_timeout: Seconds = 10.0


class NodeSpec(_Model):
    """One node: ``local`` (this machine, no SSH) or ``[user@]hostname[:port]`` over SSH."""

    host: str = Field(description='"local", or "[user@]hostname[:port]" reached over SSH')
    user: User | None = None
    port: Port | None = None
    identity_file: PathText | None = None
    address: Address | None = Field(
        default=None, description="address other nodes reach this node at; default: hostname")
    slots: Annotated[StrictInt, Field(ge=1)] | None = Field(
        default=None, description="workers on this node, instead of nproc_per_node (a "
                                  "hostfile's slots=N when its hosts differ)")

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        if v != "local":
            split_host(v)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> NodeSpec:
        if self.is_local:
            # Silently ignoring SSH settings on a local node would hide a mistaken host.
            for name in ("user", "port", "identity_file"):
                if getattr(self, name) is not None:
                    raise _FieldError(name, "does not apply to a local node (no SSH)",
                                      getattr(self, name))
            return self
        user, _, port = split_host(self.host)
        if user and self.user and user != self.user:
            raise _FieldError("user", f"contradicts the user {user!r} in host", self.user)
        if port and self.port and port != self.port:
            raise _FieldError("port", f"contradicts the port {port} in host", self.port)
        return self

    @property
    def is_local(self) -> bool:
        """True for ``host: local``: run on this machine, without SSH."""
        return self.host == "local"

    @property
    def hostname(self) -> str:
        """The host name or address alone (``localhost`` for a local node)."""
        return "localhost" if self.is_local else split_host(self.host)[1]

    @property
    def explicit_port(self) -> int | None:
        """The port the spec gave (field or host string); None lets ~/.ssh/config decide."""
        return self.port or (None if self.is_local else split_host(self.host)[2])

    def resolved(self, ssh: SSHOptions) -> tuple[str | None, str, int]:
        """(user, hostname, port) after applying the job's ssh defaults."""
        user = self.user or (None if self.is_local else split_host(self.host)[0]) or ssh.user
        return user, self.hostname, self.explicit_port or 22


class RendezvousSpec(_Model):
    """How workers find each other: torchrun's static rendezvous, or torch's c10d."""

    backend: Literal["static", "c10d"] = "static"
    port: Literal["auto"] | Port | str = Field(
        default="auto", description='"auto" picks a free port; "29500-29550" a free one of '
                                    "that range (a firewall's open range)")
    master_addr: Address | None = None

    @field_validator("port", mode="before")
    @classmethod
    def _port(cls, v: Any) -> Any:
        # One message for every arm of the union, instead of pydantic's "should be 'auto'".
        if v == "auto" or (type(v) is int and 1 <= v <= 65535):
            return v
        if isinstance(v, str) and _port_range(v) is not None:
            return v.replace(" ", "")
        raise ValueError('must be "auto", a port number 1..65535, or a range "LOW-HIGH"')

    @property
    def port_range(self) -> tuple[int, int] | None:
        """(low, high) when the port is a range; a fixed port is a range of one."""
        if isinstance(self.port, int):
            return self.port, self.port
        return _port_range(self.port) if self.port != "auto" else None


def _port_range(text: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"\s*(\d{1,5})\s*-\s*(\d{1,5})\s*", text)
    if not m:
        return None
    low, high = int(m[1]), int(m[2])
    return (low, high) if 1 <= low <= high <= 65535 else None


def _duration(v: Any) -> Any:
    """Seconds, or "HH:MM:SS" (Slurm's --time), or None."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*(\d+):([0-5]\d):([0-5]\d)\s*", v)
        if not m:
            raise ValueError('must be seconds or "HH:MM:SS"')
        v = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])
        if v == 0:
            raise ValueError("must be longer than 0")
    return v


class HealthSpec(_Model):
    """Heartbeats and timeouts, in seconds."""

    heartbeat_interval: Seconds = 1.0
    node_timeout: Seconds = 5.0
    hang_timeout: Seconds | None = Field(default=None, description="no output for this long")
    flight_recorder: int = Field(
        default=2000, ge=0,
        description="collectives torch's flight recorder keeps per process group (NCCL or "
                    "gloo), dumped on a hang or a collective timeout; 0: off. A job that sets "
                    "TORCH_FR_BUFFER_SIZE or TORCH_NCCL_TRACE_BUFFER_SIZE keeps its own")
    controller_grace: Seconds | None = Field(
        default=600.0,
        description="seconds agents keep the workers running with no controller attached "
                    "(null: forever); then they stop them")

    @model_validator(mode="after")
    def _order(self) -> HealthSpec:
        if self.node_timeout <= self.heartbeat_interval:
            raise _FieldError("node_timeout", "must be longer than heartbeat_interval "
                              f"({self.heartbeat_interval:g})", self.node_timeout)
        return self


class SyncSpec(_Model):
    """A local directory shipped to every SSH node (see orchestrator/sync.py)."""

    path: PathText = Field(description="relative to the spec file")
    exclude: tuple[str, ...] = Field(default=(), description=".gitignore-style globs")
    keep: Annotated[StrictInt, Field(ge=1)] = Field(
        default=5, description="synced trees kept on each node (older ones are pruned)")
    max_bytes: Annotated[StrictInt, Field(ge=1)] | None = Field(
        default=1024 ** 3, description="a larger tree is refused before anything starts, "
        "naming its largest directories (null: no limit)")


class LogsSpec(_Model):
    """How much of the workers' output the orchestrator keeps."""

    max_bytes_per_rank: Annotated[StrictInt, Field(ge=4096)] | None = Field(
        default=1024 ** 3, description="per rank and attempt; past it the first and the last "
        "part are kept and the middle is cut, with a marker saying how much (null: no cap)")
    keep_attempts: Annotated[StrictInt, Field(ge=1)] | None = Field(
        default=None, description="keep the logs of the last N attempts only (null: all)")
    min_free_bytes: Annotated[StrictInt, Field(ge=0)] = Field(
        default=1024 ** 3, description="below this much free space on the filesystem of "
        "$ORCHESTRATOR_HOME a job is not started, and a running one stops logging")


class BackoffSpec(_Model):
    """Wait before restart n: min(max, initial * 2**(n-1)) seconds."""

    initial: Seconds = 1.0
    max: Seconds = 30.0

    @model_validator(mode="after")
    def _order(self) -> BackoffSpec:
        if self.max < self.initial:
            raise _FieldError("max", f"must be at least initial ({self.initial:g})", self.max)
        return self


_SLURM_WORD_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
_SLURM_GRES_RE = re.compile(r"^[A-Za-z0-9_.:,/+-]+$")
# Slurm's --time: "MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS", or no limit.
_SLURM_TIME_RE = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}){0,2}"
                            r"|UNLIMITED|INFINITE)$")
# Options that slurm's own fields (or the orchestrator) set: refused in slurm.extra.
_SLURM_OWN_OPTIONS = {
    "-N": "nodes", "--nodes": "nodes", "-p": "partition", "--partition": "partition",
    "-t": "time", "--time": "time", "-A": "account", "--account": "account",
    "--gres": "gres", "--no-shell": None, "--jobid": None, "-J": None, "--job-name": None,
}


def _slurm_word(what: str, pattern: re.Pattern[str] = _SLURM_WORD_RE) -> Any:
    def check(v: str | None) -> str | None:
        if v is not None and not pattern.match(v):
            raise ValueError(f"not a valid Slurm {what}")
        return v
    return AfterValidator(check)


class SlurmSpec(_Model):
    """Run on a Slurm allocation instead of listed nodes: the controller requests one (or,
    submitted from inside one, uses it) and reaches each node's agent through ``srun``."""

    nodes: Annotated[StrictInt, Field(ge=1)] = Field(description="nodes to allocate")
    partition: Annotated[str | None, _slurm_word("partition name")] = None
    time: Annotated[str | None, _slurm_word("time limit (MM, HH:MM:SS, D-HH:MM:SS...)",
                                            _SLURM_TIME_RE)] = Field(
        default=None, description="the allocation's time limit, as Slurm's --time")
    account: Annotated[str | None, _slurm_word("account name")] = None
    gres: Annotated[str | None, _slurm_word("gres (e.g. gpu:4)", _SLURM_GRES_RE)] = None
    extra: tuple[str, ...] = Field(
        default=(), description='more salloc options, one per item ("--constraint=a100")')

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, v: Any) -> Any:
        return str(v) if type(v) is int and v > 0 else v  # minutes, as Slurm reads them

    @field_validator("extra")
    @classmethod
    def _extra(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for i, item in enumerate(v):
            if not item.startswith("-") or any(c in item for c in "\0\n\r"):
                raise _FieldError(f"[{i}]", "must be one salloc option starting with -, "
                                  'e.g. "--constraint=a100"', item)
            name = item.split("=", 1)[0]
            if name in _SLURM_OWN_OPTIONS or (name[:2] in ("-N", "-p", "-t", "-A", "-J")
                                              and not name.startswith("--")):
                field = _SLURM_OWN_OPTIONS.get(name) or _SLURM_OWN_OPTIONS.get(name[:2])
                where = f"use slurm.{field}" if field else "the orchestrator sets it"
                raise _FieldError(f"[{i}]", f"{name} is not allowed here: {where}", item)
        return v


class JobSpec(_Model):
    """A distributed job: what runs, where, and how failures are handled."""

    name: str = "job"
    nodes: tuple[NodeSpec, ...] = ()
    hostfile: PathText | None = Field(
        default=None, description="DeepSpeed-style 'hostname slots=N' file, instead of nodes")
    nproc_per_node: Annotated[StrictInt, Field(ge=1)] | Literal["gpu", "auto"] = Field(
        default=1, description='workers per node; "gpu": one per GPU the node has (refused on '
                               'a node without); "auto": one per GPU, or 1 without GPUs')
    nnodes: str | StrictInt | None = Field(
        default=None, description='"MIN:MAX", "N" or N; default: every node')
    command: tuple[str, ...] = Field(description="argv, or a string split like a shell does")
    launch: Literal["per-rank", "per-node"] = Field(
        default="per-rank", description='"per-rank": the command once per rank, with '
        "torchrun's environment; \"per-node\": once per node, a process that starts the "
        "node's nproc_per_node workers itself (torch.multiprocessing.spawn)")
    workdir: PathText = Field(default=".", description="relative to the spec file")
    sync: SyncSpec | None = Field(
        default=None, description="a directory shipped to SSH nodes, by content; their "
        "workers run in the copy (a path, or {path, exclude, keep})")
    setup: tuple[str, ...] = Field(
        default=(), description="commands run on each node, in its workdir, before the "
        "first attempt; again only when they or the synced tree change")
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: tuple[str, ...] = Field(
        default=(), description="env names whose values are never shown (names containing "
                                "TOKEN, KEY, PASSWORD or SECRET are masked anyway)")
    max_restarts: Annotated[StrictInt, Field(ge=0)] = 0
    max_duration: Annotated[float, Field(gt=0, allow_inf_nan=False),
                            BeforeValidator(_duration)] | None = Field(
        default=None, description='wall-clock limit of the whole job: seconds or "HH:MM:SS"; '
                                  "then every worker is stopped and the job FAILS (TIMEOUT), "
                                  "never restarted")
    fail_on_exit_codes: tuple[Annotated[StrictInt, Field(ge=1, le=255)], ...] = Field(
        default=(), description="exit codes that fail the job without a restart")
    stop_grace_period: Seconds = 10.0
    launch_timeout: Seconds = 60.0
    python: str = Field(default="python3", description="interpreter for the agent on SSH nodes")
    spool_max_bytes: Annotated[StrictInt, Field(ge=0)] | None = Field(
        default=256 * 1024 * 1024,
        description="output an agent keeps on disk while no controller is attached (null: no "
                    "cap); past it, lines are counted and the count is logged")
    rendezvous: RendezvousSpec = RendezvousSpec()
    restart_backoff: BackoffSpec = BackoffSpec()
    health: HealthSpec = HealthSpec()
    logs: LogsSpec = LogsSpec()
    ssh: SSHOptions = SSHOptions()
    slurm: SlurmSpec | None = Field(
        default=None, description="run on a Slurm allocation (instead of nodes or hostfile)")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError("must be 1..40 characters of [a-z0-9-], not starting or ending with -")
        return v

    @field_validator("command", mode="before")
    @classmethod
    def _command(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                v = shlex.split(v)
            except ValueError as exc:
                raise ValueError(f"cannot split command: {exc}") from exc
        if isinstance(v, (list, tuple)):
            if not v:
                raise ValueError("must not be empty")
            if v[0] == "":
                raise _FieldError("[0]", "the program must not be empty", "")
            for i, item in enumerate(v):
                if isinstance(item, str) and "\0" in item:
                    raise _FieldError(f"[{i}]", "must not contain NUL", item)
        return v

    @field_validator("sync", mode="before")
    @classmethod
    def _sync(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, str) else v

    @field_validator("setup", mode="before")
    @classmethod
    def _setup(cls, v: Any) -> Any:
        if isinstance(v, str):
            return (v,) if v.strip() else ()
        return v

    @property
    def setup_script(self) -> str:
        """The setup commands as one shell script that stops at the first failure."""
        return "set -e\n" + "\n".join(self.setup) if self.setup else ""

    @field_validator("nproc_per_node", mode="before")
    @classmethod
    def _nproc(cls, v: Any) -> Any:
        if v in ("gpu", "auto") or (type(v) is int and v >= 1):
            return v
        raise ValueError('must be a whole number of at least 1, "gpu" or "auto"')

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for i, name in enumerate(v):
            if not _ENV_NAME_RE.match(name):
                raise _FieldError(f"[{i}]", "not a valid variable name", name)
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        if not _PYTHON_RE.match(v):
            raise ValueError("must be a program name or path of [A-Za-z0-9_./+-], not starting "
                             "with -")
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {}
        for key, value in v.items():
            if not isinstance(key, str) or not _ENV_NAME_RE.match(key):
                raise _FieldError(str(key), "not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)",
                                  key)
            if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES):
                raise _FieldError(key, "is set by the orchestrator and cannot be overridden", key)
            # 3 and 0.5 are clearly meant as text; true/null are not (YAML's "yes" is a bool).
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise _FieldError(key, "value must be a string or a number (quote it)", value)
            value = str(value)
            if "\0" in value or "\n" in value or "\r" in value:
                raise _FieldError(key, "value must not contain NUL or newline characters", value)
            out[key] = value
        return out

    @field_validator("nnodes", mode="before")
    @classmethod
    def _nnodes(cls, v: Any) -> Any:
        if v is not None:
            _parse_nnodes(v)
        return v

    @model_validator(mode="after")
    def _nodes(self) -> JobSpec:
        if self.hostfile is not None:
            if self.nodes:
                raise _FieldError("hostfile", "give nodes or hostfile, not both", self.hostfile)
            raise _FieldError("hostfile", "is expanded into nodes by load_jobspec() and "
                              "parse_jobspec(); validate the YAML through them", self.hostfile)
        if self.launch == "per-node" and self.rendezvous.backend == "c10d":
            raise _FieldError("launch", "per-node starts your own process on each node; "
                              "rendezvous.backend c10d starts torchrun there: choose one",
                              self.launch)
        if self.slurm is not None:
            if self.nodes:
                raise _FieldError("slurm", "give nodes or slurm, not both (Slurm chooses the "
                                  "nodes)")
            self._check_placeholders()
            self._check_nnodes(self.slurm.nodes)
            return self
        if not self.nodes:
            raise _FieldError("nodes", "at least one node is required (nodes or hostfile)")
        seen: dict[tuple[str | None, str, int], int] = {}
        for i, node in enumerate(self.nodes):
            if node.is_local:
                continue  # several local "nodes" are how one machine runs a multi-node job
            key = node.resolved(self.ssh)
            if key in seen:
                raise _FieldError(f"nodes[{i}].host",
                                  f"duplicate host (same as nodes[{seen[key]}])", node.host)
            seen[key] = i
        if len(seen) and not self.rendezvous.master_addr:
            for i, node in enumerate(self.nodes):
                if node.is_local and not node.address:
                    # As the master it would hand its SSH peers 127.0.0.1.
                    raise _FieldError(f"nodes[{i}].address", "a local node in a job with SSH "
                                      "nodes needs the address the others reach it at (or "
                                      "set rendezvous.master_addr)")
        self._check_placeholders()
        self._check_nnodes(len(self.nodes))
        return self

    def _check_nnodes(self, count: int) -> None:
        lo, hi = self.min_nodes, self.max_nodes
        if lo > hi:
            raise _FieldError("nnodes", "MIN is larger than MAX", self.nnodes)
        if hi > count:
            where = "slurm.nodes" if self.slurm is not None and not self.nodes else "node(s)"
            raise _FieldError("nnodes", f"MAX {hi} is more than the {count} {where}",
                              self.nnodes)

    def _check_placeholders(self) -> None:
        where = [(f"command[{i}]", item) for i, item in enumerate(self.command)]
        where += [(f"env.{k}", v) for k, v in self.env.items()]
        for field, text in where:
            try:
                names = placeholders.names_in(text)
            except ValueError as exc:
                raise _FieldError(field, str(exc), text) from None
            early = names & placeholders.STATIC_ONLY
            if early and self.rendezvous.backend == "c10d":
                raise _FieldError(field, f"${{{sorted(early)[0]}}} is not known before torch's "
                                  "c10d rendezvous; read it from the environment (RANK, "
                                  "LOCAL_RANK, WORLD_SIZE)", text)
            one = names & {"rank", "local_rank"}
            if one and self.launch == "per-node":
                raise _FieldError(field, f"${{{sorted(one)[0]}}}: with launch: per-node one "
                                  "process owns all the ranks of its node; pass "
                                  "${node_start_rank} and ${nproc_per_node}", text)

    @property
    def warnings(self) -> list[str]:
        """Things that work but are probably not what the user meant."""
        out = []
        for old, new in DEPRECATED_ENV.items():
            if old in self.env and new not in self.env:
                out.append(f"env.{old} is deprecated: current torch reads {new} (the old name "
                           "is passed through unchanged)")
        return out

    @property
    def secret_names(self) -> frozenset[str]:
        """Names in ``env`` whose values are masked wherever the orchestrator shows them."""
        return frozenset(k for k in self.env if k in self.secret_env or _SECRET_RE.search(k))

    @property
    def node_count(self) -> int:
        """Nodes the job has: those listed, or (before they are known) slurm.nodes."""
        return len(self.nodes) or (self.slurm.nodes if self.slurm is not None else 0)

    @property
    def min_nodes(self) -> int:
        """Fewest nodes the job runs on (nnodes MIN; default: every node)."""
        return _parse_nnodes(self.nnodes)[0] if self.nnodes is not None else self.node_count

    @property
    def max_nodes(self) -> int:
        """Most nodes the job runs on (nnodes MAX; default: every node)."""
        return _parse_nnodes(self.nnodes)[1] if self.nnodes is not None else self.node_count


def _parse_nnodes(v: Any) -> tuple[int, int]:
    if type(v) is int:
        lo = hi = v
    elif isinstance(v, str) and (m := re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", v)):
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
    else:
        raise ValueError('must be "MIN:MAX", "N" or a whole number of nodes')
    if lo < 1:
        raise ValueError("needs at least 1 node")
    return lo, hi


# --- loading -------------------------------------------------------------------------------

_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader that refuses deep nesting while composing: the composer recurses once per
    level, so 10 000 ``[`` would otherwise end in a RecursionError instead of an error."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _check_tree(node: yaml.Node, path: str, memo: dict[int, int], active: set[int]) -> int:
    """Walk the composed document before anything is built: refuse duplicate keys (naming
    their path) and self-referencing aliases, make every key a string, and count the values
    the document expands to, so an alias bomb is refused in microseconds. Returns that count."""
    if id(node) in active:
        raise SpecError(path, "a YAML alias refers to a value that contains it")
    if id(node) in memo:  # an alias: already checked, and it costs its size again
        return memo[id(node)]
    active.add(id(node))
    size = 1
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise SpecError(path, f"line {key_node.start_mark.line + 1}: keys must be "
                                      "plain names")
            # Every key is a name (field or variable): without this YAML 1.1 turns ON, no
            # and 1 into bools and ints. Merge keys (<<) keep their meaning.
            if key_node.tag != _MERGE_TAG:
                key_node.tag = _STR_TAG
            key = key_node.value
            child = f"{path}.{key}" if path else key
            if key in seen:
                raise SpecError(child, f"duplicate key (line {key_node.start_mark.line + 1})")
            seen.add(key)
            # An env value is text: keep it as written, since 1.10 and 0x10 are not 1.1 and 16.
            if path == "env" and isinstance(value_node, yaml.ScalarNode) and \
                    value_node.tag in _NUMBER_TAGS:
                value_node.tag = _STR_TAG
            size += _check_tree(value_node, child, memo, active)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            size += _check_tree(item, f"{path}[{i}]", memo, active)
    active.discard(id(node))
    memo[id(node)] = size
    if size > MAX_EXPANDED_NODES:
        raise SpecError(path, f"the YAML expands to more than {MAX_EXPANDED_NODES} values "
                              "(alias bomb?)")
    return size


def _load_yaml(text: str) -> dict[str, Any]:
    """One YAML document that is a mapping, or a SpecError."""
    loader = _SpecLoader(text)
    try:
        if not loader.check_node():
            raise SpecError("", "the spec is empty; expected a mapping of fields")
        root = loader.get_node()
        assert root is not None  # check_node() said there is one
        if loader.check_node():
            raise SpecError("", "several YAML documents; expected exactly one")
        _check_tree(root, "", {}, set())
        data = loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpecError("", f"invalid YAML: {where}{exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise SpecError("", f"invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    if data is None:
        raise SpecError("", "the spec is empty; expected a mapping of fields")
    if not isinstance(data, dict):
        raise SpecError("", f"the spec must be a mapping of fields, not a {type(data).__name__}",
                        data, has_value=True)
    return data


def _read_text(path: Path, field: str, what: str) -> str:
    """Read a small UTF-8 file; the size is checked before reading, and the read is capped
    in case the file grows or is not a regular file."""
    try:
        size = path.stat().st_size
        if size > MAX_SPEC_BYTES:
            raise SpecError(field, f"{what} {path} is larger than {MAX_SPEC_BYTES} bytes ({size})")
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError(field, f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(field, f"{what} {path} is larger than {MAX_SPEC_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise SpecError(field, f"{what} {path} is not UTF-8 (line {line}, byte {exc.start})"
                        ) from None


def parse_jobspec(text: str, *, base_dir: str | os.PathLike[str] = ".",
                  env: dict[str, str] | None = None, overrides: list[str] | None = None
                  ) -> JobSpec:
    """Validate a spec given as YAML text; ``hostfile`` is read relative to ``base_dir``.
    ``env`` adds to the spec's env; ``overrides`` are ``field.path=value`` (a YAML value),
    as ``submit --env`` and ``--set`` give them; both are validated like the file."""
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError("", f"the spec is larger than {MAX_SPEC_BYTES} bytes")
    data = _load_yaml(text)
    for item in overrides or ():
        _apply_override(data, item)
    if env:
        current = data.get("env")
        data["env"] = {**(current if isinstance(current, dict) else {}), **env}
    if not isinstance(data.get("hostfile"), str):
        return validate_jobspec(data)
    for other in ("nodes", "slurm"):
        if other in data:
            raise SpecError("hostfile", f"give {other} or hostfile, not both", data["hostfile"],
                            has_value=True)
    data, lines = _expand_hostfile(data, Path(base_dir))
    try:
        return validate_jobspec(data)
    except SpecError as exc:
        # The user wrote a hostfile, not nodes[i]: point at its line instead.
        m = re.match(r"nodes\[(\d+)\]", exc.field)
        if not m:
            raise
        raise SpecError("hostfile", f"line {lines[int(m[1])]}: {exc.message}", exc.value,
                        has_value=exc.has_value) from None


def load_jobspec(path: str | os.PathLike[str], *, env: dict[str, str] | None = None,
                 overrides: list[str] | None = None) -> JobSpec:
    """Read, parse and validate a YAML job spec file (at most 1 MiB of UTF-8), with optional
    ``env`` additions and ``field.path=value`` overrides (see parse_jobspec)."""
    path = Path(path)
    return parse_jobspec(_read_text(path, "", "spec file"), base_dir=path.resolve().parent,
                         env=env, overrides=overrides)


_PATH_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)")


def _apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``field.path[i].sub=value`` to the parsed document."""
    path, sep, raw = item.partition("=")
    if not sep or not path:
        raise SpecError("", f"--set expects field=value, got {item!r}")
    steps: list[str | int] = []
    for part in path.split("."):
        m = _PATH_PART.fullmatch(part)
        if not m:
            raise SpecError(path, "not a field path (e.g. health.hang_timeout or nodes[1].host)")
        steps.append(m[1])
        steps += [int(i) for i in re.findall(r"\[(\d+)\]", m[2])]
    try:
        value = _load_yaml(f"v: {raw}")["v"] if raw.strip() else ""
    except SpecError as exc:
        raise SpecError(path, f"--set value is not valid YAML: {exc.message}") from None
    target: Any = data
    for here, step in zip(steps, steps[1:], strict=False):
        try:
            target = target[here]
        except (KeyError, IndexError, TypeError):
            if isinstance(here, str) and isinstance(target, dict) and isinstance(step, str):
                target = target.setdefault(here, {})  # a new section: health.x=1
                continue
            raise SpecError(path, f"no such field to set ({here!r})") from None
    last = steps[-1]
    if isinstance(last, int):
        if not isinstance(target, list) or last >= len(target):
            raise SpecError(path, "no such list item to set")
        target[last] = value
    elif isinstance(target, dict):
        target[last] = value
    else:
        raise SpecError(path, "not a mapping")


def validate_jobspec(data: dict[str, Any]) -> JobSpec:
    """Validate already-parsed data, translating pydantic's errors into one SpecError."""
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise _spec_error(exc, data) from None


def _expand_hostfile(data: dict[str, Any], base_dir: Path) -> tuple[dict[str, Any], list[int]]:
    """Replace ``hostfile`` by ``nodes`` (and ``nproc_per_node`` from ``slots``); also return
    each node's line number in the hostfile."""
    given = data["hostfile"]
    path = base_dir / os.path.expanduser(given)
    text = _read_text(path, "hostfile", "hostfile")
    nodes: list[dict[str, str]] = []
    lines: list[int] = []
    slots: list[int | None] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *extra = line.split()
        m = re.fullmatch(r"slots=([1-9][0-9]*)", extra[0]) if len(extra) == 1 else None
        if extra and not m:
            raise SpecError("hostfile", f"{given} line {number}: expected 'hostname slots=N'",
                            line, has_value=True)
        try:
            if host != "local":
                split_host(host)
        except ValueError as exc:
            raise SpecError("hostfile", f"{given} line {number}: {exc}", host,
                            has_value=True) from None
        nodes.append({"host": host})
        lines.append(number)
        slots.append(int(m[1]) if m else None)
    if not nodes:
        raise SpecError("hostfile", f"{path} lists no hosts", given, has_value=True)
    if None in slots and len(set(slots)) > 1:
        shown = ", ".join(sorted({"none" if s is None else str(s) for s in slots}))
        raise SpecError("hostfile", f"give every host slots=N, or none (found {shown})", given,
                        has_value=True)
    out = {k: v for k, v in data.items() if k != "hostfile"}
    out["nodes"] = nodes
    if len(set(slots)) > 1:  # hosts differ: each node runs its own slots
        if data.get("nproc_per_node") is not None:
            raise SpecError("nproc_per_node", "contradicts the hostfile, whose hosts have "
                            "different slots", data["nproc_per_node"], has_value=True)
        for node, count in zip(nodes, slots, strict=True):
            node["slots"] = count  # type: ignore[assignment]
    elif slots[0] is not None:
        nproc = data.get("nproc_per_node")
        if nproc is None:
            out["nproc_per_node"] = slots[0]
        elif type(nproc) is int and nproc != slots[0]:  # other types: the model says why
            raise SpecError("nproc_per_node", f"contradicts slots={slots[0]} in the hostfile",
                            nproc, has_value=True)
    return out, lines


def _path_text(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part:
            text += ("." if text else "") + str(part)
    return text


def _value_at(data: Any, loc: tuple[Any, ...]) -> tuple[bool, Any]:
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, data


_MODELS: dict[str, type[BaseModel]] = {
    "": JobSpec, "nodes": NodeSpec, "rendezvous": RendezvousSpec, "health": HealthSpec,
    "restart_backoff": BackoffSpec, "ssh": SSHOptions, "logs": LogsSpec, "sync": SyncSpec,
    "slurm": SlurmSpec,
}
_MESSAGES = {
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
    "dict_type": "must be a mapping",
    "tuple_type": "must be a list",
    "int_type": "must be a whole number (not a boolean, fraction or string)",
    "int_from_float": "must be a whole number (not a boolean, fraction or string)",
    "float_type": "must be a number (not a boolean or string)",
    "finite_number": "must be a finite number",
}


def _spec_error(exc: ValidationError, data: dict[str, Any]) -> SpecError:
    """The first pydantic error as a SpecError with a clean path and a short message."""
    err = exc.errors()[0]
    # Drop the parts of loc that name validators or union arms rather than fields.
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and (
        p.startswith(("function-", "json-or-python", "literal[", "constrained-"))
        or p in ("int", "str", "float"))))
    field = _path_text(loc)
    ctx_error = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_error, _FieldError):
        sub = ctx_error.field
        field = f"{field}{sub}" if sub.startswith("[") or not field else f"{field}.{sub}"
        has = ctx_error.value is not ...
        return SpecError(field, ctx_error.message, ctx_error.value if has else None,
                         has_value=has)
    has_value, value = _value_at(data, loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = str(loc[0]) if len(loc) > 1 else ""
        fields = list(_MODELS.get(parent, JobSpec).model_fields)
        close = difflib.get_close_matches(str(loc[-1]), fields, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"expected one of {', '.join(fields)}"
        return SpecError(field, f"unknown field; {hint}")
    if kind == "missing":
        return SpecError(field, "required field is missing")
    if kind == "string_type" and isinstance(value, (int, float)):
        shown = str(value).lower() if isinstance(value, bool) else value
        message = f'must be a string; quote it in YAML ("{shown}")'
    else:
        message = _MESSAGES.get(kind) or err["msg"].removeprefix("Value error, ").replace(
            "Input should be", "must be")
    return SpecError(field, message, value, has_value=has_value)
