"""How the ``orchestrator`` command shows things: the ``status`` view, the ``status --watch``
view, the tables of ``list``, ``nodes`` and ``check``, and the one-line summaries (a job's
end, its time lost, its stragglers).

It owns the text users read; the data is the API's JSON-ready dicts (the documented
``--json`` shapes), handed in by ``cli.py``, which fetches them: nothing here calls the API
or reads the store. Every text that comes from a job, an agent or a node is shown literally
(control characters as ``\\xNN``, no rich markup). May call rich, typer's ``echo`` and
``orchestrator.state``; imported by ``cli.py`` only.
"""

from __future__ import annotations

import re
from typing import Any

import typer

from orchestrator.state import JobState

# C0 and C1 control characters but tab and newline: ESC sequences from a worker (or a
# hostile node) must not reach the terminal.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_ENDED = frozenset(s.value for s in JobState if s.is_at_rest())


def visible(text: Any) -> str:
    """Text from workers, agents or nodes, with control characters shown as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def cell(text: Any) -> Any:
    """A table cell that rich shows literally: no markup, no control characters."""
    from rich.text import Text

    return Text(visible(text))


def console() -> Any:
    """A rich console on stdout; piped, 200 columns wide."""
    from rich.console import Console

    out = Console()
    # Piped output (scripts, CI logs) must not be cut at 80 columns.
    return out if out.is_terminal else Console(width=200)


def _age(iso: str | None, now: float) -> str:
    if not iso:
        return "-"
    from datetime import datetime

    try:
        seconds = max(0.0, now - datetime.fromisoformat(iso).timestamp())
    except ValueError:  # "invalid time ..." (orchestrator/jobview.py)
        return iso
    return f"{seconds:.0f}s ago"


def render_watch(data: dict[str, Any], tail: list[str], now: float | None = None) -> Any:
    """The live view of one job, as one rich renderable: state, attempt and restarts; per
    node its state and when it was last heard; per rank its state, step, steps/s and last
    output; the last log lines. Every text from the job is shown literally."""
    import time

    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = time.time() if now is None else now
    head = Text(f"{data['job_id']}  {data['state']}  attempt {data['attempt']}  restarts "
                f"{data['restarts']}/{data['max_restarts']}", style="bold")
    nodes = Table("NODE", "HOST", "STATE", "LAST HEARD", box=None, title="nodes",
                  title_justify="left")
    for n in data["nodes"]:
        nodes.add_row(*map(cell, ("-" if n["node_rank"] is None else n["node_rank"], n["host"],
                                  n["state"], _age(n.get("last_heard"), now))))
    ranks = Table("RANK", "HOST", "STATE", "STEP", "STEPS/S", "WAITING", "LAST OUTPUT",
                  box=None, title="ranks", title_justify="left")
    for r in data["ranks"]:
        rate, share = r.get("steps_per_s"), r.get("wait_share")
        ranks.add_row(*map(cell, (r["rank"], r["host"], r["state"],
                                  "-" if r.get("step") is None else r["step"],
                                  "-" if rate is None else f"{rate:.2f}",
                                  ("-" if share is None else f"{share:.0%}")
                                  + (" STRAGGLER" if r.get("straggler") else ""),
                                  _age(r.get("last_output"), now))))
    parts: list[Any] = [head]
    done = progress_line(data.get("progress"))
    if done:
        parts.append(cell(done))
    parts += [nodes, ranks]
    if data.get("stragglers"):
        parts.append(Text(stragglers_line(data), style="bold yellow"))
    parts.append(Text("last lines", style="bold"))
    parts += [cell(line) for line in tail]
    if data.get("failure"):
        parts.append(cell(summary_line(data)))
    return Group(*parts)


def span(seconds: float) -> str:
    """``45s``, ``31m 10s``, ``5h 02m``, ``3d 04h``: a duration as a person reads it."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def progress_line(p: dict[str, Any] | None) -> str | None:
    """``progress: step 4,200 of 10,000 (42.0%), 3.1 steps/s, ETA 31m 10s (at ...), 4% of the
    time lost to faults so far counted in``: see orchestrator/progress.py."""
    if not p:
        return None
    step = "no step yet" if p["step"] is None else f"step {p['step']:,}"
    if p["total_steps"] is None:
        line = f"progress: {step} (total unknown: heartbeat(total_steps=...) or the spec's " \
               "total_steps gives percent and ETA)"
    else:
        line = f"progress: {step} of {p['total_steps']:,}"
        if p["percent"] is not None:
            line += f" ({p['percent']:.1f}%)"
    if p["steps_per_s"] is not None:
        line += f", {p['steps_per_s']:.3g} steps/s"
    if p["eta_s"] is not None:
        line += f", ETA {span(p['eta_s'])} (at {p['eta_at']})"
        if p.get("lost_share"):
            line += f", counting the {p['lost_share']:.0%} of the time lost to faults so far"
    elif p["total_steps"] is not None and p["remaining_steps"] and p["steps_per_s"] is None:
        line += ", ETA once steps/s is known"
    return line


def time_lost_line(lost: dict[str, Any]) -> str:
    """``time lost: 7.1 s (28 GPU-s) in 2 incidents (training again 0.3-0.4 s after each
    fault, 15 steps redone); goodput 0.93``: see orchestrator/timelost.py."""
    found = lost["incidents"]
    unknown = lost.get("unknown") or 0
    known = len(found) - unknown
    again = [i["recovered_s"] for i in found if i.get("recovered_s") is not None]
    redone = sum(i.get("steps_redone") or 0 for i in found)
    parts = []
    if known:
        parts.append(f"time lost: {lost['seconds']:g} s ({lost['gpu_seconds']:g} GPU-s) in "
                     f"{known} incident{'s' * (known != 1)}")
    if again:
        span = f"{min(again):.1f}" + (f"-{max(again):.1f}" if max(again) > min(again) else "")
        parts.append(f" (training again {span} s after each fault, {redone} steps redone)")
    if unknown:
        # Unknown is not zero: without steps, only the restart's own time is known.
        parts.append(("; unknown for " if known else "time lost: unknown for ") +
                     f"{unknown}{' more' if known else ''} incident{'s' * (unknown != 1)} "
                     f"(no steps reported by heartbeat(step=...): restarted "
                     f"{lost.get('unknown_downtime_s') or 0:g} s after the fault"
                     f"{'s' * (unknown != 1)}, steps redone unknown)")
    if lost.get("goodput") is not None:
        parts.append(f"; goodput {lost['goodput']:.2f}")
    return "".join(parts)


def stragglers_line(data: dict[str, Any]) -> str:
    """``stragglers: rank 2 (n1) while the others wait 83% of the time in collectives``."""
    hosts = {r["rank"]: r["host"] for r in data["ranks"]}
    waits = [r["wait_share"] for r in data["ranks"]
             if r.get("wait_share") is not None and not r.get("straggler")]
    others = f" while the others wait {sorted(waits)[len(waits) // 2]:.0%} of the time in " \
        "collectives" if waits else ""
    return "stragglers: " + ", ".join(
        f"rank {r} ({hosts.get(r)})" for r in data["stragglers"]) + others


def summary_line(data: dict[str, Any]) -> str:
    """``job: STATE``, and for a failed job its cause, message, last stderr lines and where
    the flight recorder's dumps are; for a PREEMPTED one, the step it stopped at."""
    line = f"{data['job_id']}: {data['state']}"
    failure = data.get("failure")
    if failure and data["state"] == "PREEMPTED":  # which step, and how to go on
        return f"{line}: {failure.get('message')}"
    if failure and data["state"] == "FAILED":
        line += f" ({failure.get('cause')}): {failure.get('message')}"
        tail = failure.get("stderr_tail") or []
        if tail:
            line += "\nlast stderr lines:\n" + "\n".join(f"  {t}" for t in tail)
        recorder = failure.get("flight_recorder") or {}
        if recorder.get("ranks"):
            line += (f"\nflight recorder dumps of {len(recorder['ranks'])} ranks in "
                     f"{recorder['dir']} (python -m torch.distributed.flight_recorder.fr_trace "
                     "DIR reads NCCL dumps)")
        for rank, where in (recorder.get("left_on_nodes") or {}).items():
            line += f"\nflight recorder dump of rank {rank} left at {where}"
        for rank, why in (recorder.get("refused") or {}).items():
            line += f"\nflight recorder dump of rank {rank} refused by its node, {why}"
    return line


def grace(seconds: float | None) -> str:
    """``controller_grace`` as shown: ``30s``, or ``forever``."""
    return "forever" if seconds is None else f"{seconds:g}s"


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def print_status(data: dict[str, Any]) -> None:
    """``status``: the job's line, its controller, pause, Slurm allocation, nodes with their
    ranks, the attempts, time lost, stragglers and the failure."""
    from rich.table import Table

    out = console()
    free = f" (+{data['free_restarts']} not charged)" if data.get("free_restarts") else ""
    if data.get("infra_restarts"):
        free += f" (+{data['infra_restarts']} infrastructure)"
    typer.echo(f"{data['job_id']}  {data['state']}  attempt {data['attempt']}  "
               f"restarts {data['restarts']}/{data['max_restarts']}{free}  "
               f"submitted {data['submitted_at']}")
    done = progress_line(data.get("progress"))
    if done:
        typer.echo(done)
    c = data["controller"]
    alive = {True: "alive", False: "NOT RUNNING", None: "not visible from here"}[c["alive"]]
    if data["state"] not in _ENDED:
        typer.echo(f"controller pid {c['pid']} on {c['host']} since {c['since']}: {alive}; "
                   f"agents keep the workers {grace(data['controller_grace'])} without one")
    if data.get("paused"):
        p = data["paused"]
        typer.echo(visible(f"paused since {p['since']}: cannot write {p['reason']}; the "
                           "workers go on, their output waits on their nodes until there "
                           "is room"), err=True)
    if c.get("failing"):
        f = c["failing"]
        until = f"until {f['until']}" if f.get("until") else "for as long as the agents wait"
        typer.echo(visible(
            f"the controller keeps failing ({f['deaths']} deaths since {f['since']}; the "
            f"last: {f['error']}; traceback in {f['traceback']}): the workers go on "
            f"{until}, then the job ends CONTROLLER_FAILED; `orchestrator resume "
            f"{data['job_id']}` tries again, `orchestrator cancel {data['job_id']}` stops "
            "them"), err=True)
    if data.get("slurm"):
        s = data["slurm"]
        whose = "requested by the orchestrator" if s["owned"] else "your own allocation"
        if s["owned"] and s["released"]:
            whose += ", released"
        typer.echo(f"slurm job {s['job_id']} ({whose}): "
                   f"{','.join(s['nodes']) or 'waiting for nodes'}")
    if data["state"] == "UNKNOWN":
        typer.echo(f"the controller is gone (recorded state {data['recorded_state']}); run "
                   f"`orchestrator resume {data['job_id']}` to carry on", err=True)
    ranks_by_node: dict[int, list[dict[str, Any]]] = {}
    for r in data["ranks"]:
        ranks_by_node.setdefault(r["node_index"], []).append(r)
    # A column only where a node holds a checkpoint: a job that never saves has no use for it.
    held = any(c.get("memory_bytes") or c.get("newest_persisted") is not None
               for n in data["nodes"] if (c := n.get("checkpoint")))
    nodes = Table("NODE", "HOST", "STATE", "RANKS (exit)", *(["CHECKPOINTS"] if held else []),
                  box=None)
    for n in data["nodes"]:
        ranks = ", ".join(
            f"{r['rank']}:{r['state'].lower()}"
            + (f"({r['exit_code'] if r['exit_code'] is not None else r['signal']})"
               if r["exit_code"] is not None or r["signal"] else "")
            + (f"@{r['step']}" if r.get("step") is not None else "")
            for r in ranks_by_node.get(n["node_index"], [])
        )
        node_rank = "-" if n["node_rank"] is None else str(n["node_rank"])
        state = n["state"] + (f" ({n['error']})" if n.get("error") else "") + \
            (" (spare)" if n.get("spare") else "")
        if n.get("drained"):
            state += f" (drained: {n['drained']['reason'] or 'no reason given'})"
        if n.get("notice"):
            state += f" (notice: {n['notice']['source']}, stops by {n['notice']['deadline']})"
        gaps = (n.get("entered") or {}).get("UNREACHABLE", 0)
        if gaps:
            state += f" [unreachable {gaps}x]"
        nodes.add_row(*map(cell, (node_rank, n["host"], state, ranks,
                                  *([_held(n.get("checkpoint"))] if held else []))))
    out.print(nodes)
    if len(data["attempts"]) > 1 or any(a["failure"] for a in data["attempts"]):
        warm = any(a.get("warm_starts") for a in data["attempts"])
        resumed = any(a.get("restored_step") is not None for a in data["attempts"])
        history = Table("ATTEMPT", "STARTED", "ENDED", "OUTCOME", *(["WARM"] if warm else []),
                        *(["FROM STEP"] if resumed else []), "CLASS", "CAUSE", box=None)
        for a in data["attempts"]:
            f = a["failure"] or {}
            cause = f.get("message", "") + (f"; {f['decision']}" if f.get("decision") else "")
            history.add_row(*map(cell, (a["attempt"], a["started_at"] or "",
                                        a["ended_at"] or "", a["outcome"],
                                        *([a.get("warm_starts") or 0] if warm else []),
                                        *([_or_dash(a.get("restored_step"))] if resumed
                                          else []),
                                        f.get("failure_class") or "", cause)))
        out.print(history)
    if (data.get("time_lost") or {}).get("incidents"):
        out.print(visible(time_lost_line(data["time_lost"])), highlight=False, markup=False)
    if data.get("stragglers"):
        out.print(visible(stragglers_line(data)), highlight=False, markup=False)
    if data["failure"]:
        out.print(visible(summary_line(data)), highlight=False, markup=False)


def _held(c: dict[str, Any] | None) -> str:
    """A node's checkpoint store: memory in use, newest step in memory, persisted, what its
    newest save held the training, and where this attempt's ranks restored from."""
    if not c:
        return "-"
    text = f"{c.get('memory_bytes', 0) / (1 << 20):.0f} MiB"
    if c.get("newest_in_memory") is not None:
        text += f", step {c['newest_in_memory']}"
    if c.get("newest_persisted") is not None:
        text += f" (persisted {c['newest_persisted']})"
    replicas = c.get("replicas") or {}
    if replicas.get("ranks"):
        text += f"; replicas of {replicas['ranks']} ranks, step {replicas['newest']}"
    if c.get("newest_elsewhere") is not None:
        text += f"; on other nodes: step {c['newest_elsewhere']}"
    last = c.get("last_save")
    if last:
        text += f"; saves {last['bytes'] / (1 << 20):.0f} MiB, held {last['block_s']:.3f} s"
    loads = list((c.get("restored") or {}).values())
    if loads:
        sources = sorted({r["source"] for r in loads})
        text += f"; restored {'/'.join(sources)} in {max(r['seconds'] for r in loads):.1f} s"
        if any(r["skipped"] for r in loads):
            text += f", {sum(r['skipped'] for r in loads)} bad copies skipped"
    return text


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def print_jobs(jobs: list[dict[str, Any]]) -> None:
    """``list``: one row a job."""
    from rich.table import Table

    table = Table("JOB", "NAME", "STATE", "ATTEMPT", "RESTARTS", "SUBMITTED", box=None)
    for j in jobs:
        table.add_row(*map(cell, (j["job_id"], j["name"], j["state"], j["attempt"],
                                  j["restarts"], j["submitted_at"])))
    console().print(table)


def print_hosts(hosts: list[dict[str, Any]]) -> None:
    """``nodes``: one row a host, its quarantine and its last infrastructure failure."""
    if not hosts:
        typer.echo("no host has had an infrastructure failure in the last 7 days")
        return
    from rich.table import Table

    table = Table("HOST", "HEALTH", "FAILURES (24H)", "LAST EVENT", box=None)
    for h in hosts:
        health = (f"QUARANTINED until {h['until']} (#{h['level']})" if h["quarantined"]
                  else "ok")
        last = h["events"][-1] if h["events"] else None
        shown = f"{last['at']} {last['kind']} in {last['job_id']}: {last['detail']}" \
            if last else ""
        table.add_row(*map(cell, (h["host"], health, h["events_24h"], shown)))
    console().print(table)


def print_check(report: dict[str, Any]) -> None:
    """``check``: one row a node, then the master, the network check's summary, the
    controller's grace, and the warnings (on stderr)."""
    from rich.table import Table

    table = Table("NODE", "HOST", "REACH", "AUTH", "HOST KEY", "PYTHON", "TORCH", "GPUS",
                  "IFACE", "MASTER PORT", "ERROR", box=None)
    for n in report["nodes"]:
        table.add_row(*map(cell, (
            n["node_index"], n["host"], _yes(n["reachable"]), _yes(n["auth"]),
            n["host_key"], n["python"] or "-", n["torch"] or "-",
            "-" if n["gpus"] is None else n["gpus"], n["interface"] or "-",
            _yes(n["master_port_reachable"]), n["error"] or "")))
    console().print(table)
    for n in report["nodes"]:
        if n.get("containment"):
            typer.echo(f"node {n['node_index']} ({visible(n['host'])}) contains its workers' "
                       f"processes by: {visible(n['containment'])}")
    typer.echo(f"master {report['master_addr']}:{report['master_port'] or '-'}")
    if report["network"]:
        typer.echo(report["network"])
    typer.echo(f"controller_grace {grace(report['controller_grace'])}: how long agents "
               "keep the workers running with no controller attached")
    for warning in report["warnings"]:
        typer.echo(f"warning: {visible(warning)}", err=True)
