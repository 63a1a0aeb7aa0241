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

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from orchestrator import placeholders, specwhere
from orchestrator.errors import SpecError
from orchestrator.specparts import (  # noqa: F401 (the sections are part of spec's surface)
    _ENV_NAME_RE,
    _NAME_RE,
    _PYTHON_RE,
    DEPRECATED_ENV,
    MAX_LOCAL,
    MAX_SPEC_BYTES,
    MIN_SECONDS,
    RESERVED_ENV,
    RESERVED_ENV_PREFIXES,
    BackoffSpec,
    CheckpointSpec,
    HealthSpec,
    LocalCount,
    LogsSpec,
    NetworkCheckSpec,
    NodeSpec,
    NotifySpec,
    PathText,
    RendezvousSpec,
    RestartPolicySpec,
    RestartSpec,
    Seconds,
    SlurmSpec,
    SSHOptions,
    SyncSpec,
    _duration,
    _FieldError,
    _Model,
    _parse_nnodes,
    looks_secret,
    split_host,
)
from orchestrator.yamlsafe import load_yaml, read_text


class JobSpec(_Model):
    """A distributed job: what runs, where, and how failures are handled."""

    name: str = "job"
    nodes: tuple[NodeSpec, ...] = ()
    hostfile: PathText | None = Field(
        default=None, description="DeepSpeed-style 'hostname slots=N' file, instead of nodes")
    nproc_per_node: LocalCount | Literal["gpu", "auto"] = Field(
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
    setup_timeout: Seconds | None = Field(
        default=1800.0, description="seconds a node's setup may take (null: no limit); past "
        "it, it is stopped and the node fails with SETUP_FAILED (with nnodes MIN:MAX the job "
        "goes on without it)")
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: tuple[str, ...] = Field(
        default=(), description="env names whose values are never shown (names containing "
                                "TOKEN, KEY, PASSWORD or SECRET are masked anyway)")
    max_restarts: Annotated[StrictInt, Field(ge=0)] = 0
    max_duration: Annotated[float, Field(ge=MIN_SECONDS, allow_inf_nan=False),
                            BeforeValidator(_duration)] | None = Field(
        default=None, description='wall-clock limit of the whole job: seconds or "HH:MM:SS"; '
                                  "then every worker is stopped and the job FAILS (TIMEOUT), "
                                  "never restarted")
    total_steps: Annotated[StrictInt, Field(ge=1, lt=1 << 62)] | None = Field(
        default=None, description="steps the run takes in all, for progress and ETA in status "
                                  "(a rank's heartbeat(total_steps=...) overrides it)")
    fail_on_exit_codes: tuple[Annotated[StrictInt, Field(ge=1, le=255)], ...] = Field(
        default=(), description="exit codes that fail the job without a restart")
    stop_grace_period: Seconds = Field(
        default=10.0, description="seconds between SIGTERM and SIGKILL at every stop; also "
        "what a node's agent told SIGTERM (its host's shutdown, Slurm's preemption) gives the "
        "job to move off it at a saved step")
    on_sigterm: Literal["agent", "worker"] = Field(
        default="agent", description='a SIGTERM to a node\'s agent: "agent", a notice (the '
        'job moves off the node at a saved step, then the workers stop); "worker", passed '
        "on to the workers at once, as torchrun does, for scripts that handle it themselves")
    launch_timeout: Seconds = 60.0
    python: str = Field(default="python3", description="interpreter for the agent on SSH nodes")
    spool_max_bytes: Annotated[StrictInt, Field(ge=0)] | None = Field(
        default=256 * 1024 * 1024,
        description="output an agent keeps on disk while no controller is attached (null: no "
                    "cap); past it, lines are counted and the count is logged")
    rendezvous: RendezvousSpec = RendezvousSpec()
    restart_backoff: BackoffSpec = BackoffSpec()
    restart: RestartSpec = RestartSpec()
    restart_policy: RestartPolicySpec = RestartPolicySpec()
    notify: tuple[NotifySpec, ...] = Field(
        default=(), description="webhooks told of the job's events (a JSON POST each, "
                                "Slack-compatible)")
    health: HealthSpec = HealthSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
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
        if v in ("gpu", "auto") or (type(v) is int and 1 <= v <= MAX_LOCAL):
            return v
        if type(v) is int and v > MAX_LOCAL:
            raise ValueError(f"must be at most {MAX_LOCAL}: the agent protocol carries no "
                             "more workers on one node")
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

    @model_validator(mode="before")
    @classmethod
    def _short_forms(cls, data: Any) -> Any:
        """``restart_policy.max_restarts`` and ``.fail_on_exit_codes`` become the top-level
        fields, which the rest of the code reads."""
        policy = data.get("restart_policy") if isinstance(data, dict) else None
        if not isinstance(policy, dict):
            return data
        data = dict(data)
        given = policy.get("max_restarts")
        if given is not None:
            if data.get("max_restarts") not in (None, given):
                raise _FieldError("restart_policy.max_restarts", "differs from the top-level "
                                  "max_restarts: give one of them", given)
            data["max_restarts"] = given
        codes = policy.get("fail_on_exit_codes")
        if isinstance(codes, list | tuple) and codes:
            top = data.get("fail_on_exit_codes") or []
            if isinstance(top, list | tuple):
                # A bad code is left for restart_policy's own check to name.
                good = [c for c in codes if type(c) is int and 1 <= c <= 255 and c not in top]
                data["fail_on_exit_codes"] = [*top, *good]
        return data

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
    def standby_imports(self) -> tuple[str, ...] | None:
        """What warm standbys import besides torch; None: restarts are cold (``restart.warm``
        off, or c10d, where torchrun starts its own workers)."""
        warm = self.restart.warm and self.rendezvous.backend == "static"
        return self.restart.warm_imports if warm else None

    @property
    def secret_names(self) -> frozenset[str]:
        """Names in ``env`` whose values are masked wherever the orchestrator shows them."""
        return frozenset(k for k in self.env if k in self.secret_env or looks_secret(k))

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


def parse_jobspec(text: str, *, base_dir: str | os.PathLike[str] = ".",
                  env: dict[str, str] | None = None, overrides: list[str] | None = None
                  ) -> JobSpec:
    """Validate a spec given as YAML text; ``hostfile`` is read relative to ``base_dir``.
    ``env`` adds to the spec's env; ``overrides`` are ``field.path=value`` (a YAML value),
    as ``submit --env`` and ``--set`` give them; both are validated like the file."""
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError("", f"the spec is larger than {MAX_SPEC_BYTES} bytes")
    positions: specwhere.Positions = {}
    data = load_yaml(text, positions)
    set_by = {_apply_override(data, item): item for item in overrides or ()}
    if env:
        current = data.get("env")
        data["env"] = {**(current if isinstance(current, dict) else {}), **env}
    if not isinstance(data.get("hostfile"), str):
        try:
            return validate_jobspec(data)
        except SpecError as exc:  # every problem at once, each where it is
            raise specwhere.located(exc, positions, set_by) from None
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
            raise specwhere.located(exc, positions, set_by) from None
        raise SpecError("hostfile", f"line {lines[int(m[1])]}: {exc.message}", exc.value,
                        has_value=exc.has_value) from None


def load_jobspec(path: str | os.PathLike[str], *, env: dict[str, str] | None = None,
                 overrides: list[str] | None = None) -> JobSpec:
    """Read, parse and validate a YAML job spec file (at most 1 MiB of UTF-8), with optional
    ``env`` additions and ``field.path=value`` overrides (see parse_jobspec)."""
    path = Path(path)
    return parse_jobspec(read_text(path, "", "spec file"), base_dir=path.resolve().parent,
                         env=env, overrides=overrides)


_PATH_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)")


def parse_override(item: str) -> tuple[str, list[str | int], Any]:
    """One ``field.path[i].sub=value`` as (the path as written, its steps, the YAML value);
    a SpecError naming the path for anything else."""
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
        value = load_yaml(f"v: {raw}")["v"] if raw.strip() else ""
    except SpecError as exc:
        if exc.field.startswith("v"):  # about a value inside it (e.g. a number too long)
            raise SpecError(path + exc.field[1:], exc.message, exc.value,
                            has_value=exc.has_value) from None
        raise SpecError(path, f"--set value is not valid YAML: {exc.message}") from None
    return path, steps, value


def _apply_override(data: dict[str, Any], item: str) -> tuple[str | int, ...]:
    """Apply one ``field.path[i].sub=value`` to the parsed document; the path it wrote."""
    path, steps, value = parse_override(item)
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
    return tuple(steps)


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
    text = read_text(path, "hostfile", "hostfile")
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
        if m and (len(m[1]) > len(str(MAX_LOCAL)) or int(m[1]) > MAX_LOCAL):
            # Not echoed: a slots= of 5,000 digits is neither readable nor convertible.
            raise SpecError("hostfile", f"{given} line {number}: slots must be at most "
                            f"{MAX_LOCAL}: the agent protocol carries no more workers on "
                            "one node")
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


_MODELS: dict[str, type[BaseModel]] = {
    "": JobSpec, "nodes": NodeSpec, "rendezvous": RendezvousSpec, "health": HealthSpec,
    "restart_backoff": BackoffSpec, "restart": RestartSpec,
    "restart_policy": RestartPolicySpec, "notify": NotifySpec, "ssh": SSHOptions,
    "logs": LogsSpec, "sync": SyncSpec, "slurm": SlurmSpec, "network_check": NetworkCheckSpec,
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
    """Every pydantic error as a SpecError with a clean path and a short message: the first,
    holding them all in ``problems``."""
    problems: list[SpecError] = []
    for err in exc.errors():
        problem = _one_error(err, data)
        if all(str(problem) != str(p) for p in problems):
            problems.append(problem)
    problems[0].problems = problems
    return problems[0]


def _one_error(err: Any, data: dict[str, Any]) -> SpecError:
    # Drop the parts of loc that name validators or union arms rather than fields.
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and (
        p.startswith(("function-", "json-or-python", "literal[", "constrained-"))
        or p in ("int", "str", "float"))))
    field = specwhere.path_text(loc)
    return _tagged(_translated(err, data, loc, field), loc, err["type"])


def _tagged(error: SpecError, loc: tuple[Any, ...], kind: str) -> SpecError:
    error.loc, error.kind = loc, kind
    return error


def _translated(err: Any, data: dict[str, Any], loc: tuple[Any, ...], field: str
                ) -> SpecError:
    ctx_error = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_error, _FieldError):
        sub = ctx_error.field
        if sub:
            field = f"{field}{sub}" if sub.startswith("[") or not field else f"{field}.{sub}"
        has = ctx_error.value is not ...
        return SpecError(field, ctx_error.message, ctx_error.value if has else None,
                         has_value=has)
    has_value, value = specwhere.value_at(data, loc)
    if type(value) is int and value.bit_length() > 256:
        has_value, value = False, None  # repr() raises past 4,300 digits, and helps no one
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = next((str(p) for p in reversed(loc[:-1]) if str(p) in _MODELS), "")
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
