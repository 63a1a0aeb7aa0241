"""Jobs on a real Slurm (the namespace cluster with ``slurm=True``): the controller requests an
allocation, reaches each node's agent through ``srun --overlap``, restarts inside the same
allocation, and gives it back at the end; a job submitted from inside an allocation uses it
and leaves it alone. Real torch gloo traffic crosses the namespaces.

Outside CI a machine without slurm-wlm and munge skips these tests; in CI they fail.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import orchestrator
from tests.helpers import (
    PYTHON,
    ROOT,
    WORKERS,
    assert_no_job_processes,
    wait_for,
    wait_for_output,
    write_spec,
)
from tests.integration.test_trust import (
    SECRET_NAMES,
    assert_secrets_arrived,
    secret_spec,
    submit_with_secrets,
)
from tests.worker_world import (
    SLURM_ALLOCATION_SHELL,
    SLURM_STEP_OF_ALLOCATION,
    differences,
    load_worlds,
)

from .conftest import local_cluster
from .test_slurm_cluster import _require_slurm, assert_all_gone, daemon_pids, slurm, slurm_env

Cluster = Any


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three namespace hosts forming one Slurm cluster, for this module."""
    _require_slurm()
    local_cluster.cleanup_stale()
    c = local_cluster.Cluster(3, tmp_path_factory.mktemp("slurmjobs"), slurm=True).up()
    pids: dict[int, int | None] = {}
    try:
        pids = daemon_pids(c)
        yield c
    finally:
        c.down()
    assert_all_gone(c, pids)


@pytest.fixture
def sl(slurm_cluster, home, monkeypatch) -> Cluster:
    """The cluster, with this process (and so submit and the controller) pointed at its
    Slurm, and no SLURM_* of an enclosing job."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in slurm_cluster.slurm_env.items():
        monkeypatch.setenv(key, value)
    return slurm_cluster


def slurm_spec(tmp_path, command, *, nodes=3, **extra):
    data = {
        "name": "slurm-test",
        "slurm": {"nodes": nodes, **extra.pop("slurm", {})},
        "python": PYTHON,  # the agent's interpreter on the nodes (shared filesystem)
        "nproc_per_node": 2,
        "command": command,
        "workdir": str(tmp_path),
        "stop_grace_period": 2,
        "launch_timeout": 30,
        **extra,
    }
    return write_spec(tmp_path, data)


def slurm_job_state(c: Cluster, job: str) -> str | None:
    run = slurm(c, "scontrol", "-o", "show", "job", job, check=False)
    m = re.search(r"(?:^|\s)JobState=(\S+)", run.stdout)
    return m.group(1) if m else None


def settled_state(c: Cluster, job: str) -> str | None:
    """The allocation's state once Slurm has finished ending it (COMPLETING lasts while the
    nodes kill what is left of its steps: KillWait under proctrack/cgroup)."""
    deadline = time.monotonic() + 30
    while (state := slurm_job_state(c, job)) == "COMPLETING" and time.monotonic() < deadline:
        time.sleep(0.2)
    return state


def our_allocations(c: Cluster) -> list[str]:
    """Allocations the orchestrator requested that Slurm still lists as pending or running."""
    out = slurm(c, "squeue", "-h", "-t", "PENDING,RUNNING", "-o", "%i %j").stdout
    return [line.split()[0] for line in out.splitlines() if "orchestrator-" in line]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "orchestrator", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)


def test_ddp_collectives_over_three_slurm_nodes(sl, tmp_path):
    spec = slurm_spec(tmp_path, [PYTHON, str(WORKERS / "collectives.py")])
    started = time.monotonic()
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=180)
    elapsed = time.monotonic() - started
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-20:])
    ok = [ln for ln in lines if "COLLECTIVES OK" in ln]
    assert len(ok) == 6 and all(ln.endswith("via eth0") for ln in ok), ok
    # Each node of the allocation ran its two ranks, labelled by its Slurm node name.
    names = sl.slurm_nodes
    assert sorted(re.match(r"\[([^:]+):(\d)\]", ln).groups() for ln in ok) == sorted(  # type: ignore[union-attr]
        (names[r // 2], str(r)) for r in range(6))
    info = result["slurm"]
    assert info["owned"] is True and info["nodes"] == names and info["released"] is True
    assert [n["host"] for n in result["nodes"]] == names
    # Given back before the job was recorded as ended.
    assert settled_state(sl, info["job_id"]) in ("CANCELLED", "COMPLETED")
    assert our_allocations(sl) == []
    status = cli("status", job_id)
    assert f"slurm job {info['job_id']} (requested by the orchestrator, released): " \
           f"{','.join(names)}" in status.stdout, status.stdout
    shown = json.loads(cli("status", job_id, "--json").stdout)["slurm"]
    assert shown["job_id"] == info["job_id"] and shown["nodes"] == names
    assert_no_job_processes(job_id)
    print(f"3-node x 2-rank Slurm job, submit to SUCCEEDED: {elapsed:.1f}s")


def test_orchestrator_run_with_slurm_nodes_trains_in_its_own_allocation(sl, tmp_path):
    """A torchrun line after `orchestrator run --slurm-nodes 2`: the allocation asked for,
    the ranks spread over it, given back at the end, and the run's exit code the job's."""
    run = subprocess.run(
        [PYTHON, "-m", "orchestrator", "run", "--slurm-nodes", "2", "--python", PYTHON,
         "--nnodes", "2", "--nproc-per-node", "2", str(WORKERS / "collectives.py")],
        capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    found = re.search(r"submitted (\S+)", run.stderr)
    assert found, run.stderr
    ok = [ln for ln in run.stdout.splitlines() if "COLLECTIVES OK" in ln]
    assert len(ok) == 4, run.stdout[-3000:]
    used = {re.match(r"\[([^:]+):", ln).group(1) for ln in ok}  # type: ignore[union-attr]
    assert len(used) == 2 and used <= set(sl.slurm_nodes), ok
    info = orchestrator.status(found.group(1))["slurm"]
    assert info["owned"] is True and info["released"] is True, info
    assert our_allocations(sl) == []
    assert_no_job_processes(found.group(1))


def test_a_crash_restarts_inside_the_same_allocation(sl, tmp_path):
    # Attempt 1: rank 3 exits 9; attempt 2 runs the collectives. Each rank says which Slurm
    # job it runs in (its agent is a step of that allocation).
    script = ('echo "rank $RANK attempt $ORCHESTRATOR_ATTEMPT slurm $SLURM_JOB_ID"; '
              f'if [ "$ORCHESTRATOR_ATTEMPT" = 1 ]; then exec {PYTHON} {WORKERS / "fail_rank.py"};'
              f' else exec {PYTHON} {WORKERS / "collectives.py"}; fi')
    spec = slurm_spec(tmp_path, ["sh", "-c", script], max_restarts=1,
                      env={"FAIL_RANK": "3", "FAIL_CODE": "9", "FAIL_AFTER": "1"},
                      restart_backoff={"initial": 0.5})
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=180)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-20:])
    assert result["restarts"] == 1 and len(result["attempts"]) == 2
    first = result["attempts"][0]["failure"]
    assert (first["rank"], first["exit_code"]) == (3, 9)
    seen = {}
    for ln in lines:
        m = re.search(r"rank (\d+) attempt (\d+) slurm (\d+)", ln)
        if m:
            seen[(int(m.group(1)), int(m.group(2)))] = m.group(3)
    assert sorted(seen) == [(r, a) for r in range(6) for a in (1, 2)], lines[:20]
    assert set(seen.values()) == {result["slurm"]["job_id"]}, seen
    assert sum("COLLECTIVES OK" in ln for ln in lines) == 6
    assert settled_state(sl, result["slurm"]["job_id"]) in ("CANCELLED", "COMPLETED")
    assert_no_job_processes(job_id)


def test_a_killed_controller_resumes_on_the_same_allocation(sl, tmp_path):
    script = 'for i in $(seq 1 40); do echo "step $RANK $i"; sleep 0.1; done'
    spec = slurm_spec(tmp_path, ["sh", "-c", script], nodes=2)
    job_id = orchestrator.submit(spec)
    wait_for_output(job_id, "step 0 5", 1)
    first = orchestrator.status(job_id)
    allocation = first["slurm"]["job_id"]
    os.kill(first["controller"]["pid"], signal.SIGKILL)  # the supervisor resumes it
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert result["controller"]["pid"] != first["controller"]["pid"]
    assert (result["attempt"], result["restarts"], result["free_restarts"]) == (1, 0, 0)
    assert result["slurm"]["job_id"] == allocation and result["slurm"]["released"] is True
    lines = list(orchestrator.logs(job_id))
    for rank in range(4):  # every line once, printed with or without a controller
        assert [ln.split()[-1] for ln in lines if f"step {rank} " in ln] == \
            [str(i) for i in range(1, 41)]
    assert settled_state(sl, allocation) in ("CANCELLED", "COMPLETED")
    assert our_allocations(sl) == []
    assert_no_job_processes(job_id)


def test_a_warm_restart_inside_the_allocation(sl, tmp_path):
    from tests.cluster.test_warm_restarts_ssh import (
        TRAIN,
        TRAIN_ENV,
        kill_a_rank_once_standbys_are_up,
    )
    job_id = orchestrator.submit(slurm_spec(
        tmp_path, [*TRAIN, str(tmp_path / "ckpt")], nodes=2, env=TRAIN_ENV, max_restarts=1,
        restart={"warm": True}, restart_backoff={"initial": 0.1}))
    kill_a_rank_once_standbys_are_up(job_id, 4)


def test_a_hot_spare_inside_the_allocation_takes_a_lost_nodes_place_warm(sl, tmp_path):
    from tests.cluster.test_warm_restarts_ssh import TRAIN, TRAIN_ENV, spare_takes_over

    job_id = orchestrator.submit(slurm_spec(
        tmp_path, [*TRAIN, str(tmp_path / "ckpt")], nodes=3, nnodes=2, env=TRAIN_ENV,
        max_restarts=1, restart={"warm": True}, restart_backoff={"initial": 0.1},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}))
    result = spare_takes_over(job_id)
    assert settled_state(sl, result["slurm"]["job_id"]) in ("CANCELLED", "COMPLETED")


def test_a_lost_nodes_checkpoints_come_back_from_its_buddy_inside_the_allocation(sl, tmp_path):
    """The SSH test's lost node (test_checkpoints_ssh.py) inside an allocation of three nodes,
    the script saving beside the training (``save(..., wait=False)``, BACKGROUND=1; over SSH
    and locally it waits): the copies its agent seals are the ones that reach the buddy."""
    from tests.cluster.test_checkpoints_ssh import TRAIN, TRAIN_ENV
    from tests.integration.test_checkpoints import lost_node_resumes_from_its_buddy
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(slurm_spec(
        tmp_path, TRAIN, nodes=3, nnodes=2,
        env={"OUT": str(out), **TRAIN_ENV, "BACKGROUND": "1"},
        max_restarts=1, restart={"warm": True}, restart_backoff={"initial": 0.1},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}))
    result = lost_node_resumes_from_its_buddy(job_id, out)
    assert settled_state(sl, result["slurm"]["job_id"]) in ("CANCELLED", "COMPLETED")


def test_a_dcp_job_that_lost_a_node_goes_on_with_fewer_ranks_resharded_on_slurm(sl, tmp_path):
    """The SSH test of resharding (test_checkpoints_ssh.py) inside an allocation of three
    nodes, nnodes 2:3: node 2's link goes down, the 4 ranks left reshard the newest step all
    6 persisted in a checkpoint.dir the nodes share, and the allocation is given back."""
    from tests.cluster.test_checkpoints_ssh import DCP_CHECKPOINT, DCP_ENV, lost_node_2_reshards
    from tests.integration.test_checkpoints import memory_dirs
    out = tmp_path / "out"
    out.mkdir()
    ck = tmp_path / "ck"
    job_id = orchestrator.submit(slurm_spec(
        tmp_path, [PYTHON, str(WORKERS / "dcp_train.py")], nodes=3, nnodes="2:3",
        max_restarts=1, restart_backoff={"initial": 0.1},
        health={"heartbeat_interval": 0.5, "node_timeout": 2},
        checkpoint={"dir": str(ck), **DCP_CHECKPOINT}, env={"OUT": str(out), **DCP_ENV}))
    result = lost_node_2_reshards(sl, job_id, out, ck)
    assert settled_state(sl, result["slurm"]["job_id"]) in ("CANCELLED", "COMPLETED")
    wait_for(lambda: memory_dirs(job_id) == [], 15, what="every node's checkpoint memory removed")


def test_a_dcp_job_that_lost_a_node_reshards_from_the_nodes_memory_on_slurm(sl, tmp_path):
    """The same inside an allocation of three nodes with no checkpoint.dir: the 4 ranks left
    reshard from the nodes' memory, and the allocation is given back."""
    from tests.cluster.test_checkpoints_ssh import DCP_ENV, lost_node_2_reshards_from_memory
    from tests.integration.test_checkpoints import memory_dirs
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(slurm_spec(
        tmp_path, [PYTHON, str(WORKERS / "dcp_train.py")], nodes=3, nnodes="2:3",
        max_restarts=1, restart_backoff={"initial": 0.1},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}, env={"OUT": str(out), **DCP_ENV}))
    result = lost_node_2_reshards_from_memory(sl, job_id, out)
    assert settled_state(sl, result["slurm"]["job_id"]) in ("CANCELLED", "COMPLETED")
    wait_for(lambda: memory_dirs(job_id) == [], 15, what="every node's checkpoint memory removed")


def test_a_drained_node_of_the_allocation_leaves_at_a_step_every_rank_saved(sl, tmp_path):
    """orchestrator drain inside a Slurm allocation (3 nodes, nnodes 2): every rank saves the
    agreed step, the spare of the allocation goes on from it, nothing redone, no restart
    charged, and the allocation is given back at the end."""
    from tests.integration.test_drain import drain_moves_to_the_spare, train_spec
    out = tmp_path / "out"
    out.mkdir()
    data = train_spec(tmp_path, [], out)
    job_id = orchestrator.submit(slurm_spec(
        tmp_path, data.pop("command"), nodes=3,
        **{k: v for k, v in data.items() if k not in ("nodes", "name", "workdir")},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}))
    result = drain_moves_to_the_spare(job_id, out, lambda job, node: orchestrator.drain_node(
        str(node), job=job, reason="maintenance"))
    assert settled_state(sl, result["slurm"]["job_id"]) in ("CANCELLED", "COMPLETED")


def test_a_sigterm_to_one_nodes_steps_is_a_notice_and_the_allocations_spare_goes_on(
        sl, tmp_path):
    """One node's part of the allocation ends: ``scancel --signal=TERM`` of its holder step
    (Slurm then ends the step, SIGTERM to its task now, SIGKILL to every process of it after
    KillWait, as when its slurmd shuts down). The holder tells its agent: a notice on that
    node alone. Every rank saves the agreed step, the allocation's spare goes on from it,
    nothing redone, no restart charged."""
    from tests.integration.test_drain import drain_moves_to_the_spare, train_spec
    out = tmp_path / "out"
    out.mkdir()
    data = train_spec(tmp_path, [], out, stop_grace_period=30)
    job_id = orchestrator.submit(slurm_spec(
        tmp_path, data.pop("command"), nodes=3,
        **{k: v for k, v in data.items() if k not in ("nodes", "name", "workdir")},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}))
    signalled: list[str] = []

    def sigterm_its_steps(job, node):
        shown = orchestrator.status(job)
        host = shown["nodes"][node]["host"]
        steps = slurm(sl, "squeue", "-h", "-s", "-j", str(shown["slurm"]["job_id"]),
                      "-o", "%i %j %N").stdout
        signalled.extend(i for i, name, on in (ln.split() for ln in steps.splitlines())
                         if on == host and name == "orchestrator-holder")
        assert len(signalled) == 1, steps
        # (It says "Invalid job id specified" of a step it signals and ends all the same.)
        slurm(sl, "scancel", "--signal=TERM", signalled[0], check=False)

    def noticed(node):
        return (node["notice"] or {}).get("source") == "SIGTERM to the agent"

    result = drain_moves_to_the_spare(job_id, out, sigterm_its_steps, shown=noticed)
    assert "SIGTERM to the agent" in result["attempts"][0]["failure"]["message"]
    assert settled_state(sl, result["slurm"]["job_id"]) in ("CANCELLED", "COMPLETED")


def test_cancel_releases_the_allocation(sl, tmp_path):
    spec = slurm_spec(tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], nodes=2)
    job_id = orchestrator.submit(spec)
    wait_for(lambda: orchestrator.status(job_id)["state"] == "RUNNING", 90, what="RUNNING")
    allocation = orchestrator.status(job_id)["slurm"]["job_id"]
    assert slurm_job_state(sl, allocation) == "RUNNING"
    result = orchestrator.cancel(job_id)
    assert result["state"] == "CANCELLED"
    assert settled_state(sl, allocation) == "CANCELLED"
    assert allocation not in our_allocations(sl)
    assert result["slurm"]["released"] is True
    assert_no_job_processes(job_id)


def test_a_job_inside_an_existing_allocation_leaves_it_alone(sl, tmp_path, monkeypatch):
    alloc = slurm(sl, "salloc", "-N3", "--no-shell", "-J", "users-own")
    m = re.search(r"Granted job allocation (\d+)", alloc.stderr)
    assert m, alloc.stderr
    own = m.group(1)
    try:
        monkeypatch.setenv("SLURM_JOB_ID", own)  # as in an sbatch script
        monkeypatch.setenv("SLURM_NTASKS", "3")  # ... and its other variables: ignored
        before = set(our_allocations(sl))
        spec = slurm_spec(tmp_path, [PYTHON, str(WORKERS / "collectives.py")],
                          slurm={"partition": "debug"})
        job_id = orchestrator.submit(spec)
        result = orchestrator.wait(job_id, timeout=180)
        lines = list(orchestrator.logs(job_id))
        assert result["state"] == "SUCCEEDED", (result["failure"], lines[-20:])
        assert sum("COLLECTIVES OK" in ln for ln in lines) == 6
        assert result["slurm"] == {"job_id": own, "nodes": sl.slurm_nodes, "owned": False,
                                   "released": False}
        assert set(our_allocations(sl)) == before == set()  # never asked for another
        time.sleep(1)
        assert slurm_job_state(sl, own) == "RUNNING"  # the user's allocation goes on
        status = cli("status", job_id)
        assert f"slurm job {own} (your own allocation)" in status.stdout, status.stdout
        assert_no_job_processes(job_id)
        # The agents ran in holder steps (one per node), and those end with the job.
        wait_for(lambda: not [name for name in slurm(sl, "squeue", "-h", "-s", "-j", own,
                                                     "-o", "%j").stdout.split()
                              if name.startswith("orchestrator-")],
                 timeout=30, what="the job's steps in the user's allocation to end")
    finally:
        slurm(sl, "scancel", own, check=False)


def test_a_partition_that_does_not_exist_is_named(sl, tmp_path):
    spec = slurm_spec(tmp_path, ["true"], slurm={"partition": "nosuch"})
    run = cli("submit", str(spec), "--wait")
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: slurm.partition: ") and "nosuch" in run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert orchestrator.list_jobs() == [] and our_allocations(sl) == []


def test_no_salloc_on_path_is_one_line(sl, tmp_path):
    spec = slurm_spec(tmp_path, ["true"])
    env = {**os.environ, "PATH": str(tmp_path)}  # no Slurm commands there
    run = cli("submit", str(spec), "--wait", env=env)
    assert run.returncode == 1, run.stderr
    assert run.stderr == "error: slurm: `salloc` is not on PATH (the job asks for Slurm: " \
                         "install its client commands, or load its module)\n"
    assert orchestrator.list_jobs() == []


def test_an_allocation_not_granted_in_time_is_cancelled(sl, tmp_path):
    # Four nodes of a three-node cluster: Slurm keeps the request pending.
    spec = slurm_spec(tmp_path, ["true"], nodes=4, launch_timeout=3)
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "FAILED" and result["failure"]["cause"] == "LAUNCH_FAILED"
    message = result["failure"]["message"]
    assert re.fullmatch(r"slurm: allocation \d+ not granted within launch_timeout \(3s\); "
                        r"the pending request was cancelled", message), message
    pending = result["slurm"]["job_id"]
    assert settled_state(sl, pending) == "CANCELLED"
    assert our_allocations(sl) == [] and result["attempts"] == []


def test_cancel_while_the_allocation_is_pending_withdraws_the_request(sl, tmp_path):
    spec = slurm_spec(tmp_path, ["true"], nodes=4, launch_timeout=120)
    job_id = orchestrator.submit(spec)
    pending = wait_for(lambda: (orchestrator.status(job_id)["slurm"] or {}).get("job_id"), 30,
                       what="the pending request recorded")
    assert slurm_job_state(sl, pending) == "PENDING"
    started = time.monotonic()
    result = orchestrator.cancel(job_id)
    assert result["state"] == "CANCELLED" and time.monotonic() - started < 10
    assert settled_state(sl, pending) == "CANCELLED"
    assert result["slurm"]["released"] is True and our_allocations(sl) == []


def test_a_slurm_workers_world_is_srun_torchruns(sl, tmp_path):
    """The step's world, as ``srun torchrun ...`` from the submitting shell gives it: that
    shell's environment and umask (srun passes them on), plus the step's SLURM_*."""
    workdir = tmp_path / "project"
    workdir.mkdir()
    reference_dir, ours_dir = tmp_path / "torchrun", tmp_path / "ours"
    reference_dir.mkdir()
    ours_dir.mkdir()
    world = str(WORKERS / "world.py")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "ORCHESTRATOR_AGENT"))
           and k not in ("PYTHONUNBUFFERED", "PYTHONSAFEPATH", "OMP_NUM_THREADS")}
    env.update(MY_SETTING="on", PWD=str(workdir))
    spec = slurm_spec(tmp_path, [PYTHON, world, str(ours_dir)], nodes=1, workdir=str(workdir))
    run = subprocess.run([PYTHON, "-m", "orchestrator", "submit", str(spec), "--wait"],
                         capture_output=True, text=True, timeout=180, cwd=workdir, env=env,
                         umask=0o027)
    assert run.returncode == 0, run.stderr
    job_id = run.stderr.split()[run.stderr.split().index("submitted") + 1]
    node = orchestrator.status(job_id)["slurm"]["nodes"][0]
    typed = subprocess.run(
        ["srun", "-N1", "-n1", "-w", node, f"--chdir={workdir}", PYTHON, "-m",
         "torch.distributed.run", "--standalone", "--nproc-per-node=2", world,
         str(reference_dir)], capture_output=True, text=True, timeout=180, cwd=workdir,
        env=env, umask=0o027)
    assert typed.returncode == 0, typed.stderr[-2000:]
    reference, ours = load_worlds(reference_dir), load_worlds(ours_dir)
    assert sorted(ours) == sorted(reference) == [0, 1]
    slurm_values = frozenset(k for k in reference[0]["env"] if k.startswith("SLURM_"))
    for rank in (0, 1):
        problems = differences(reference[rank], ours[rank], also_differ=slurm_values,
                               may_lack=SLURM_ALLOCATION_SHELL,
                               may_add=SLURM_STEP_OF_ALLOCATION)
        assert problems == [], "\n".join(problems)
    assert ours[0]["umask"] == 0o027 and ours[0]["env"]["MY_SETTING"] == "on"
    assert ours[0]["env"]["SLURMD_NODENAME"] == node
    assert_no_job_processes(job_id)


def test_a_two_file_script_and_a_per_node_launcher_on_slurm(sl, tmp_path):
    import shutil

    shutil.copytree(ROOT / "tests" / "projects" / "twofile", tmp_path / "proj")
    spec = slurm_spec(tmp_path, [PYTHON, "train.py"], nodes=2, workdir=str(tmp_path / "proj"))
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=180)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-10:])
    assert sorted(ln.split("] ", 1)[1] for ln in lines if "two-file" in ln) == [
        f"two-file rank {r}/4 sum 60" for r in range(4)]
    assert_no_job_processes(job_id)
    command = [PYTHON, str(ROOT / "examples" / "per_node_spawn.py"),
               "--master_addr", "${master_addr}", "--master_port", "${master_port}",
               "--world_size", "${world_size}", "--start_rank", "${node_start_rank}",
               "--num_gpus", "${nproc_per_node}"]
    job_id = orchestrator.submit(slurm_spec(tmp_path, command, launch="per-node"))
    result = orchestrator.wait(job_id, timeout=180)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-10:])
    found = {int(m.group(2)): (m.group(1), m.group(3)) for ln in lines
             if (m := re.match(r"\[([^:]+):node\d\] per-node rank (\d)/6 local \d "
                               r"final weights (\w+)", ln))}
    assert {r: n for r, (n, _) in found.items()} == {
        r: sl.slurm_nodes[r // 2] for r in range(6)}, lines[-10:]
    assert len({d for _, d in found.values()}) == 1
    assert_no_job_processes(job_id)


def test_no_secret_reaches_a_command_line_on_slurm(sl, tmp_path):
    """The spec's env, --env KEY, --env-file and a secret in a setup line, through salloc
    and srun: no command line on this machine or on the nodes holds any of them."""
    values = {n: f"{n.lower()}-{secrets.token_hex(8)}" for n in SECRET_NAMES}
    data = yaml.safe_load(secret_spec(tmp_path, values).read_text())
    path = slurm_spec(tmp_path, data["command"], nodes=2, nproc_per_node=1, env=data["env"],
                      setup=data["setup"])
    job_id = submit_with_secrets(tmp_path, path, values)
    assert_secrets_arrived(job_id, values, ranks=2)
    assert_no_job_processes(job_id)


def test_a_bug_is_not_restarted_twice_on_slurm_and_the_webhook_hears_it_once(sl, tmp_path):
    from tests.integration.test_notify import Receiver

    receiver = Receiver()
    try:
        (tmp_path / "helpers.py").write_text("VALUE = 1\n")
        (tmp_path / "train.py").write_text("import helpers\n\nimport mymodel  # not there\n")
        job_id = orchestrator.submit(slurm_spec(
            tmp_path, [PYTHON, "train.py"], nodes=2, max_restarts=5,
            restart_backoff={"initial": 0.5}, notify=[{"url": receiver.url}]))
        result = orchestrator.wait(job_id, timeout=180)
        assert result["state"] == "FAILED" and len(result["attempts"]) == 2
        first = result["attempts"][0]["failure"]
        assert first["failure_class"] == "user"
        assert first["signature"] == "ModuleNotFoundError at train.py:3"
        assert "not restarted: the same error twice (ModuleNotFoundError at train.py:3)" in \
            result["failure"]["message"]
        wait_for(lambda: "failed" in receiver.events(job_id), 30, what="the failed event")
        assert sorted(receiver.events(job_id)) == ["failed", "restarted"]
        assert settled_state(sl, result["slurm"]["job_id"]) in ("CANCELLED", "COMPLETED")
        assert_no_job_processes(job_id)
    finally:
        receiver.close()


def test_a_node_failing_its_health_check_is_left_out_on_slurm(sl, tmp_path):
    """Inside a 3-node allocation, the node whose check fails is left out of a 2:3 job, and
    `orchestrator nodes` shows it under its Slurm name."""
    victim = sl.hosts[1]
    check = [PYTHON, "-c", "import sys\nif " + repr(victim.address) + " in open('/proc/net/"
             "fib_trie').read():\n    print('GPU 3: uncorrectable ECC errors')\n"
             "    sys.exit(7)\n"]
    job_id = orchestrator.submit(slurm_spec(
        tmp_path, [PYTHON, "-c", "print('trained')"], nodes=3, nnodes="2:3", nproc_per_node=1,
        health={"node_check": check, "node_check_timeout": 20}))
    result = orchestrator.wait(job_id, timeout=180)
    assert result["state"] == "SUCCEEDED", result["failure"]
    (left_out,) = [n for n in result["nodes"] if n["error"]]
    assert left_out["host"] == victim.name, result["nodes"]
    assert left_out["error"] == "unhealthy: health.node_check failed (exit code 7)"
    assert len(result["ranks"]) == 2
    assert left_out["node_index"] not in {r["node_index"] for r in result["ranks"]}
    (host,) = orchestrator.nodes()
    assert host["host"] == victim.name and host["events"][0]["kind"] == "CHECK_FAILED"
    assert victim.name in cli("nodes").stdout
    assert settled_state(sl, result["slurm"]["job_id"]) in ("CANCELLED", "COMPLETED")
    assert_no_job_processes(job_id)


def test_a_node_killed_twice_is_quarantined_and_slurm_allocates_around_it(sl, tmp_path):
    """A worker SIGKILLed from outside (as the OOM killer would) on the same Slurm node in two
    attempts: the node is quarantined, the job's next attempt runs without it, and the next
    job's allocation excludes it."""
    victim = sl.hosts[0].name  # the node Slurm would give first

    def attempt_running(attempt, ranks):
        def check():
            s = orchestrator.status(job_id)
            return s if (s["state"] == "RUNNING" and s["attempt"] == attempt
                         and len(s["ranks"]) == ranks
                         and all(r["state"] == "RUNNING" and r["pid"] for r in s["ranks"])) \
                else None
        return wait_for(check, 90, what=f"attempt {attempt} running {ranks} ranks")

    job_id = orchestrator.submit(slurm_spec(
        tmp_path, [PYTHON, str(WORKERS / "sleeper.py")], nodes=3, nnodes="2:3",
        nproc_per_node=1, max_restarts=0, restart_policy={"max_infra_restarts": 3},
        restart_backoff={"initial": 0.2}))
    try:
        for attempt in (1, 2):
            status = attempt_running(attempt, 3)
            (rank,) = [r for r in status["ranks"] if r["host"] == victim]
            os.kill(rank["pid"], signal.SIGKILL)
        status = attempt_running(3, 2)
        assert victim not in {r["host"] for r in status["ranks"]}, status["ranks"]
        (held,) = [h for h in orchestrator.nodes() if h["quarantined"]]
        assert held["host"] == victim and held["events_24h"] == 2, held
        for attempt in status["attempts"][:2]:
            assert attempt["failure"]["failure_class"] == "infrastructure", attempt["failure"]
    finally:
        orchestrator.cancel(job_id)
    assert orchestrator.wait(job_id, timeout=60)["state"] == "CANCELLED"
    assert_no_job_processes(job_id)

    (tmp_path / "next").mkdir()
    job_id = orchestrator.submit(slurm_spec(
        tmp_path / "next", [PYTHON, "-c", "print('trained')"], nodes=2, nproc_per_node=1))
    result = orchestrator.wait(job_id, timeout=180)
    assert result["state"] == "SUCCEEDED", result["failure"]
    hosts = {r["host"] for r in result["ranks"]}
    assert len(hosts) == 2 and victim not in hosts, hosts
    log = (Path(os.environ["ORCHESTRATOR_HOME"]) / "jobs" / job_id / "controller.log").read_text()
    assert f"slurm: asking for nodes other than the quarantined {victim}" in log, log
    assert settled_state(sl, result["slurm"]["job_id"]) in ("CANCELLED", "COMPLETED")


def test_an_exception_of_the_controller_costs_nothing_on_slurm(sl, tmp_path, monkeypatch):
    from tests.integration.test_endurance import STEPS, check_an_exception_costs_nothing

    monkeypatch.setenv("ORCHESTRATOR_FAILPOINTS", "turn@2x1")
    check_an_exception_costs_nothing(slurm_spec(tmp_path, STEPS, nodes=2, nproc_per_node=1,
                                                env={"STEPS": "150", "STEP_SLEEP": "0.05"}),
                                     2, 150)


def test_a_full_disk_pauses_a_job_on_slurm(sl, tmp_path, monkeypatch):
    from tests.integration.test_endurance import STEPS, check_a_full_disk_pauses, small_disk

    with small_disk(tmp_path / "smallhome", "48m") as home:
        monkeypatch.setenv("ORCHESTRATOR_HOME", str(home))
        check_a_full_disk_pauses(slurm_spec(tmp_path, STEPS, nodes=2, nproc_per_node=1,
                                            logs={"min_free_bytes": 1 << 20},
                                            env={"STEPS": "600", "STEP_SLEEP": "0.05"}),
                                 home, 2, 600)


def _escaping(tmp_path, **extra):
    directory = tmp_path / "escapees"
    directory.mkdir()
    env = {"ESCAPE_DIR": str(directory), **extra.pop("env", {})}
    from tests.integration.test_containment import ESCAPER
    return orchestrator.submit(slurm_spec(tmp_path, ESCAPER, nodes=2, env=env,
                                          stop_grace_period=1, **extra)), directory


def test_cancel_leaves_no_descendant_on_any_slurm_node(sl, tmp_path):
    from tests.integration.test_containment import cancel_leaves_nothing
    cancel_leaves_nothing(*_escaping(tmp_path, max_restarts=0), 4)


def test_a_failure_leaves_no_descendant_on_any_slurm_node(sl, tmp_path):
    from tests.integration.test_containment import failure_leaves_nothing
    failure_leaves_nothing(*_escaping(tmp_path, max_restarts=0, env={"EXIT_AFTER": "3"}), 4)


def test_a_slurm_nodes_agent_and_watchdog_sigkilled_leave_no_descendant(sl, tmp_path):
    from tests.integration.test_containment import killed_agent_and_watchdog_leave_nothing
    job_id, directory = _escaping(tmp_path, max_restarts=1, restart_backoff={"initial": 0.1})
    wait_for(lambda: orchestrator.status(job_id)["state"] == "RUNNING", 90, what="RUNNING")
    killed_agent_and_watchdog_leave_nothing(job_id, directory, 4)


def test_a_preempted_allocation_stops_preempted_and_resume_goes_on_from_the_saved_step(
        sl, tmp_path):
    """Slurm preempts the job's whole allocation (a job of a partition of a higher priority
    tier needs one of its nodes; GraceTime 30): each step's task gets SIGTERM, the node's
    holder, which tells its agent. The job stops PREEMPTED at a step every rank saved and
    persisted, and ``resume`` asks for a new allocation and trains from exactly that step.
    (Fails on the old code: the holder died of the SIGTERM, and its step took the agent and
    the workers along.)"""
    from tests.integration.test_drain import preempted_and_resumed, whole_job_spec
    out = tmp_path / "out"
    out.mkdir()
    data = whole_job_spec(tmp_path, out, steps=400)  # long enough for Slurm to preempt it
    job_id = orchestrator.submit(slurm_spec(
        tmp_path, data.pop("command"), nodes=2,
        **{k: v for k, v in data.items() if k not in ("nodes", "name", "workdir")},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}))
    hosts = ",".join(h.name for h in sl.hosts)
    preemptor: list[subprocess.Popen] = []
    preempted: list[str] = []

    def preempt(job):
        allocation = orchestrator.status(job)["slurm"]
        preempted.append(allocation["job_id"])
        slurm(sl, "scontrol", "update", "PartitionName=debug", "GraceTime=30")
        slurm(sl, "scontrol", "create", "PartitionName=urgent", f"Nodes={hosts}",
              "PriorityTier=2", "State=UP", "AllowGroups=root")
        preemptor.append(subprocess.Popen(
            ["srun", "-p", "urgent", "-N1", "-w", allocation["nodes"][0], "--exclusive",
             "sleep", "5"], env=slurm_env(sl), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True))
    try:
        result = preempted_and_resumed(job_id, out, tmp_path, preempt, steps=400)
        first = preempted[0]
        # Given back as soon as the job stopped (within the grace), or ended by Slurm.
        assert settled_state(sl, first) in ("CANCELLED", "PREEMPTED")
        assert result["slurm"]["job_id"] != first  # resume asked for a new allocation
        assert settled_state(sl, result["slurm"]["job_id"]) in ("CANCELLED", "COMPLETED")
    finally:
        for p in preemptor:
            p.wait(timeout=120)
        slurm(sl, "scontrol", "delete", "PartitionName=urgent", check=False)
        slurm(sl, "scontrol", "update", "PartitionName=debug", "GraceTime=0", check=False)


def test_a_time_limit_warning_stops_the_job_preempted_and_resume_goes_on(sl, tmp_path):
    """``--signal=USR1@100`` (Slurm's default signal, Lightning's recipe): once the allocation
    is within 100 s of its time limit (shortened by the test), Slurm signals each step's
    task, the holders, which tell their agents: a notice on every node, so the job stops
    PREEMPTED at a step every rank saved and persisted; ``resume`` trains in a new
    allocation (the spec's 10 minutes: no warning) from exactly that step. (Fails on the old
    code: SIGUSR1 killed the holder, and its step took the agent and the workers along.)"""
    from tests.integration.test_drain import preempted_and_resumed, whole_job_spec
    out = tmp_path / "out"
    out.mkdir()
    data = whole_job_spec(tmp_path, out, steps=600)  # 60 s: Slurm looks every 30 s
    job_id = orchestrator.submit(slurm_spec(
        tmp_path, data.pop("command"), nodes=2,
        slurm={"time": "10", "extra": ["--signal=USR1@100"]},
        **{k: v for k, v in data.items() if k not in ("nodes", "name", "workdir")},
        health={"heartbeat_interval": 0.5, "node_timeout": 2}))
    warned: list[str] = []

    def near_the_time_limit(job):
        allocation = orchestrator.status(job)["slurm"]["job_id"]
        warned.append(allocation)
        slurm(sl, "scontrol", "update", f"JobId={allocation}", "TimeLimit=2")

    result = preempted_and_resumed(job_id, out, tmp_path, near_the_time_limit, steps=600)
    assert result["slurm"]["job_id"] != warned[0]  # resume asked for a new allocation
    assert settled_state(sl, warned[0]) in ("CANCELLED", "COMPLETED", "TIMEOUT")
