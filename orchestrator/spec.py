"""Job specs: frozen pydantic models, and loading them safely from YAML.

A spec is data: it says what to run where, never how. Loading is strict, because a typo in a
spec should cost a second at submit time, not an hour of a cluster: unknown keys (with a
"did you mean"), duplicate keys, several documents, files over
1 MiB or not UTF-8, and alias bombs are refused, and every error names the field path and the value.
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
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from orchestrator.errors import SpecError

MAX_SPEC_BYTES = 1024 * 1024

RESERVED_ENV = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
})
RESERVED_ENV_PREFIXES = ("TORCHELASTIC_", "ORCHESTRATOR_")

_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
_IPV6_RE = re.compile(r"^[0-9A-Fa-f:.]+$")
_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]*$")
_PYTHON_RE = re.compile(r"^[A-Za-z0-9_./+-]+$")

Port = Annotated[StrictInt, Field(ge=1, le=65535)]
Seconds = Annotated[float, Field(gt=0, strict=True)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _no_control(value: str, what: str) -> str:
    if "\0" in value or "\n" in value or "\r" in value:
        raise ValueError(f"{what} must not contain NUL or newline characters")
    return value


def _check_hostname(value: str) -> str:
    """A DNS name, an IPv4 address, or an IPv6 literal: nothing a shell would interpret."""
    if _HOSTNAME_RE.match(value) or (":" in value and _IPV6_RE.match(value)):
        return value
    raise ValueError("not a valid host name or address")


def split_host(text: str) -> tuple[str | None, str, int | None]:
    """``[user@]hostname[:port]`` (IPv6 as ``[addr]:port``) -> (user, hostname, port)."""
    user = None
    if "@" in text:
        user, text = text.split("@", 1)
        if not _USER_RE.match(user):
            raise ValueError(f"invalid user name {user!r}")
    port: int | None = None
    if text.startswith("["):
        addr, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError("invalid bracketed IPv6 address")
        text, port_text = addr, rest[1:] if rest else None
    elif text.count(":") == 1:
        text, port_text = text.split(":")
    else:
        port_text = None
    if port_text is not None:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"invalid port {port_text!r}")
        port = int(port_text)
    return user, _check_hostname(text), port


class SSHOptions(_Model):
    """Job-wide defaults for SSH nodes."""

    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = Field(default=None, description="default: ~/.ssh/known_hosts")
    host_key_policy: Literal["reject", "accept-new"] = "reject"
    connect_timeout: Seconds = 10.0

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and not _USER_RE.match(v):
            raise ValueError("invalid user name")
        return v

    @field_validator("identity_file", "known_hosts")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return None if v is None else _no_control(v, "a path")


class NodeSpec(_Model):
    """One node: ``local`` (this machine, no SSH) or ``[user@]host[:port]`` over SSH."""

    host: str
    user: str | None = None
    port: Port | None = None
    identity_file: str | None = None
    address: str | None = Field(default=None, description="address other nodes reach this node at")

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        if v != "local":
            split_host(v)
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and not _USER_RE.match(v):
            raise ValueError("invalid user name")
        return v

    @field_validator("identity_file")
    @classmethod
    def _identity(cls, v: str | None) -> str | None:
        return None if v is None else _no_control(v, "a path")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        return None if v is None else _check_hostname(v)

    @model_validator(mode="after")
    def _consistent(self) -> NodeSpec:
        if self.is_local:
            return self
        user, _, port = split_host(self.host)
        if user and self.user and user != self.user:
            raise ValueError(f"user {self.user!r} contradicts the host string's {user!r}")
        if port and self.port and port != self.port:
            raise ValueError(f"port {self.port} contradicts the host string's {port}")
        return self

    @property
    def is_local(self) -> bool:
        return self.host == "local"

    @property
    def hostname(self) -> str:
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
    port: Literal["auto"] | Port = "auto"
    master_addr: str | None = None

    @field_validator("master_addr")
    @classmethod
    def _addr(cls, v: str | None) -> str | None:
        return None if v is None else _check_hostname(v)


class HealthSpec(_Model):
    """Heartbeats and timeouts, in seconds."""

    heartbeat_interval: Seconds = 1.0
    node_timeout: Seconds = 5.0
    hang_timeout: Seconds | None = None

    @model_validator(mode="after")
    def _order(self) -> HealthSpec:
        if self.node_timeout <= self.heartbeat_interval:
            raise ValueError("node_timeout must be longer than heartbeat_interval")
        return self


class BackoffSpec(_Model):
    """Wait before restart n: min(max, initial * 2**(n-1)) seconds."""

    initial: Seconds = 1.0
    max: Seconds = 30.0

    @model_validator(mode="after")
    def _order(self) -> BackoffSpec:
        if self.max < self.initial:
            raise ValueError("max must be at least initial")
        return self


class JobSpec(_Model):
    """A distributed job: what runs, where, and how failures are handled."""

    name: str = "job"
    nodes: tuple[NodeSpec, ...] = ()
    hostfile: str | None = Field(default=None, description="DeepSpeed-style 'host slots=N' file")
    nproc_per_node: Annotated[StrictInt, Field(ge=1)] = 1
    nnodes: str | StrictInt | None = Field(default=None, description='"MIN:MAX", "N" or N')
    command: tuple[str, ...]
    workdir: str = "."
    env: dict[str, str] = Field(default_factory=dict)
    max_restarts: Annotated[StrictInt, Field(ge=0)] = 0
    fail_on_exit_codes: tuple[Annotated[StrictInt, Field(ge=1, le=255)], ...] = ()
    stop_grace_period: Seconds = 10.0
    launch_timeout: Seconds = 60.0
    python: str = "python3"
    rendezvous: RendezvousSpec = RendezvousSpec()
    restart_backoff: BackoffSpec = BackoffSpec()
    health: HealthSpec = HealthSpec()
    ssh: SSHOptions = SSHOptions()

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
            for item in v:
                if isinstance(item, str) and "\0" in item:
                    raise ValueError("arguments must not contain NUL")
        return v

    @field_validator("workdir", "hostfile")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return None if v is None else _no_control(v, "a path")

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        if not _PYTHON_RE.match(v):
            raise ValueError("must be a program name or path without spaces or shell characters")
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {}
        for key, value in v.items():
            if not isinstance(key, str) or not _ENV_NAME_RE.match(key):
                raise ValueError(f"{key!r} is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)")
            if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(f"{key} is set by the orchestrator and cannot be overridden")
            if isinstance(value, bool) or value is None or not isinstance(value, (str, int, float)):
                raise ValueError(f"{key}: value must be a string or a number, got {value!r}")
            value = str(value)
            if "\0" in value or "\n" in value or "\r" in value:
                raise ValueError(f"{key}: value must not contain NUL or newline characters")
            out[key] = value
        return out

    @field_validator("nnodes")
    @classmethod
    def _nnodes(cls, v: str | int | None) -> str | int | None:
        if v is not None:
            _parse_nnodes(v)
        return v

    @model_validator(mode="after")
    def _nodes(self) -> JobSpec:
        if self.hostfile is None and not self.nodes:
            raise _FieldError("nodes", "at least one node is required (nodes or hostfile)")
        if self.hostfile is not None and self.nodes:
            raise _FieldError("hostfile", "give nodes or hostfile, not both")
        if self.hostfile is not None:
            return self  # load_jobspec expands it, then validates again
        seen: dict[tuple[str | None, str, int], int] = {}
        for i, node in enumerate(self.nodes):
            if node.is_local:
                continue  # several local "nodes" are how one machine runs a multi-node job
            key = node.resolved(self.ssh)
            if key in seen:
                raise _FieldError(f"nodes[{i}].host",
                                  f"duplicate host (same as nodes[{seen[key]}])", node.host)
            seen[key] = i
        lo, hi = self.min_nodes, self.max_nodes
        if hi > len(self.nodes):
            raise _FieldError("nnodes", f"MAX {hi} is more than the {len(self.nodes)} node(s)",
                              self.nnodes)
        if lo > hi:
            raise _FieldError("nnodes", "MIN is larger than MAX", self.nnodes)
        return self

    @property
    def min_nodes(self) -> int:
        return _parse_nnodes(self.nnodes)[0] if self.nnodes is not None else len(self.nodes)

    @property
    def max_nodes(self) -> int:
        return _parse_nnodes(self.nnodes)[1] if self.nnodes is not None else len(self.nodes)


class _FieldError(ValueError):
    """A model-level check that knows the exact field at fault."""

    def __init__(self, field: str, message: str, value: Any = ...):
        super().__init__(message)
        self.field, self.message, self.value = field, message, value


def _parse_nnodes(v: str | int) -> tuple[int, int]:
    if isinstance(v, int):
        lo = hi = v
    else:
        m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", v)
        if not m:
            raise ValueError('must be "MIN:MAX" or a number of nodes')
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
    if lo < 1:
        raise ValueError("needs at least 1 node")
    return lo, hi


# --- loading -------------------------------------------------------------------------------

MAX_EXPANDED_NODES = 100_000


def _check_tree(node: yaml.Node, path: str = "", memo: dict[int, int] | None = None) -> int:
    """Refuse duplicate keys (naming their path) and count the nodes the document expands
    to, aliases included, so an alias bomb is refused before anything is built."""
    memo = {} if memo is None else memo
    if id(node) in memo:  # an alias: its anchor was counted once, it costs that much again
        return memo[id(node)]
    size = 1
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            child = f"{path}.{key}" if path else key
            if key in seen:
                raise SpecError(child, f"duplicate key (line {key_node.start_mark.line + 1})")
            seen.add(key)
            size += _check_tree(value_node, child, memo)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            size += _check_tree(item, f"{path}[{i}]", memo)
    memo[id(node)] = size
    if size > MAX_EXPANDED_NODES:
        raise SpecError(path, f"the YAML expands to more than {MAX_EXPANDED_NODES} values "
                              "(alias bomb?)")
    return size


def parse_jobspec(text: str, *, base_dir: str | os.PathLike[str] = ".") -> JobSpec:
    """Validate a spec given as YAML text; ``hostfile`` is read relative to ``base_dir``."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError("", f"spec is larger than {MAX_SPEC_BYTES} bytes")
    try:
        loader = yaml.SafeLoader(text)
        try:
            if not loader.check_node():
                raise SpecError("", "the spec is empty; expected a mapping")
            root = loader.get_node()
            assert root is not None  # check_node() said there is one
            if loader.check_node():
                raise SpecError("", "several YAML documents; expected exactly one")
            _check_tree(root)
            data = loader.construct_document(root)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpecError("", f"invalid YAML: {where}{exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise SpecError("", f"invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError("", f"the spec must be a mapping of fields, not {type(data).__name__}")
    if isinstance(data.get("hostfile"), str) and "nodes" not in data:
        data = _expand_hostfile(data, Path(base_dir))
    return validate_jobspec(data)


def load_jobspec(path: str | os.PathLike[str]) -> JobSpec:
    """Read, parse and validate a YAML job spec file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_SPEC_BYTES:
            raise SpecError("", f"{path}: spec is larger than {MAX_SPEC_BYTES} bytes ({size})")
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError("", f"cannot read spec file {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError("", f"{path} is not UTF-8 (byte {exc.start})") from None
    return parse_jobspec(text, base_dir=path.resolve().parent)


def validate_jobspec(data: dict[str, Any]) -> JobSpec:
    """Validate already-parsed data, translating pydantic's errors into one SpecError."""
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise _spec_error(exc, data) from None


def _expand_hostfile(data: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    path = base_dir / os.path.expanduser(data["hostfile"])
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("hostfile", f"cannot read {path}: {exc}", data["hostfile"],
                        has_value=True) from None
    nodes, slots = [], set()
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        host, extra = parts[0], parts[1:]
        for item in extra:
            if not re.fullmatch(r"slots=\d+", item):
                raise SpecError("hostfile", f"{path} line {number}: expected 'host slots=N'",
                                line, has_value=True)
            slots.add(int(item.split("=")[1]))
        nodes.append({"host": host})
    if len(slots) > 1:
        raise SpecError("hostfile", f"{path}: all hosts need the same slots (got "
                        f"{sorted(slots)})", data["hostfile"], has_value=True)
    out = {k: v for k, v in data.items() if k != "hostfile"}
    out["nodes"] = nodes
    if slots:
        (n,) = slots
        if "nproc_per_node" in data and data["nproc_per_node"] != n:
            raise SpecError("nproc_per_node", f"contradicts slots={n} in the hostfile",
                            data["nproc_per_node"], has_value=True)
        out["nproc_per_node"] = n
    return out


def _path_text(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
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
    "restart_backoff": BackoffSpec, "ssh": SSHOptions,
}


def _spec_error(exc: ValidationError, data: dict[str, Any]) -> SpecError:
    err = exc.errors()[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and (
        p.startswith(("function-", "json-or-python", "literal[")) or p in ("int", "str", "float"))))
    ctx_error = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_error, _FieldError):
        has = ctx_error.value is not ...
        return SpecError(ctx_error.field, ctx_error.message, ctx_error.value if has else None,
                         has_value=has)
    field = _path_text(loc)
    has_value, value = _value_at(data, loc)
    if err["type"] == "extra_forbidden":
        parent = str(loc[0]) if len(loc) > 1 and isinstance(loc[0], str) else ""
        model = _MODELS.get(parent, JobSpec)
        close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return SpecError(field, f"unknown field{hint}")
    if err["type"] == "missing":
        return SpecError(field, "required field is missing")
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] in ("int_type", "int_parsing", "int_from_float") and \
            isinstance(value, (bool, float, str)):
        message = "must be a whole number (not a boolean, fraction or string)"
    return SpecError(field, message, value, has_value=has_value)
