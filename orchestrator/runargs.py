"""``orchestrator run``: a torchrun command line as a job spec.

Everyone arrives with a command line that works (``torchrun --nnodes 2 --nproc-per-node 8
--rdzv-endpoint ... train.py --lr 3e-4``); pasted after ``orchestrator run --hosts ...`` in
place of ``torchrun`` it becomes the spec that ``submit`` would take, validated by the same
code (``spec.parse_jobspec``, on the very YAML that ``--save-spec`` writes). Every torchrun
flag is mapped, accepted with a note (it means nothing here, and refusing it would only
break a paste), or refused with the reason (it would change what the script sees); the
table is ``_FLAGS`` and docs/guides/from-torchrun.md. Options stop at the
script, as torchrun's parser stops there: everything after it is the script's, even what
looks like one of our flags.

``spec_from_torchrun_args`` is pure (no I/O: the working directory, the interpreter and the
CPU count are arguments); ``load`` reads the hostfile and validates.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec, parse_jobspec
from orchestrator.specparts import MAX_LOCAL, _parse_nnodes, split_host

_SHOWN = "every rank's output is kept and shown: orchestrator logs JOB --rank R"
_GREP = "search the kept output instead: orchestrator logs JOB | grep ..."

#: What each flag does here: "map" (into the spec), "note" (accepted, one note on stderr
#: saying why it has no effect), "refuse" (an error saying why), "ours" (not torchrun's).
#: (treatment, takes a value, the note or the refusal).
_FLAGS: dict[str, tuple[str, bool, str]] = {
    "--nnodes": ("map", True, ""),
    "--nproc-per-node": ("map", True, ""),
    "--rdzv-backend": ("map", True, ""),
    "--rdzv-endpoint": ("map", True, ""),
    "--standalone": ("map", False, ""),
    "--max-restarts": ("map", True, ""),
    "--master-addr": ("map", True, ""),
    "--master-port": ("map", True, ""),
    "--module": ("map", False, ""),
    "--no-python": ("map", False, ""),
    "--run-path": ("map", False, "each worker runs the script as `python -u SCRIPT` (torchrun "
                   "would run it with runpy in a process of its own)"),
    "--shutdown-timeout": ("map", True, ""),
    # The job id is the run id (TORCHELASTIC_RUN_ID, and c10d's rendezvous id with the
    # attempt): unique per job, which is all --rdzv-id is for. Refusing it would break the
    # commonest pasted line (--rdzv-id=$SLURM_JOB_ID), and no script reads it back.
    "--rdzv-id": ("note", True, "the job id names the run (TORCHELASTIC_RUN_ID)"),
    "--rdzv-conf": ("note", True, "the orchestrator hosts the rendezvous on the first node "
                    "and sets is_host itself; its timeouts are the spec's launch_timeout "
                    "and health"),
    "--monitor-interval": ("note", True, "each node's agent learns of a worker's exit at "
                           "once; it does not poll"),
    "--start-method": ("note", True, "workers are processes started by each node's agent, "
                       "as torchrun starts a script"),
    "--event-log-handler": ("note", True, "the job's events are in `orchestrator status` "
                            "and the spec's notify webhooks"),
    "--role": ("note", True, "workers get ROLE_NAME=default"),
    "--log-dir": ("note", True, "every rank's output is kept: orchestrator logs JOB --rank R"),
    "--redirects": ("note", True, _SHOWN),
    "--tee": ("note", True, _SHOWN),
    "--local-ranks-filter": ("note", True, "every rank is shown; orchestrator logs JOB "
                             "--rank R shows one"),
    "--duplicate-stdout-filters": ("note", True, _GREP),
    "--duplicate-stderr-filters": ("note", True, _GREP),
    "--logs-specs": ("note", True, "the orchestrator keeps every rank's output itself"),
    "--local-addr": ("note", True, "peers reach each node at its host name (a spec's "
                     "nodes[i].address names another)"),
    "--signals-to-handle": ("note", True, "workers get torchrun's default "
                            "TORCHELASTIC_SIGNALS_TO_HANDLE; Ctrl-C or SIGTERM here cancels "
                            "the job"),
    "--numa-binding": ("note", True, "workers are not bound to CPUs here"),
    "--node-rank": ("refuse", True, "not needed: the orchestrator gives each node its rank "
                    "(the first host is node 0 and hosts the master); remove it and list "
                    "every node once, with --hosts or --hostfile"),
    "--virtual-local-rank": ("refuse", False, "not supported: each worker sees its node's "
                             "GPUs and LOCAL_RANK as torchrun gives them without it"),
    "--help": ("ours", False, ""),
    "--hosts": ("ours", True, ""),
    "--hostfile": ("ours", True, ""),
    "--slurm-nodes": ("ours", True, ""),
    "--name": ("ours", True, ""),
    "--env": ("ours", True, ""),
    "--env-file": ("ours", True, ""),
    "--save-spec": ("ours", True, ""),
    "--python": ("ours", True, ""),
    "--dry-run": ("ours", False, ""),
}
_SHORT = {"-m": "--module", "-r": "--redirects", "-t": "--tee", "-h": "--help"}
# torchrun accepts every long flag with "_" as well ("--nproc_per_node"); so do we, ours too.
_LONG = {name.replace("-", "_").replace("__", "--", 1): name for name in _FLAGS} | {
    name: name for name in _FLAGS}
_REPEATED = ("--env", "--env-file")
_LOOPBACK = re.compile(r"^(localhost|127(\.\d{1,3}){3}|::1|0\.0\.0\.0)$")
_VALID_START = ("spawn", "fork", "forkserver")

USAGE = """\
usage: orchestrator run [torchrun options] [--hosts H,H,... | --hostfile FILE | --slurm-nodes N]
                        [--name NAME] [--env KEY[=VALUE]]... [--env-file FILE]...
                        [--save-spec FILE] [--python PATH] [--dry-run]
                        SCRIPT [ARGS...] | -m MODULE [ARGS...] | --no-python PROGRAM [ARGS...]

A torchrun command line, run as a job (as `orchestrator submit SPEC --follow`): paste it
after `orchestrator run --hosts ...` in place of `torchrun`. Without hosts: this machine.

torchrun options used: --nnodes N|MIN:MAX, --nproc-per-node N|gpu|auto|cpu, --max-restarts,
  --rdzv-backend static|c10d, --rdzv-endpoint HOST[:PORT], --master-addr, --master-port,
  --standalone, -m/--module, --no-python, --run-path, --shutdown-timeout
accepted with a note (no effect here): --rdzv-id, --rdzv-conf, --monitor-interval,
  --start-method, --role, --log-dir, -r/--redirects, -t/--tee, --local-ranks-filter,
  --local-addr, --event-log-handler, --logs-specs, --signals-to-handle, --numa-binding,
  --duplicate-stdout-filters, --duplicate-stderr-filters
refused: --node-rank (the orchestrator gives node ranks), --virtual-local-rank

ours:
  --hosts H,H,...     nodes reached over SSH ([user@]host[:port]; `local` is this machine)
  --hostfile FILE     DeepSpeed/MPI hostfile: `host slots=N` lines, # comments
  --slurm-nodes N     allocate N nodes from Slurm (or use the allocation this runs in)
  --name NAME         the job's name (default: from the script)
  --env KEY[=VALUE]   add a variable (KEY alone: its value here); --env-file FILE: KEY=VALUE lines
  --save-spec FILE    also write the equivalent spec: `orchestrator submit FILE` next time
  --python PATH       the agent's and workers' interpreter (default: this one here,
                      PYTHON_EXEC if set, python3 on SSH and Slurm nodes)
  --dry-run           print the plan; start nothing
Exit: 0 succeeded, 1 failed, 3 cancelled, 2 bad usage."""


@dataclass(frozen=True)
class RunRequest:
    """What ``orchestrator run`` was asked: the spec (as its YAML holds it) and the rest."""

    spec: dict[str, Any]
    cwd: str
    notes: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    env_files: tuple[str, ...] = ()
    save_spec: str | None = None
    dry_run: bool = False
    help: bool = False
    #: a spec field -> the flag that set it, so that a spec error names the flag
    origins: dict[str, str] = field(default_factory=dict)


def spec_from_torchrun_args(argv: Sequence[str], *, cwd: str, executable: str,
                            environ: Mapping[str, str] | None = None,
                            cpus: int | None = None) -> RunRequest:
    """The job that ``orchestrator run ARGV`` asks for; SpecError naming the flag.

    ``executable`` runs the workers on this machine (torchrun's ``sys.executable``;
    ``PYTHON_EXEC`` in ``environ`` overrides it, as torchrun's); ``cpus`` is what
    ``--nproc-per-node cpu`` means on this machine."""
    given, lists, script, script_args = _split(argv)
    if "--help" in given:
        return RunRequest({}, cwd, help=True)
    if given.get("--start-method", "spawn") not in _VALID_START:
        raise SpecError("--start-method", f"must be one of {', '.join(_VALID_START)}",
                        given["--start-method"], has_value=True)
    notes = [f"{flag} ignored: {_FLAGS[flag][2]}" for flag in given
             if _FLAGS[flag][0] == "note" and not (flag == "--role" and given[flag] == "default")]
    if script is None:
        raise SpecError("run", "the script to run is missing (orchestrator run [options] "
                               "SCRIPT [ARGS...], or -m MODULE)")
    spec: dict[str, Any] = {"name": given.get("--name") or _name_from(script)}
    origins = {"name": "--name", "command": "the script", "workdir": "the script",
               "env": "--env"}
    nodes, local = _where(given, spec, origins)
    _size(given, spec, origins, nodes, local, cpus, notes)
    _rendezvous(given, spec, origins, nodes, local, notes)
    for flag, key, convert in (("--max-restarts", "max_restarts", int),
                               ("--shutdown-timeout", "stop_grace_period", float)):
        if flag in given:
            spec[key] = _number(flag, given[flag], convert)
            origins[key] = flag
    if "--python" in given:
        spec["python"] = given["--python"]
        origins["python"] = "--python"
    environ = environ or {}
    python = given.get("--python") or environ.get("PYTHON_EXEC") or (
        executable if local else "python3")
    spec["command"] = [c.replace("$", "$$") for c in _command(
        given, script, script_args, python, spec.get("rendezvous", {}).get("backend"))]
    # The script is found where it is here: on every node at this path (as DeepSpeed's
    # launcher does: cd to the same directory on each).
    spec["workdir"] = cwd
    if "--run-path" in given:
        notes.append(f"--run-path: {_FLAGS['--run-path'][2]}")
    return RunRequest(spec, cwd, tuple(notes), tuple(lists["--env"]),
                      tuple(lists["--env-file"]), given.get("--save-spec"),
                      "--dry-run" in given, origins=origins)


def _split(argv: Sequence[str]) -> tuple[dict[str, str], dict[str, list[str]], str | None,
                                         list[str]]:
    """(flag -> value, the repeated flags' values, the script, its arguments), as
    torchrun's parser splits a command line: options up to the first word that is not one
    (or ``--``), then the script and everything after it, untouched."""
    given: dict[str, str] = {}
    lists: dict[str, list[str]] = {name: [] for name in _REPEATED}
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            i += 1
            break
        if not word.startswith("-") or word == "-":
            break
        flag, value = _flag(word)
        treatment, takes_value, why = _FLAGS[flag]
        if takes_value and value is None:
            if i + 1 >= len(argv):
                raise SpecError(flag, "expects a value")
            i += 1
            value = argv[i]
        elif not takes_value and value is not None:
            raise SpecError(flag, "takes no value", value, has_value=True)
        if treatment == "refuse":
            raise SpecError(flag, why)
        if flag in lists:
            lists[flag].append(value or "")
        given[flag] = value if value is not None else ""
        i += 1
    script = argv[i] if i < len(argv) else None
    return given, lists, script, list(argv[i + 1:])


def _flag(word: str) -> tuple[str, str | None]:
    """(the canonical flag, its value if attached: ``--x=v``, ``-r3``); SpecError naming an
    unknown or ambiguous flag (torchrun's parser takes a unique prefix: so do we)."""
    if not word.startswith("--"):
        name, rest = word[:2], word[2:]
        if name not in _SHORT:
            raise SpecError(word, "unknown option (not one of torchrun's or ours: "
                                  "orchestrator run --help)")
        flag = _SHORT[name]
        return flag, (rest[1:] if rest.startswith("=") else rest) or None
    name, sep, value = word.partition("=")
    if name in _LONG:
        flag = _LONG[name]
    else:
        matches = sorted({canonical for spelled, canonical in _LONG.items()
                          if spelled.startswith(name)})
        if len(matches) > 1:
            raise SpecError(name, f"ambiguous option: could be {', '.join(matches)}")
        if not matches:
            close = difflib.get_close_matches(name, list(_LONG), n=1)
            hint = f"did you mean {_LONG[close[0]]}?" if close else \
                "orchestrator run --help lists them"
            raise SpecError(name, f"unknown option (not one of torchrun's or ours; {hint})")
        flag = matches[0]
    return flag, value if sep else None


def _name_from(script: str) -> str:
    """A job name from the script (``train.py`` -> ``train``, ``pkg.mod`` -> ``pkg-mod``)."""
    base = os.path.basename(script.rstrip("/"))
    base = base[:-3] if base.endswith(".py") else base
    name = re.sub(r"[^a-z0-9]+", "-", base.lower())[:40].strip("-")
    return name or "job"


def _where(given: dict[str, str], spec: dict[str, Any], origins: dict[str, str]
           ) -> tuple[list[str] | None, bool]:
    """Fill in the nodes; return (the --hosts list, or None for a hostfile or Slurm;
    whether every node is this machine)."""
    chosen = [f for f in ("--hosts", "--hostfile", "--slurm-nodes") if f in given]
    if len(chosen) > 1:
        raise SpecError(chosen[1], f"give one of --hosts, --hostfile, --slurm-nodes (also "
                                   f"given: {chosen[0]})")
    if "--standalone" in given and chosen:
        raise SpecError("--standalone", f"runs one node on this machine: remove it to run on "
                                        f"{chosen[0]}")
    if "--hostfile" in given:
        # Read by the spec's own loader (load), which names the line at fault.
        spec["hostfile"] = os.path.expanduser(given["--hostfile"])
        origins.update(hostfile="--hostfile", nodes="--hostfile")
        return None, False
    if "--slurm-nodes" in given:
        spec["slurm"] = {"nodes": _number("--slurm-nodes", given["--slurm-nodes"], int)}
        origins["slurm"] = "--slurm-nodes"
        return None, False
    hosts = [h.strip() for h in given.get("--hosts", "local").split(",")]
    for host in hosts:
        if not host:
            raise SpecError("--hosts", "an empty host name (H,H,...)", given["--hosts"],
                            has_value=True)
        if host != "local":
            try:
                split_host(host)
            except ValueError as exc:
                raise SpecError("--hosts", f"{host!r}: {exc}") from None
    spec["nodes"] = [{"host": h} for h in hosts]
    origins["nodes"] = "--hosts"
    return hosts, all(h == "local" for h in hosts)


def _size(given: dict[str, str], spec: dict[str, Any], origins: dict[str, str],
          hosts: list[str] | None, local: bool, cpus: int | None, notes: list[str]) -> None:
    if "--nnodes" in given:
        text = given["--nnodes"]
        try:
            low, high = _parse_nnodes(text.strip())
        except ValueError as exc:
            raise SpecError("--nnodes", str(exc), text, has_value=True) from None
        if low > high:
            raise SpecError("--nnodes", "MIN is larger than MAX", text, has_value=True)
        if hosts is not None and high > len(hosts):
            where = "this machine alone (without --hosts, --hostfile or --slurm-nodes)" \
                if "--hosts" not in given else f"the {len(hosts)} host(s) of --hosts"
            raise SpecError("--nnodes", f"{high} node(s), more than {where}; give every "
                            "node in --hosts (`local` twice rehearses two nodes here)")
        if "--standalone" in given and high > 1:
            raise SpecError("--standalone", f"is one node; --nnodes asks for {text}")
        spec["nnodes"] = f"{low}:{high}" if ":" in text else low
        origins["nnodes"] = "--nnodes"
    if "--nproc-per-node" not in given:
        return
    text = given["--nproc-per-node"].strip()
    origins["nproc_per_node"] = "--nproc-per-node"
    if text == "cpu":
        if not local or cpus is None:
            raise SpecError("--nproc-per-node", "cpu: the nodes' CPU counts are not known "
                            "before they are reached: give a number")
        spec["nproc_per_node"] = min(cpus, MAX_LOCAL)
    elif text in ("gpu", "auto"):
        spec["nproc_per_node"] = text
        if text == "auto":
            notes.append("--nproc-per-node auto: one worker per GPU, or 1 on a node without "
                         "one (torchrun would start one per CPU there)")
    elif re.fullmatch(r"[0-9]{1,9}", text):
        spec["nproc_per_node"] = int(text)
    else:
        raise SpecError("--nproc-per-node", "must be a number, gpu, auto or cpu (xpu and other "
                        "devices are not counted here: give a number)", text, has_value=True)


def _rendezvous(given: dict[str, str], spec: dict[str, Any], origins: dict[str, str],
                hosts: list[str] | None, local: bool, notes: list[str]) -> None:
    """Backend, master address and port: from --rdzv-endpoint, else --master-addr/-port
    (torchrun's precedence); --standalone ignores them all, as torchrun's does."""
    rdzv: dict[str, Any] = {}
    if "--standalone" in given:
        for flag in ("--rdzv-backend", "--rdzv-endpoint", "--master-addr", "--master-port"):
            if flag in given:
                notes.append(f"{flag} ignored with --standalone (as torchrun ignores it)")
        return
    backend = given.get("--rdzv-backend", "static").strip()
    if backend not in ("static", "c10d"):
        raise SpecError("--rdzv-backend", "must be static or c10d here: the orchestrator "
                        "hosts the rendezvous on the first node itself", backend,
                        has_value=True)
    if backend != "static":
        rdzv["backend"] = backend
    if "--rdzv-endpoint" in given:
        flag = "--rdzv-endpoint"
        for other in ("--master-addr", "--master-port"):
            if other in given:
                notes.append(f"{other} ignored: --rdzv-endpoint names the rendezvous (as "
                             "torchrun does)")
        addr, port = _endpoint(given[flag])
    else:
        flag = "--master-addr"
        addr = given.get("--master-addr", "").strip() or None
        port = _number("--master-port", given["--master-port"], int) \
            if "--master-port" in given else None
    if port:
        rdzv["port"] = port
        origins["rendezvous.port"] = flag if flag == "--rdzv-endpoint" else "--master-port"
    if addr and _LOOPBACK.match(addr) and not local:
        names = [_hostname(h) for h in hosts or ()]
        if not names or names[0] != "localhost":
            raise SpecError(flag, f"{addr} is this machine's loopback, which the other nodes "
                            "cannot reach: name the first node's address")
    elif addr and not _LOOPBACK.match(addr):
        if hosts is not None and addr in [_hostname(h) for h in hosts]:
            # The master is node 0: the host the user named as the rendezvous goes first.
            index = [_hostname(h) for h in hosts].index(addr)
            spec["nodes"].insert(0, spec["nodes"].pop(index))
        else:
            rdzv["master_addr"] = addr
            origins["rendezvous.master_addr"] = flag
    if rdzv:
        spec["rendezvous"] = rdzv
        origins.setdefault("rendezvous", "--rdzv-backend")


def _endpoint(text: str) -> tuple[str | None, int | None]:
    """torchrun's ``HOST[:PORT]`` (``[v6]:PORT``); port 0 or none: a free one."""
    text = text.strip()
    if not text:
        return None, None
    if "@" in text:
        raise SpecError("--rdzv-endpoint", "expects HOST[:PORT]", text, has_value=True)
    try:
        _, host, port = split_host(text)
    except ValueError as exc:
        if text.endswith(":0"):  # torchrun's "localhost:0": any free port
            return _endpoint(text[:-2])[0], None
        raise SpecError("--rdzv-endpoint", f"expects HOST[:PORT]: {exc}", text,
                        has_value=True) from None
    return host, port


def _hostname(host: str) -> str:
    return "localhost" if host == "local" else split_host(host)[1]


def _number(flag: str, text: str, convert: type[int] | type[float]) -> Any:
    try:
        return convert(text.strip())
    except ValueError:
        kind = "a whole number" if convert is int else "a number"
        raise SpecError(flag, f"must be {kind}", text, has_value=True) from None


def _command(given: dict[str, str], script: str, args: list[str], python: str,
             backend: str | None) -> list[str]:
    """The workers' argv, as torchrun builds it: ``python -u [-m] SCRIPT ARGS``, or
    ``SCRIPT ARGS`` with --no-python. Under c10d the orchestrator starts torchrun itself,
    which adds the ``-u``."""
    module, no_python = "--module" in given, "--no-python" in given
    if "--run-path" in given:
        module = no_python = False
    if module and no_python:
        raise SpecError("--module", "and --no-python cannot be used together (as in torchrun)")
    if no_python:
        return [script, *args]
    flags = [] if backend == "c10d" else ["-u"]
    return [python, *flags, *(["-m"] if module else []), script, *args]


def spec_yaml(request: RunRequest, path: str = "THIS_FILE") -> str:
    """The spec as commented YAML: what ``--save-spec`` writes (as ``path``), and what
    ``load`` checks."""
    spec = request.spec
    lines = ["# Written by `orchestrator run`; run it again with:",
             f"#   orchestrator submit {path} --follow" + "".join(
                 f" --env {item.partition('=')[0]}{'=...' if '=' in item else ''}"
                 for item in request.env) + "".join(f" --env-file {f}"
                                                    for f in request.env_files)]
    if request.env or request.env_files:
        lines.append("# (--env values are not written here: a file is easier to leak than "
                     "your environment)")
    lines += [f"# note: {note}" for note in request.notes]
    comments = {
        "nodes": "nodes ([user@]host[:port] over SSH; local: this machine); node 0 hosts "
                 "the master",
        "hostfile": "DeepSpeed/MPI hostfile (host slots=N), read at submit",
        "slurm": "nodes allocated by Slurm (partition, time, account, gres: see "
                 "docs/guides/slurm.md)",
        "command": "each worker's argv (a $ is written $$: placeholders such as ${rank} are "
                   "expanded, yours are kept)",
        "workdir": "the workers' directory, the same path on every node",
    }
    # Escaped, not raw, outside ASCII: a raw U+2028 or U+0085 would read back as a line break.
    text = yaml.safe_dump(spec, sort_keys=False, default_flow_style=None, allow_unicode=False,
                          width=100)
    for line in text.splitlines():
        key = line.partition(":")[0]
        if key in comments and not line.startswith((" ", "-")):
            lines.append(f"# {comments[key]}")
        lines.append(line)
    return "\n".join(lines) + "\n"


def load(request: RunRequest, env: dict[str, str] | None = None) -> JobSpec:
    """Validate the request's spec with ``submit``'s own code (the YAML of spec_yaml, with
    ``env`` added as ``submit --env`` adds it); a SpecError names the flag at fault."""
    try:
        spec = parse_jobspec(spec_yaml(request), base_dir=request.cwd, env=env)
    except SpecError as exc:
        raise _flag_error(exc, request) from None
    addr = spec.rendezvous.master_addr
    if addr and "hostfile" in request.spec:
        names = [node.hostname for node in spec.nodes]
        if addr in names[1:]:
            flag = request.origins.get("rendezvous.master_addr", "--master-addr")
            raise SpecError(flag, f"{addr} is host {names.index(addr) + 1} of the hostfile; "
                            "the first host is node 0 and hosts the master: list it first")
    return spec


def _flag_error(exc: SpecError, request: RunRequest) -> SpecError:
    """A spec's error, said of the flag that set the field."""
    path = exc.field
    if path.startswith("nodes[") and "nodes" in request.spec:
        index = int(path[6:path.index("]")])
        host = request.spec["nodes"][index]["host"]
        message = exc.message.replace("set rendezvous.master_addr", "give --master-addr")
        return SpecError("--hosts", f"{host}: {message}", exc.value,
                         has_value=exc.has_value)
    for prefix in sorted(request.origins, key=len, reverse=True):
        if path == prefix or path.startswith((prefix + ".", prefix + "[")):
            rest = path[len(prefix):].lstrip(".")
            return SpecError(request.origins[prefix], f"{rest}: {exc.message}" if rest
                             else exc.message, exc.value, has_value=exc.has_value)
    return exc


def save(request: RunRequest, path: str) -> Path:
    """Write the spec (spec_yaml) to ``path``, relative to the request's directory."""
    target = Path(request.cwd, os.path.expanduser(path))
    try:
        target.write_text(spec_yaml(request, path), encoding="utf-8")
    except OSError as exc:
        raise SpecError("--save-spec", f"cannot write {target}: {exc.strerror or exc}"
                        ) from None
    return target
