"""The parts of a job spec (orchestrator/spec.py): the nodes, the SSH options, rendezvous,
health, sync, logs, backoff and Slurm sections, each a frozen pydantic model, and the checks
they share. A check that knows its field raises ``_FieldError``; spec.py turns every failure
into one SpecError naming the field path and the value."""

from __future__ import annotations

import re
import urllib.parse
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_validator,
)

from agents.fields import MAX_COUNT
from agents.protocol import MAX_LOCAL

MAX_SPEC_BYTES = 1024 * 1024
MAX_DEPTH = 32  # a real spec nests 3 deep; PyYAML's composer recurses once per level
MAX_EXPANDED_NODES = 100_000  # values after expanding aliases: far above any real spec
# A whole number in YAML of at most this many characters: any 64-bit value in every notation
# YAML has (0b and 64 digits is the longest). Past 4,300 decimal digits Python refuses to
# convert it (ValueError), and a longer hexadecimal one converts but cannot be printed back.
MAX_INT_CHARS = 100
# The largest whole number a spec may hold: the agent protocol's bound on counts and sizes
# (so a spool cap or a free-space floor is never out of protocol at launch), and it fits
# SQLite's 64-bit INTEGER (the store keeps max_restarts in one).
MAX_INT = MAX_COUNT

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


def looks_secret(name: str) -> bool:
    """An env name whose value is masked wherever it is shown (with the spec's secret_env)."""
    return bool(_SECRET_RE.search(name))

_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]*$")
# The interpreter name goes into a remote shell command line: no spaces, no metacharacters,
# and no leading "-" that would read as an option.
_PYTHON_RE = re.compile(r"^[A-Za-z0-9_./+][A-Za-z0-9_./+-]*$")

Port = Annotated[StrictInt, Field(ge=1, le=65535)]
# The shortest wait a spec may ask for, in seconds: about one scheduler tick (Linux's HZ is
# 100 to 1000), so the kernel does not honour a shorter one, and a loop woken more often only
# burns a core (heartbeat_interval: 1e-300 spun the agent's main loop and its heartbeat
# thread). The shortest value any test uses is this one (restart_backoff 0.01).
MIN_SECONDS = 0.01
# inf would reach time.sleep() and deadlines, where it raises or never fires.
Seconds = Annotated[float, Field(ge=MIN_SECONDS, strict=True, allow_inf_nan=False)]
# Workers on one node: the agent protocol carries at most MAX_LOCAL local ranks (a start
# holds at most that many workers), so a larger count would only fail at launch.
LocalCount = Annotated[StrictInt, Field(ge=1, le=MAX_LOCAL)]


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
    slots: LocalCount | None = Field(
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


class NetworkCheckSpec(_Model):
    """The pairwise network check among the job's nodes (orchestrator/netcheck.py)."""

    bytes: Annotated[StrictInt, Field(ge=65536, le=2**30)] = Field(
        default=8 * 2**20, description="sent over each link (each node to its ring neighbour "
        "and to node 0)")
    min_mb_per_s: Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)] | None = \
        Field(default=None, description="a slower link is bad (null: only failed transfers "
              "are); a node whose every link is bad is unhealthy")
    timeout: Seconds = Field(default=30.0, description="per transfer; past it, it failed")


class HealthSpec(_Model):
    """Heartbeats and timeouts, in seconds."""

    heartbeat_interval: Seconds = Field(
        default=1.0, description="how often an agent is heard (it beats twice as often, at "
                                 "most every 0.5 s) and the controller pings it")
    # Measured (docs/guides/faults.md, "Endurance"): healthy nodes on a machine 64x
    # oversubscribed were never unheard for more than 0.7 s; at 512x, for minutes. Torch
    # elastic allows 15 s, Slurm 300 s; a false LOST costs a whole restart, a true one is
    # still found within it.
    node_timeout: Seconds = Field(
        default=30.0, description="a node unheard this long is LOST (its channel is dropped "
                                  "and reconnected after half of it)")
    hang_timeout: Seconds | None = Field(default=None, description="no output for this long")
    # The silence before an attempt's first line is the program's start (imports, a model or
    # a checkpoint loaded: minutes at scale, more on a busy node), not a hang: it gets its own
    # allowance, as nvidia-resiliency-ext's initial_rank_heartbeat_timeout.
    startup_timeout: Seconds | None = Field(
        default=None, description="no output yet this long after an attempt's start is a hang "
                                  "(null: hang_timeout)")
    flight_recorder: int = Field(
        default=2000, ge=0,
        description="collectives torch's flight recorder keeps per process group (NCCL or "
                    "gloo), dumped on a hang or a collective timeout; 0: off. A job that sets "
                    "TORCH_FR_BUFFER_SIZE or TORCH_NCCL_TRACE_BUFFER_SIZE keeps its own")
    controller_grace: Seconds | None = Field(
        default=600.0,
        description="seconds agents keep the workers running with no controller attached "
                    "(null: forever); then they stop them")
    node_check: tuple[str, ...] = Field(
        default=(), description="a command (argv) run on every node, in its workdir with the "
        "job's env, before each attempt: nonzero or past node_check_timeout, the node is "
        "unhealthy and left out where nnodes MIN allows (else the job fails naming it)")
    node_check_timeout: Seconds = 60.0
    min_free_bytes: Annotated[StrictInt, Field(ge=0)] | None = Field(
        default=None, description="checked with node_check, before each attempt: fewer free "
        "bytes in a node's workdir or its cache makes it unhealthy (null: not checked)")
    gpu_check: bool = Field(
        default=True, description="on nodes with GPUs, before each attempt: nvidia-smi must "
        "see gpus_per_node GPUs (default: as many as the node's agent counted) with no "
        "uncorrectable ECC error and no page retirement or row remapping pending")
    gpus_per_node: Annotated[StrictInt, Field(ge=1)] | None = None
    network_check: NetworkCheckSpec | None = Field(
        default=None, description="the pairwise network check before each attempt (true: "
        "with the defaults); null: off")
    preemption_check: str | None = Field(
        default=None, max_length=1 << 16, description="a /bin/sh script each node's agent "
        "runs every preemption_check_interval while workers run or a controller is "
        "attached (a cloud's metadata service): exit 0 means the node is to go, and the "
        "first line of its output, if seconds or an ISO 8601 time, when; the job then "
        "moves off the node at a saved step (docs/guides/faults.md)")
    preemption_check_interval: Seconds = 5.0

    @field_validator("network_check", mode="before")
    @classmethod
    def _network_check_flag(cls, v: Any) -> Any:
        if v is True:
            return {}
        return None if v is False else v

    @property
    def checks_nodes(self) -> bool:
        """Whether every node runs node_check before each attempt, GPUs aside."""
        return bool(self.node_check) or self.min_free_bytes is not None

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


_MODULE_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class RestartSpec(_Model):
    """How the workers start again after a failure."""

    warm: bool = Field(
        default=False, description="keep a started interpreter per local rank that has "
        "imported torch (and warm_imports); a restart's workers are those instead of new "
        "processes (static rendezvous, commands `python [flags] script` or `python -m mod`)")
    warm_imports: tuple[str, ...] = Field(
        default=(), description="modules a standby imports besides torch, e.g. your model's "
        "(found as your script would: its directory, or the workdir for -m, comes first)")

    @field_validator("warm_imports")
    @classmethod
    def _modules(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for i, name in enumerate(v):
            if not _MODULE_NAME_RE.match(name):
                raise _FieldError(f"[{i}]", "not a module name (dotted identifiers)", name)
        return v


def _regexes(v: tuple[str, ...]) -> tuple[str, ...]:
    for i, pattern in enumerate(v):
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as exc:
            raise _FieldError(f"[{i}]", f"not a regular expression: {exc}", pattern) from None
    return v


_ExitCode = Annotated[StrictInt, Field(ge=1, le=255)]


class RestartPolicySpec(_Model):
    """Which failed attempts are restarted (orchestrator/policy.py). ``max_restarts`` and
    ``fail_on_exit_codes`` may also be given at the top level, the short form."""

    max_restarts: Annotated[StrictInt, Field(ge=0)] | None = Field(
        default=None, description="restarts for failures of the program (and, unless "
        "max_infra_restarts is set, of the infrastructure); the same as the top-level field")
    max_infra_restarts: Annotated[StrictInt, Field(ge=0)] | None = Field(
        default=None, description="a separate budget for infrastructure failures (a node or "
        "agent lost, a worker killed from outside, gloo/NCCL connection errors, "
        "restart_on_exit_codes, restart_on_log); null: they count against max_restarts")
    stop_on_repeat: bool = Field(
        default=True, description="end the job when the same error (exception type and "
        "innermost frame) ends two attempts in a row at the same step (from any rank: which "
        "rank fails first is a race when all hit the same bug)")
    fail_on_exit_codes: tuple[_ExitCode, ...] = Field(
        default=(), description="exit codes that fail the job without a restart (added to "
        "the top-level field)")
    restart_on_exit_codes: tuple[_ExitCode, ...] = Field(
        default=(), description="exit codes that mean 'not my bug': the failure counts as "
        "infrastructure and is restarted even when stop_on_repeat would end the job")
    fail_on_log: tuple[str, ...] = Field(
        default=(), description="regular expressions over the failing rank's last stderr "
        "lines: a match fails the job without a restart (e.g. 'CUDA out of memory')")
    restart_on_log: tuple[str, ...] = Field(
        default=(), description="regular expressions over the failing rank's last stderr "
        "lines: a match makes the failure infrastructure (restarted on that budget)")

    @field_validator("fail_on_log", "restart_on_log")
    @classmethod
    def _patterns(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _regexes(v)


_NOTIFY_EVENTS = Literal["failed", "succeeded", "cancelled", "restarted", "hung", "node_lost",
                         "quarantined", "paused", "drained", "preempted"]


class NotifySpec(_Model):
    """A webhook that receives a JSON POST per event (orchestrator/notify.py)."""

    url: str = Field(description="http:// or https:// URL; a secret (it often holds a "
                                 "token): never shown or logged")
    on: tuple[_NOTIFY_EVENTS, ...] = Field(
        default=("failed", "succeeded", "restarted", "hung", "node_lost", "quarantined",
                 "paused", "drained", "preempted"),
        description="the events sent: failed, succeeded, cancelled, restarted, hung, "
                    "node_lost, quarantined, paused (the controller cannot write: a full "
                    "disk), drained (the job moved off drained or noticed nodes), preempted "
                    "(every node left: the job stopped PREEMPTED)")
    timeout: Annotated[float, Field(ge=MIN_SECONDS, le=60, allow_inf_nan=False)] = Field(
        default=5.0, description="seconds per try (a receiver is tried up to 4 times)")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        try:
            parts = urllib.parse.urlsplit(v)
            host = parts.hostname
        except ValueError:
            host = None
        if parts.scheme not in ("http", "https") or not host or any(
                c in v for c in "\0\r\n "):
            # Not echoed: the URL is a secret even when it is malformed.
            raise _FieldError("", "must be an http:// or https:// URL (not shown: a secret)")
        return v


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


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _size(v: Any) -> Any:
    """Bytes as an integer, or text such as "512MiB" or "8GB"."""
    if isinstance(v, str):
        match = _SIZE_RE.match(v)
        if not match:
            raise ValueError('must be a number of bytes or a size such as "16GiB"')
        size = float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]
        if size > MAX_INT:  # also inf (400 digits), which int() refuses with OverflowError
            raise ValueError(f"must be at most {MAX_INT} bytes")
        v = int(size)
    return v


class CheckpointSpec(_Model):
    """Checkpoints saved by ``orchestrator.checkpoint.save`` (docs/guides/checkpoints.md): in the
    memory of each node's agent, persisted by it in the background."""

    dir: PathText | None = Field(
        default=None, description="where each node persists its ranks' copies (relative to "
        "the workdir; a shared filesystem makes every copy every node's); null: memory only")
    persist_every: Annotated[StrictInt, Field(ge=1)] = Field(
        default=10, description="every Nth save of a worker is persisted")
    keep: Annotated[StrictInt, Field(ge=1)] = Field(
        default=2, description="persisted steps kept (older ones are removed)")
    memory: Annotated[StrictInt, Field(ge=1 << 20), BeforeValidator(_size)] | None = Field(
        default=None, description='bytes of each node\'s memory for its ranks\' saves and the '
        'replicas it keeps of its buddy\'s, shared between them, e.g. "16GiB" (at least two '
        'copies of a rank\'s state; null: half of /dev/shm)')


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
