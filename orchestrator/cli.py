"""The ``orchestrator`` command: parse, call the API, print. Exit codes (docs/reference/cli.md):

    0 succeeded   1 failed (or an operational error)   2 bad spec or usage   3 cancelled
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import typer

import orchestrator as api
from orchestrator import envargs, render, runargs, starters
from orchestrator.errors import JobEndedError, JobNotFoundError, OrchestratorError, SpecError
from orchestrator.plan import describe
from orchestrator.render import render_watch, visible

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Run PyTorch distributed jobs on many nodes: submit, watch, restart, cancel.",
)
EXIT_FOR_STATE = {"SUCCEEDED": 0, "FAILED": 1, "CANCELLED": 3, "PREEMPTED": 4}
_debug = False
T = TypeVar("T")


@app.callback()
def _options(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
) -> None:
    global _debug
    _debug = debug


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _call(fn: Callable[[], T]) -> T:
    """Run an API call, mapping our errors to one line and an exit code."""
    try:
        return fn()
    except SpecError as exc:
        if _debug:
            raise
        *others, last = exc.problems  # every problem of the spec at once, a line each
        for problem in others:
            typer.echo(f"error: {problem}{problem.where}", err=True)
        _fail(f"{last}{last.where}", 2)
    except (JobNotFoundError, JobEndedError) as exc:
        if _debug:
            raise
        _fail(str(exc), 2)
    except OrchestratorError as exc:
        if _debug:
            raise
        _fail(str(exc), 1)


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


@app.command()
def submit(
    spec: str = typer.Argument(..., help="Path to the job spec (YAML)."),
    wait: bool = typer.Option(False, "--wait", help="Block until the job ends; exit with it."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Stream logs, then exit with it."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the launch plan; start nothing."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    env: list[str] | None = typer.Option(
        None, "--env", help="KEY (its value from this environment) or KEY=VALUE added to env "
                            "(repeatable; a secret's value is refused here)."),
    env_file: list[str] | None = typer.Option(
        None, "--env-file", help="File of KEY=VALUE lines added to env (repeatable)."),
    set_: list[str] | None = typer.Option(None, "--set",
                                          help="field.path=value override (repeatable)."),
) -> None:
    """Validate SPEC and start the job; print its id."""
    sets = list(set_ or [])
    extra_env, written = _call(lambda: envargs.parse(env or [], env_file or [], os.environ))
    _call(lambda: envargs.refuse_webhook_sets(sets))
    loaded = _call(lambda: api.load_jobspec(spec, env=extra_env, overrides=sets))
    _warn(loaded, written, sets, env_file or [])
    if dry_run:
        plan = _call(lambda: api.dry_run(spec, env=extra_env, overrides=sets))
        if as_json:
            _print_json(plan.to_dict())
        else:
            typer.echo(describe(plan))
        return
    job_id = _call(lambda: api.submit(spec, env=extra_env, overrides=sets, fork=True))
    if not (wait or follow):
        if as_json:
            _print_json({"job_id": job_id})
        else:
            typer.echo(job_id)
        return
    _until_end(job_id, follow=follow, as_json=as_json, syncing=loaded.sync is not None)


def _warn(loaded: api.JobSpec, written: set[str], sets: list[str], env_files: list[str]
          ) -> None:
    """Refuse a secret written on the command line; warn of what works but is unwise."""
    _call(lambda: envargs.refuse_written_secrets(loaded, written, sets))
    for path in env_files:
        if not envargs.file_is_private(path):
            typer.echo(f"warning: {path} is readable by other users (chmod 600 it)", err=True)
    for warning in loaded.warnings:
        typer.echo(f"warning: {warning}", err=True)


def _until_end(job_id: str, *, follow: bool, as_json: bool, syncing: bool) -> NoReturn:
    """``submit --wait/--follow`` once the job is submitted: Ctrl-C cancels it; exit with
    its outcome (docs/reference/cli.md)."""
    if not as_json:
        typer.echo(f"submitted {job_id}", err=True)
    _cancel_on_signals(job_id)
    if syncing and sys.stderr.isatty() and not as_json:
        _show_sync_progress(job_id)
    if follow:
        show = visible if sys.stdout.isatty() else str
        for line in _call(lambda: _prime(api.logs(job_id, follow=True))):
            typer.echo(show(line))
    result = _call(lambda: api.wait(job_id))
    if as_json:
        _print_json(result)
    else:
        typer.echo(visible(render.summary_line(result)), err=True)
    raise typer.Exit(EXIT_FOR_STATE.get(result["state"], 1))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "allow_interspersed_args": False, "help_option_names": []})
def run(ctx: typer.Context) -> None:
    """Run a torchrun command line as a job, and follow it (as submit --follow).

    orchestrator run [--hosts H,H | --hostfile F | --slurm-nodes N] [torchrun options]
    SCRIPT [ARGS...]; `orchestrator run --help` lists the options."""
    # Raw arguments: click must not parse the script's (everything after it is the script's).
    cwd = os.getcwd()
    request = _call(lambda: runargs.spec_from_torchrun_args(
        ctx.args, cwd=cwd, executable=sys.executable, environ=os.environ,
        cpus=len(os.sched_getaffinity(0))))
    if request.help:
        typer.echo(runargs.USAGE)
        return
    for note in request.notes:
        typer.echo(f"note: {note}", err=True)
    extra_env, written = _call(lambda: envargs.parse(list(request.env),
                                                     list(request.env_files), os.environ))
    loaded = _call(lambda: runargs.load(request, extra_env))
    _warn(loaded, written, [], list(request.env_files))
    if request.save_spec is not None:
        saved = _call(lambda: runargs.save(request, request.save_spec or ""))
        typer.echo(f"spec written to {saved}: orchestrator submit {request.save_spec} "
                   "--follow", err=True)
    if request.dry_run:
        typer.echo(describe(_call(lambda: api.dry_run(loaded, spec_dir=cwd))))
        return
    job_id = _call(lambda: api.submit(loaded, spec_dir=cwd, fork=True))
    _until_end(job_id, follow=True, as_json=False, syncing=False)


@app.command()
def init(
    file: str = typer.Argument("job.yaml", help="Where to write the spec."),
    ssh: bool = typer.Option(False, "--ssh", help="Machines over SSH."),
    slurm: bool = typer.Option(False, "--slurm", help="A Slurm cluster."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file."),
) -> None:
    """Write a commented starter spec that validates (this machine, --ssh or --slurm)."""
    if ssh and slurm:
        _fail("--ssh or --slurm, not both", 2)
    kind = "ssh" if ssh else "slurm" if slurm else "local"
    path = _call(lambda: starters.write(kind, file, force))
    typer.echo(f"wrote {path}: edit the lines marked EDIT, then `orchestrator "
               f"{'check' if ssh else 'submit'} {file}`", err=True)


def _show_sync_progress(job_id: str) -> None:
    """One bar per SSH node while the controller ships the synced tree (bytes and files),
    read from the job's status; gone once every node has its tree, or the job moved on."""
    import time

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    with Progress(TextColumn("sync {task.description}"), BarColumn(), DownloadColumn(),
                  TextColumn("{task.fields[files]}"), console=Console(stderr=True),
                  transient=True) as bars:
        tasks: dict[int, Any] = {}
        while True:
            data = api.status(job_id)
            syncs = {n["node_index"]: (n["host"], n["sync"]) for n in data["nodes"]
                     if n.get("sync")}
            for index, (host, info) in syncs.items():
                files = f"{info['blobs_sent']} file(s) sent of {info['files']}"
                if index not in tasks:
                    tasks[index] = bars.add_task(visible(host), total=info["to_send"] or 1,
                                                 files=files)
                bars.update(tasks[index], completed=info["bytes_sent"] if info["to_send"]
                            else 1, files=files)
            remote = [n for n in data["nodes"] if "@" in n["host"] or n["host"] != "local"]
            done = syncs and all(info["done"] for _, info in syncs.values()) and \
                len(syncs) >= len(remote)
            if done or data["state"] not in ("PENDING", "LAUNCHING"):
                return
            time.sleep(0.2)


def _watch(job_id: str) -> None:
    """``status --watch``: the view, redrawn twice a second until the job ends."""
    import time

    from rich.live import Live

    with Live(console=render.console(), refresh_per_second=2, screen=False) as live:
        while True:
            data = _call(lambda: api.status(job_id))
            tail = list(_call(lambda: api.logs(job_id, tail=8)))
            live.update(render_watch(data, tail))
            if data["state"] in EXIT_FOR_STATE:
                return
            time.sleep(0.5)


def _cancel_on_signals(job_id: str) -> None:
    """Ctrl-C or SIGTERM on a waiting submit stops the job, as it would a foreground run."""

    def handler(signum: int, _frame: Any) -> None:
        typer.echo(f"\nsignal {signal.Signals(signum).name}: cancelling {job_id}", err=True)
        threading.Thread(target=api.cancel, args=(job_id,), daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


@app.command()
def status(
    job: str | None = typer.Argument(None, help="Job id (default: the newest job)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    watch: bool = typer.Option(False, "--watch", "-w", help="A live view, until the job ends."),
) -> None:
    """Show a job's state, nodes, ranks, attempts and failure."""
    if job is None:
        jobs = _call(api.list_jobs)
        if not jobs:
            _fail("no jobs yet", 2)
        job = jobs[-1]["job_id"]
    if watch:
        _watch(job)
        return
    data = _call(lambda: api.status(job))
    if as_json:
        _print_json(data)
        return
    render.print_status(data)


@app.command()
def logs(
    job: str = typer.Argument(..., help="Job id."),
    rank: int | None = typer.Option(None, "--rank", help="Only this global rank."),
    node: int | None = typer.Option(None, "--node", help="Only this node rank."),
    attempt: int | None = typer.Option(None, "--attempt", help="Only this attempt (default: all)."),
    tail: int | None = typer.Option(None, "--tail", help="Only the last N lines."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
) -> None:
    """Print a job's output, each line prefixed with its host and rank."""
    lines = _call(lambda: api.logs(job, rank=rank, node=node, attempt=attempt, tail=tail,
                                   follow=follow))
    show = visible if sys.stdout.isatty() else str  # piped: the bytes as the worker wrote them
    try:
        for line in _call(lambda: _prime(lines)):
            typer.echo(show(line))
    except BrokenPipeError:
        sys.stderr.close()


def _prime(lines: Iterator[str]) -> Iterator[str]:
    # A generator's errors (no such job) surface at its first step: take that step in _call.
    first = next(lines, None)
    return iter(()) if first is None else itertools.chain([first], lines)


@app.command()
def cancel(job: str = typer.Argument(..., help="Job id.")) -> None:
    """Stop every worker of a job; its state becomes CANCELLED."""
    data = _call(lambda: api.cancel(job))
    typer.echo(f"{data['job_id']}: {data['state']}")


@app.command()
def drain(
    target: str = typer.Argument(None, help="A host (as a spec names it, or as `nodes` lists "
                                 "it); with --job, also a node index of that job. None: list "
                                 "the drains."),
    job: str = typer.Option(None, "--job", help="Only this job (default: every job)."),
    reason: str = typer.Option("", "--reason", help="Said in status and the job's failure."),
    within: str = typer.Option("120", "--within", help="How long the ranks have to save the "
                               "agreed step (e.g. 90, 5m)."),
    every: bool = typer.Option(False, "--all", help="Every node (of --job, or of every job): "
                               "a job stops PREEMPTED at a saved step, until `resume`."),
) -> None:
    """Move running jobs off a node at a step every rank saves (a spare takes its place, no
    restart charged), and start no work there until `undrain`."""
    named = _every(target, every)
    if named is None:
        for d in _call(api.drains):
            typer.echo(f"{d['target']}  {d['job_id'] or 'every job'}  since {d['since']}  "
                       f"{d['reason']}")
        return
    data = _call(lambda: api.drain_node(named, job=job, reason=reason,
                                        within=_seconds(within, "--within")))
    typer.echo(f"drained {data['target']}" + (f" for {job}" if job else ""))


@app.command()
def undrain(
    target: str | None = typer.Argument(None, help="What `drain` was given."),
    job: str = typer.Option(None, "--job", help="What `drain` was given."),
    every: bool = typer.Option(False, "--all", help="What `drain --all` was given."),
) -> None:
    """End a drain: the node takes work again."""
    named = _every(target, every)
    if named is None:
        _fail("undrain: name a host, or --all", 2)
    if _call(lambda: api.undrain_node(named, job=job)):
        typer.echo(f"undrained {named}")
    else:
        _fail(f"{named} is not drained" + (f" for {job}" if job else ""), 1)


def _every(target: str | None, every: bool) -> str | None:
    """``drain``'s target, ``*`` for --all (every node)."""
    if every and target is not None:
        _fail("drain: a host or --all, not both", 2)
    return "*" if every else target


@app.command()
def resume(
    job: str = typer.Argument(..., help="Job id."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Start a new controller for a job whose controller died; the job goes on."""
    data = _call(lambda: api.resume(job))
    if as_json:
        _print_json(data)
    elif data["resumed"]:
        typer.echo(f"{job}: resumed by a new controller")
    else:
        c = data["controller"]
        where = "not visible from here" if c["alive"] is None else "alive"
        typer.echo(f"{job}: already has a controller (pid {c['pid']} on {c['host']}, {where})")


@app.command()
def stacks(
    job: str = typer.Argument(..., help="Job id."),
    rank: int | None = typer.Option(None, "--rank", help="Only this global rank."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Print every running rank's Python stack, and where the ranks are, grouped."""
    data = _call(lambda: api.stacks(job, rank=rank))
    if as_json:
        _print_json(data)
        return
    for r in sorted(data["stacks"], key=int):
        entry = data["stacks"][r]
        typer.echo(f"== rank {r} on {visible(entry.get('host'))} ({entry.get('method')}) ==")
        typer.echo(visible(entry.get("text") or entry.get("error") or "").rstrip("\n"))
    if data["diagnosis"]:
        typer.echo(f"where: {visible(data['diagnosis'])}")


@app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """List jobs, oldest first."""
    jobs = _call(api.list_jobs)
    if as_json:
        _print_json(jobs)
        return
    render.print_jobs(jobs)


nodes_app = typer.Typer(help="Hosts across jobs: infrastructure failures and quarantine.",
                        invoke_without_command=True, no_args_is_help=False)
app.add_typer(nodes_app, name="nodes")


@nodes_app.callback()
def nodes(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """List hosts with recent infrastructure failures and their quarantine."""
    if ctx.invoked_subcommand is not None:
        return
    hosts = _call(api.nodes)
    if as_json:
        _print_json(hosts)
        return
    render.print_hosts(hosts)


@nodes_app.command("release")
def nodes_release(host: str = typer.Argument(..., help="The host, as `nodes` lists it.")) -> None:
    """End HOST's quarantine now."""
    if _call(lambda: api.release_node(host)):
        typer.echo(f"released {host}")
    else:
        _fail(f"{host} is not quarantined", 1)


@nodes_app.command("policy")
def nodes_policy(
    after: int = typer.Option(None, "--after", help="Infrastructure failures that quarantine "
                              "a host (0: never)."),
    window: str = typer.Option(None, "--window", help="...within this long (30m, 1h, 3600)."),
    cooldown: str = typer.Option(None, "--cooldown", help="The first quarantine's length; "
                                 "doubled for each one before it."),
    max_cooldown: str = typer.Option(None, "--max-cooldown", help="The longest quarantine."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Show the quarantine's thresholds (this home's, for every job), or change them."""
    changes: dict[str, Any] = {} if after is None else {"after": after}
    for name, text in (("window", window), ("cooldown", cooldown),
                       ("max_cooldown", max_cooldown)):
        if text is not None:
            changes[name] = _seconds(text, f"--{name.replace('_', '-')}")
    rules = _call(lambda: api.quarantine_policy(**changes))
    if as_json:
        _print_json(rules)
        return
    typer.echo(f"quarantine a host after {rules['after']} infrastructure failure(s) within "
               f"{_span(rules['window'])}, for {_span(rules['cooldown'])} (doubled each time, "
               f"at most {_span(rules['max_cooldown'])})" if rules["after"] else
               "hosts are never quarantined")


@app.command()
def prune(
    older_than: str = typer.Option(None, "--older-than", help="Remove jobs that ended longer "
                                   "ago than this (30d, 12h, 3600); default: the retention."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would go."),
    keep: str = typer.Option(None, "--retention", help="Set this home's retention first "
                             "(30d, never): submit prunes with it."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Remove ended jobs' records and logs (running jobs are never removed)."""
    if keep is not None:
        days = None if keep == "never" else _seconds(keep, "--retention")
        _call(lambda: api.retention_policy(keep=days))
    seconds = None if older_than is None else _seconds(older_than, "--older-than")
    gone = _call(lambda: api.prune(older_than=seconds, dry_run=dry_run))
    if as_json:
        _print_json(gone)
        return
    kept = _call(api.retention_policy)
    typer.echo(f"retention: ended jobs are kept {_span(kept) if kept else 'for ever'}")
    verb = "would remove" if dry_run else "removed"
    typer.echo(f"{verb} {len(gone)} job(s)" + "".join(
        f"\n  {j['job_id']}  {j['state']}  ended {j['ended_at']}" for j in gone))


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _seconds(text: str, option: str) -> float:
    """"90", "30m", "1h", "1d" as seconds."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS else (text, "s")
    try:
        return float(number) * _UNITS[unit]
    except ValueError:
        _fail(f"{option}: not a length of time: {text!r} (e.g. 90, 30m, 1h, 1d)", 2)


def _span(seconds: float) -> str:
    for unit in ("d", "h", "m"):
        if seconds >= _UNITS[unit] and seconds % _UNITS[unit] == 0:
            return f"{seconds / _UNITS[unit]:g}{unit}"
    return f"{seconds:g}s"


@app.command()
def check(
    spec: str = typer.Argument(..., help="Path to the job spec (YAML)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Validate SPEC and reach every node: auth, host key, versions, GPUs, route to master."""
    for warning in _call(lambda: api.load_jobspec(spec)).warnings:
        typer.echo(f"warning: {warning}", err=True)
    report = _call(lambda: api.check(spec))
    if as_json:
        _print_json(report)
    else:
        render.print_check(report)
    raise typer.Exit(0 if report["ok"] else 1)


@app.command()
def ui(
    port: int = typer.Option(8265, "--port", min=0, max=65535, help="Port to serve on."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default: loopback)."),
    certfile: str | None = typer.Option(None, "--certfile", help="Serve HTTPS: certificate."),
    keyfile: str | None = typer.Option(None, "--keyfile", help="Serve HTTPS: its private key."),
) -> None:
    """Serve the read-only web dashboard and Prometheus /metrics until interrupted; every
    request needs the token in the URL it prints, or $ORCHESTRATOR_UI_TOKEN (not printed)."""
    from orchestrator.ui import serve

    try:
        serve(host, port, certfile=certfile, keyfile=keyfile,
              announce=lambda text: typer.echo(text, err=True))
    except ValueError as exc:
        _fail(f"ui: {exc}", 2)
    except OSError as exc:
        _fail(f"ui: cannot serve on {host}:{port}: {exc.strerror or exc}", 1)


def main() -> None:
    """Console-script entry point. It leaves without the interpreter's teardown (tens of
    milliseconds with pydantic, paramiko and sqlite loaded, after the answer is known):
    what it wrote is flushed first, and no thread of it must finish."""
    code = 0
    try:
        app()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 1  # stdout closed early (a pipe to head): as Python would say
    os._exit(code)
