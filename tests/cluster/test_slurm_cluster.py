"""A real Slurm on the namespace cluster (``Cluster(n, slurm=True)``, ``cluster.py up --slurm``):
munged, slurmctld in the root namespace, one slurmd inside each namespace. Checks what a Slurm
transport will rely on: nodes idle, one task per namespace, an allocation whose nodes the
tools report, a step that overlaps it and carries stdin to stdout both ways, scancel, and a
``down`` that leaves no daemon, step or task of ours.

Outside CI a machine without slurm-wlm and munge skips these tests; in CI (CI=true) that fails
them. A Slurm that is installed but does not start is an error everywhere.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import _missing, _processes_mentioning, local_cluster

Cluster = Any  # local_cluster.Cluster: the module is loaded from a file, not importable


def _slurm_missing() -> str | None:
    """Why Slurm cannot be installed-and-run here (packages), or None."""
    need = [local_cluster.SLURMCTLD, local_cluster.SLURMD, local_cluster.MUNGED]
    missing = [p for p in need if not os.access(p, os.X_OK)]
    missing += [p for p in ("sinfo", "squeue", "srun", "salloc", "scancel", "scontrol")
                if shutil.which(p) is None]
    if missing:
        return f"needs slurm-wlm and munge (apt-get install -y slurm-wlm munge): no {missing}"
    return None


def _require_slurm() -> None:
    reason = _missing() or _slurm_missing()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Slurm cluster tests cannot run in CI: {reason}")
        pytest.skip(reason)


def slurm_env(c: Cluster) -> dict[str, str]:
    # No SLURM_* of an enclosing job (a test run under srun) may leak into our clients.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, **c.slurm_env}


def slurm(c: Cluster, *argv: str, timeout: float = 60, check: bool = True,
          input: str | None = None) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                         env=slurm_env(c), input=input,
                         stdin=None if input is not None else subprocess.DEVNULL)
    if check:
        assert run.returncode == 0, f"{argv}: {run.returncode} {run.stderr.strip()}"
    return run


def node_states(c: Cluster) -> dict[str, str]:
    out = slurm(c, "sinfo", "-h", "-N", "-o", "%N %T").stdout
    return dict(line.split() for line in out.splitlines())


def wait_for(predicate: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} (after {timeout} s)"
        time.sleep(0.2)


def daemon_pids(c: Cluster) -> dict[int, int | None]:
    """Every pid of ours that ``down`` must stop, with its start time: the daemons (by
    pidfile) and whatever runs in the namespaces (slurmstepd, tasks, sshd sessions)."""
    pidfiles = [c.dir / "slurm" / "slurmctld.pid", local_cluster.MUNGE_RUN / c.id / "munged.pid"]
    pidfiles += [c.dir / "slurm" / f"slurmd-{name}.pid" for name in c.slurm_nodes]
    pids = {int(p.read_text()) for p in pidfiles}
    for i in range(c.n):
        pids.update(c.netns_pids(i))
    return {pid: local_cluster._start_time(pid) for pid in pids}


def still_running(pids: dict[int, int | None]) -> list[str]:
    """Those of ``pids`` that are still the same live process (zombies waiting for init to
    reap them count as gone)."""
    left = []
    for pid, start in pids.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[19]) == start:
            left.append(f"{pid} ({stat.split('(', 1)[1].split(')')[0]})")
    return left


def assert_all_gone(c: Cluster, pids: dict[int, int | None]) -> None:
    wait_for(lambda: not still_running(pids), f"down left {still_running(pids)}", timeout=10)
    assert _processes_mentioning(str(c.dir)) == []
    assert not (local_cluster.MUNGE_RUN / c.id).exists()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [h.netns for h in c.hosts if h.netns in namespaces.split()]


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three namespace hosts forming one Slurm cluster; torn down (and checked to be gone)
    at the end of the module."""
    _require_slurm()
    local_cluster.cleanup_stale()
    c = local_cluster.Cluster(3, tmp_path_factory.mktemp("slurm"), slurm=True).up()
    pids: dict[int, int | None] = {}
    try:
        pids = daemon_pids(c)
        yield c
    finally:
        c.down()
    assert_all_gone(c, pids)


def test_sinfo_shows_every_namespace_as_an_idle_node(slurm_cluster):
    c = slurm_cluster
    assert node_states(c) == {h.name: "idle" for h in c.hosts}
    assert slurm(c, "sinfo", "-h", "-o", "%P %a %D").stdout.split() == ["debug*", "up", "3"]
    shown = slurm(c, "scontrol", "-o", "show", "node").stdout.splitlines()
    addrs = dict(re.search(r"NodeName=(\S+) .*NodeAddr=(\S+)", line).groups()  # type: ignore
                 for line in shown)
    assert addrs == {h.name: h.address for h in c.hosts}, "each node is its namespace address"
    # The cluster it belongs to is ours: slurmctld listens on the bridge's port we recorded.
    ping = slurm(c, "scontrol", "ping").stdout
    assert "UP" in ping, ping


def test_load_and_status_know_the_slurm_part(slurm_cluster, capsys):
    c = slurm_cluster
    again = local_cluster.Cluster.load(c.dir)
    assert again.slurm and again.slurm_conf == c.slurm_conf
    assert (again.slurmctld_port, again.slurmd_port) == (c.slurmctld_port, c.slurmd_port)
    assert again.slurm_env == {"SLURM_CONF": str(c.dir / "slurm.conf")}
    health = again.health()
    assert health["slurmctld"] and health["munged"]
    assert all(health[f"slurmd {name}"] for name in c.slurm_nodes), health
    assert again.alive()
    capsys.readouterr()
    assert local_cluster.main(["status", "--dir", str(c.dir)]) == 0
    out = capsys.readouterr().out
    assert f"export SLURM_CONF={c.slurm_conf}" in out.splitlines()
    assert "slurmctld: up" in out and "DOWN" not in out


def test_srun_runs_one_task_in_each_namespace(slurm_cluster):
    c = slurm_cluster
    script = ('printf "%s|%s|%s\\n" "$SLURMD_NODENAME" "$(ip netns identify $$)" '
              '"$(ip -4 -o addr show dev eth0)"')
    run = slurm(c, "srun", "-N3", "--ntasks-per-node=1", "sh", "-c", script)
    seen = {}
    for line in run.stdout.splitlines():
        node, netns, addr = line.split("|")
        seen[node] = (netns, re.search(r"inet (\S+)/24", addr).group(1))  # type: ignore
    assert seen == {h.name: (h.netns, h.address) for h in c.hosts}, run.stdout


def test_a_daemon_started_by_a_step_dies_with_it_as_in_production(slurm_cluster, tmp_path):
    """The test cluster tracks processes by cgroup, as production Slurm does: a step that
    ends takes every process it started along, even one that left its session (setsid) and
    its parent. What the orchestrator's holder step exists for (transport/slurm.py)."""
    c = slurm_cluster
    if c.proctrack != "cgroup":
        message = "no cgroup v1 freezer on this machine: the cluster runs proctrack/linuxproc"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    pidfile = tmp_path / "daemon.pid"
    script = (f'setsid sh -c "echo \\$\\$ > {pidfile}; exec sleep 300" '
              f'< /dev/null > /dev/null 2>&1 & while [ ! -s {pidfile} ]; do sleep 0.05; done')
    slurm(c, "srun", "-N1", "-w", c.hosts[0].name, "sh", "-c", script)
    pid = int(pidfile.read_text())
    wait_for(lambda: not Path(f"/proc/{pid}").exists()
             or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z",
             "the step's daemon outlived its step")


def read_line(stream: Any, timeout: float = 20) -> bytes:
    """One line from a pipe, or fail after ``timeout`` (a hung step must not hang the test)."""
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    line = b""
    deadline = time.monotonic() + timeout
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        assert left > 0 and sel.select(left), f"no full line in {timeout} s (got {line!r})"
        chunk = os.read(stream.fileno(), 1)
        assert chunk, f"EOF after {line!r}"
        line += chunk
    return line


def test_allocation_and_an_overlapping_step_as_an_agent_channel(slurm_cluster):
    c = slurm_cluster
    alloc = slurm(c, "salloc", "-N2", "--no-shell", "-J", "orc-agent-test")
    m = re.search(r"Granted job allocation (\d+)", alloc.stderr)
    assert m, alloc.stderr
    job = m.group(1)
    try:
        state, nnodes, nodelist = slurm(c, "squeue", "-h", "-j", job,
                                        "-o", "%T %D %N").stdout.split()
        assert (state, nnodes) == ("RUNNING", "2")
        nodes = slurm(c, "scontrol", "show", "hostnames", nodelist).stdout.split()
        assert len(nodes) == 2 and set(nodes) < set(c.slurm_nodes), nodes
        shown = slurm(c, "scontrol", "show", "job", job).stdout
        assert "JobState=RUNNING" in shown and f" NodeList={nodelist}\n" in shown, shown
        netns = {h.name: h.netns for h in c.hosts}

        # An agent channel: a step inside the allocation on one chosen node, talking both
        # ways line by line (each reply read before the next request is written).
        target = nodes[1]
        step = subprocess.Popen(
            ["srun", f"--jobid={job}", "--overlap", "-N1", "-n1", "-w", target,
             "sh", "-c", 'ip netns identify $$; exec cat'],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=slurm_env(c))
        assert step.stdin and step.stdout
        try:
            assert read_line(step.stdout).decode().strip() == netns[target]
            for i in range(3):
                request = json.dumps({"op": "ping", "seq": i}).encode() + b"\n"
                step.stdin.write(request)
                step.stdin.flush()
                assert read_line(step.stdout) == request
            step.stdin.close()  # EOF ends cat, and with it the step
            assert step.wait(timeout=30) == 0, step.stderr.read() if step.stderr else ""
        finally:
            if step.poll() is None:
                step.kill()
                step.wait()
        # Bulk: nothing lost or reordered through the step's stdin and stdout.
        payload = "".join(f"line {i} {'x' * 60}\n" for i in range(5000))
        bulk = slurm(c, "srun", f"--jobid={job}", "--overlap", "-N1", "-n1", "-w", nodes[0],
                     "cat", input=payload)
        assert bulk.stdout == payload

        slurm(c, "scancel", job)
        wait_for(lambda: slurm(c, "squeue", "-h", "-j", job, "-o", "%T", check=False)
                 .stdout.strip() in ("", "CANCELLED"), f"job {job} still listed after scancel")
        assert "JobState=CANCELLED" in slurm(c, "scontrol", "show", "job", job).stdout
        wait_for(lambda: node_states(c) == {h.name: "idle" for h in c.hosts},
                 "nodes not idle again after scancel")
    finally:
        slurm(c, "scancel", job, check=False)


def test_up_and_down_from_the_command_line_leave_nothing_running(tmp_path, capsys):
    """`up --slurm` prints the SLURM_CONF to export; `down` stops the daemons and what a job
    still runs on the nodes (slurmstepd and tasks of a step that never ended)."""
    _require_slurm()
    d = tmp_path / "cl"
    assert local_cluster.main(["up", "-n", "2", "--slurm", "--dir", str(d)]) == 0
    c = local_cluster.Cluster.load(d)
    step = None
    try:
        out = capsys.readouterr().out
        assert f"export SLURM_CONF={d / 'slurm.conf'}" in out.splitlines(), out
        alloc = slurm(c, "salloc", "-N2", "--no-shell")
        job = re.search(r"Granted job allocation (\d+)", alloc.stderr).group(1)  # type: ignore
        step = subprocess.Popen(["srun", f"--jobid={job}", "--overlap", "-N2", "sleep", "300"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=slurm_env(c))
        wait_for(lambda: len(slurm(c, "squeue", "-h", "-s", "-j", job, "-o", "%i")
                             .stdout.split()) >= 1, "the sleep step did not start")
        wait_for(lambda: all(any(b"sleep\x00300" in _cmdline(p) for p in c.netns_pids(i))
                             for i in range(c.n)), "sleep is not running on every node")
        pids = daemon_pids(c)
        # munged, slurmctld; on each node sshd, slurmd, the step's slurmstepd and sleep.
        assert len(pids) >= 2 + 2 * 4, pids
        assert sum(b"slurmstepd" in _cmdline(p) for p in pids) >= 2
    finally:
        assert local_cluster.main(["down", "--dir", str(d)]) == 0
        if step is not None:
            step.kill()  # our srun client in the root namespace, not the cluster's
            step.wait()
    assert_all_gone(c, pids)
    assert local_cluster.main(["status", "--dir", str(d)]) == 1


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_tampered_slurm_block_is_refused(tmp_path):
    d = tmp_path / "cl"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    net = "10.231.250"
    state = {"id": "beef", "prefix": "tmpr", "dir": str(d), "n": 1, "subnet": 250,
             "bridge": "tmprbeefbr", "bridge_address": f"{net}.1",
             "hosts": [{"name": "tmpr-beef-n0", "address": f"{net}.10", "ssh_port": 22,
                        "netns": "tmpr-beef-n0", "host_side_veth": "tmprbeefh0",
                        "alias": "node0"}],
             "slurm": {"slurmctld_port": 16819, "slurmd_port": 16818},
             "owner": None, "created": 0.0}
    local_cluster._write_file(d / "cluster.json", json.dumps(state), 0o600)
    assert local_cluster.Cluster.load(d).slurm_conf == d / "slurm.conf"
    for bad in ({"slurmctld_port": "16819; true", "slurmd_port": 16818},
                {"slurmctld_port": 16819, "slurmd_port": 16818, "extra": 1},
                {"slurmctld_port": 22, "slurmd_port": 16818}, "yes"):
        local_cluster._write_file(d / "cluster.json", json.dumps({**state, "slurm": bad}),
                                  0o600)
        with pytest.raises(local_cluster.ClusterError, match="not written by this script"):
            local_cluster.Cluster.load(d)


def test_a_slurm_that_cannot_start_fails_up_and_leaves_nothing(tmp_path, monkeypatch):
    """slurmctld refuses to run on a host its SlurmctldHost does not name: `up` says so (with
    the log line) without waiting out its timeout, and takes down what it had started."""
    _require_slurm()
    monkeypatch.setattr(local_cluster.socket, "gethostname", lambda: "not-this-host")
    c = local_cluster.Cluster(1, tmp_path / "cl", slurm=True)
    started = time.monotonic()
    with pytest.raises(local_cluster.ClusterError, match="not a valid controller"):
        c.up(slurm_timeout=60)
    assert time.monotonic() - started < 30
    assert _processes_mentioning(str(c.dir)) == []
    assert c.id and not (local_cluster.MUNGE_RUN / c.id).exists()
    assert not (local_cluster.REGISTRY / f"{c.id}.json").exists()


def test_cleanup_stale_stops_the_slurm_of_a_dead_owner(tmp_path):
    _require_slurm()
    dead = subprocess.Popen(["true"])
    dead.wait()
    c = local_cluster.Cluster(1, tmp_path / "cl", prefix="tslurm", slurm=True)
    try:
        c.up(owner=dead.pid)
        pids = daemon_pids(c)
        assert local_cluster.cleanup_stale("tslurm") == [c.id]
    finally:
        c.down()
    assert_all_gone(c, pids)


def test_another_local_user_can_run_nothing_and_see_nothing(slurm_cluster):
    """The cluster's Slurm is root's: another local user (nobody), with a copy of slurm.conf
    in hand and a munge credential of their own (munged serves every local user), may run
    no job on the namespace nodes and sees none of root's jobs or nodes."""
    import tempfile

    c = slurm_cluster
    shared = Path(tempfile.mkdtemp(prefix="for-nobody-"))  # pytest's tmp is root's alone
    shared.chmod(0o755)
    conf = shared / "slurm.conf"
    conf.write_text(c.slurm_conf.read_text())
    conf.chmod(0o644)
    as_nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": str(conf)}

    def nobody(*argv):
        return subprocess.run([*as_nobody, *argv], capture_output=True, text=True,
                              timeout=30, env=env)

    held = subprocess.Popen(["srun", "-N1", "-J", "roots-job", "sleep", "30"],
                            env=slurm_env(c), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: "roots-job" in slurm(c, "squeue", "-h", "-o", "%j").stdout,
                 "root's job running")
        for argv in (["srun", "-N1", "-t", "1", "/bin/true"],
                     ["sbatch", "-N1", "--wrap", "/bin/true"],
                     ["salloc", "-N1", "--no-shell", "-t", "1"]):
            run = nobody(*argv)
            assert run.returncode != 0 and "not permitted" in run.stderr, (argv, run.stderr)
        seen = nobody("squeue", "-h", "-o", "%j %u")
        assert seen.returncode == 0 and "roots-job" not in seen.stdout, seen.stdout
        nodes = nobody("sinfo", "-h", "-N", "-o", "%N")
        assert not any(h.name in nodes.stdout for h in c.hosts), nodes.stdout
        assert slurm(c, "srun", "-N1", "/bin/true").returncode == 0  # root still can
    finally:
        held.terminate()
        held.wait(timeout=30)
        shutil.rmtree(shared)
