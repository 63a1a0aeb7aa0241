"""The pure parts: launch plans and the job state machine."""

from __future__ import annotations

import pytest

from orchestrator.plan import describe, plan_attempt
from orchestrator.spec import parse_jobspec
from orchestrator.state import TRANSITIONS, InvalidTransition, JobState, check_transition
from tests.helpers import wait_for

SPEC = """
name: demo
nodes: [{host: n0.example}, {host: n1.example, address: 10.0.0.2}, {host: n2.example}]
nproc_per_node: 2
nnodes: "2:3"
command: [python, train.py, --lr, "0.1"]
env: {NCCL_DEBUG: WARN}
max_restarts: 4
"""


def test_static_plan_assigns_ranks_and_master():
    spec = parse_jobspec(SPEC)
    plan = plan_attempt(spec, "demo-abc123", attempt=3, restart_count=2, master_port=29555)
    assert plan.master_addr == "n0.example" and plan.world_size == 6
    ranks = [(n.node_rank, w.rank, w.local_rank) for n in plan.nodes for w in n.workers]
    assert ranks == [(0, 0, 0), (0, 1, 1), (1, 2, 0), (1, 3, 1), (2, 4, 0), (2, 5, 1)]
    env = plan.nodes[1].env
    assert env["GROUP_RANK"] == "1" and env["WORLD_SIZE"] == "6"
    assert env["MASTER_PORT"] == "29555" and env["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "4" and env["ORCHESTRATOR_ATTEMPT"] == "3"
    assert env["NCCL_DEBUG"] == "WARN"
    assert "OMP_NUM_THREADS" not in env  # the agent defaults it to 1, unless the node set it
    assert plan.nodes[1].workers[1].env == {"RANK": "3", "LOCAL_RANK": "1", "ROLE_RANK": "3"}


def test_plan_on_surviving_nodes_recomputes_ranks():
    spec = parse_jobspec(SPEC)
    plan = plan_attempt(spec, "demo-abc123", master_port=1, node_indices=[1, 2])
    assert plan.master_addr == "10.0.0.2"  # the address node 1 is reached at
    assert [(n.node_index, n.node_rank) for n in plan.nodes] == [(1, 0), (2, 1)]
    assert plan.world_size == 4 and plan.nodes[0].env["GROUP_WORLD_SIZE"] == "2"


def test_local_nodes_use_loopback_and_absolute_workdir():
    spec = parse_jobspec("nodes: [{host: local}, {host: local}]\ncommand: [x]\nworkdir: sub\n")
    plan = plan_attempt(spec, "job-1", spec_dir="/data/specs")
    assert plan.master_addr == "127.0.0.1"
    assert {n.workdir for n in plan.nodes} == {"/data/specs/sub"}
    assert plan.master_port is None and plan.nodes[0].env["MASTER_PORT"] == "auto"
    assert "node 1 (local) workdir /data/specs/sub\n    rank 1 (local 0): x" in describe(plan)


def test_c10d_plan_runs_torchrun_once_per_node():
    spec = parse_jobspec(SPEC + "rendezvous: {backend: c10d, port: 29400}\n")
    plan = plan_attempt(spec, "demo-abc123", attempt=2)
    assert [len(n.workers) for n in plan.nodes] == [1, 1, 1]
    argv = plan.nodes[0].workers[0].argv
    # -u: torchrun's own output unbuffered, without PYTHONUNBUFFERED reaching its workers.
    assert argv[:4] == ("python", "-u", "-m", "torch.distributed.run")
    assert "PYTHONUNBUFFERED" not in plan.nodes[0].env
    env = plan.nodes[0].workers[0].env
    assert env["PET_NNODES"] == "2:3" and env["PET_NPROC_PER_NODE"] == "2"
    assert env["PET_RDZV_ENDPOINT"] == "n0.example:29400" and env["PET_RDZV_ID"] == "demo-abc123-2"
    assert env["PET_RDZV_CONF"] == "is_host=1" and env["PET_LOCAL_ADDR"] == "n0.example"
    assert not any("rdzv" in a or "29400" in a for a in argv), argv  # nothing for `ps` to show
    assert plan.nodes[1].workers[0].env["PET_LOCAL_ADDR"] == "10.0.0.2"
    assert plan.nodes[1].workers[0].env["PET_RDZV_CONF"] == "is_host=0"
    assert argv[-3:] == ("train.py", "--lr", "0.1")
    assert "RANK" not in plan.nodes[0].env and "MASTER_ADDR" not in plan.nodes[0].env


@pytest.mark.parametrize("state", list(JobState))
def test_terminal_states_have_no_way_out(state):
    assert state.is_terminal() == (not TRANSITIONS[state])


def test_transitions_allowed_and_refused():
    check_transition(JobState.PENDING, JobState.LAUNCHING)
    check_transition(JobState.RUNNING, JobState.RESTARTING)
    check_transition(JobState.RESTARTING, JobState.LAUNCHING)
    for terminal in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        check_transition(JobState.RUNNING, terminal) if terminal != JobState.SUCCEEDED else None
        with pytest.raises(InvalidTransition):
            check_transition(terminal, JobState.RUNNING)
    with pytest.raises(InvalidTransition):
        check_transition(JobState.PENDING, JobState.SUCCEEDED)
    # Cancel wins from every live state.
    for state in JobState:
        if not state.is_terminal():
            check_transition(state, JobState.CANCELLED)


def test_token_sweep_revalidates_each_pid_before_killing(monkeypatch):
    """A pid that the scan found but that no longer carries the token (the process died and
    the pid was reused) must not be killed."""
    import os
    import subprocess
    import sys

    import agents.processes as agent

    token = "t0ken-under-test"
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            env={**os.environ, agent.TOKEN_VAR: token})
    try:
        # Popen returns once the child's exec closed its close-on-exec pipe, which the kernel
        # does before it sets up the new image's environment (/proc/<pid>/environ reads empty
        # until then): under load the token was not there yet, and the process was rightly
        # spared (one full run).
        wait_for(lambda: agent.has_token(ours.pid, token), 10, interval=0.01,
                 what="the child's environment")
        # The scan "saw" both pids (as if the stranger had taken a dead worker's pid).
        monkeypatch.setattr(agent, "processes_with_token", lambda _t: [stranger.pid, ours.pid])
        agent.kill_token_processes(token)
        assert ours.wait(timeout=10) == -9
        assert stranger.poll() is None, "a process without the token was killed"
    finally:
        stranger.kill()
        ours.kill()
        stranger.wait()
        ours.wait()


def test_a_process_in_the_middle_of_its_exec_is_found_by_its_token():
    """Popen returns once the child's exec closed its close-on-exec pipe, before the kernel
    lays out the new image's environment: a sweep reading ``/proc/<pid>/environ`` then read
    nothing and spared the process (on the old code 22-75 of 200 children right after Popen,
    more under load). A process started with no environment at all is decided at once."""
    import os
    import subprocess
    import time

    import agents.processes as agent

    token = "t0ken-mid-exec"
    missed = []
    for _ in range(200):
        child = subprocess.Popen(["sleep", "30"], env={**os.environ, agent.TOKEN_VAR: token})
        try:
            if not agent.has_token(child.pid, token):
                missed.append(child.pid)
        finally:
            child.kill()
            child.wait()
    assert missed == [], f"{len(missed)} of 200 children not found by their token"
    bare = subprocess.Popen(["sleep", "30"], env={})
    try:
        wait_for(lambda: agent._read(f"/proc/{bare.pid}/stat") and not agent._in_exec(bare.pid),
                 10, interval=0.01, what="the bare child's image")
        started = time.monotonic()
        assert not agent.has_token(bare.pid, token)
        assert time.monotonic() - started < agent.EXEC_WAIT / 2, "an empty environment waited for"
    finally:
        bare.kill()
        bare.wait()


def test_gpu_counts_differ_per_node_and_ranks_follow_them():
    spec = parse_jobspec("nodes: [{host: local}, {host: local}, {host: local}]\n"
                         "nproc_per_node: gpu\ncommand: [train]\n")
    plan = plan_attempt(spec, "j-1", node_indices=[0, 2], nprocs={0: 3, 2: 1})
    assert plan.world_size == 4
    assert [[w.rank for w in n.workers] for n in plan.nodes] == [[0, 1, 2], [3]]
    assert [n.env["LOCAL_WORLD_SIZE"] for n in plan.nodes] == ["3", "1"]
    assert {n.env["WORLD_SIZE"] for n in plan.nodes} == {"4"}
    c10d = parse_jobspec("nodes: [{host: local}, {host: local}]\nnproc_per_node: auto\n"
                         "command: [python, t.py]\nrendezvous: {backend: c10d}\n")
    plan = plan_attempt(c10d, "j-1", nprocs={0: 2, 1: 8})
    assert [n.workers[0].env["PET_NPROC_PER_NODE"] for n in plan.nodes] == ["2", "8"]


def test_per_node_plan_runs_one_process_per_node_with_its_ranks_on_the_command_line():
    spec = parse_jobspec(SPEC + "launch: per-node\n").model_copy(update={"command": (
        "python", "spawn.py", "--master_addr", "${master_addr}", "--master_port",
        "${master_port}", "--world_size", "${world_size}", "--start_rank",
        "${node_start_rank}", "--num_gpus", "${nproc_per_node}")})
    plan = plan_attempt(spec, "demo-abc123", master_port=29555)
    assert [len(n.workers) for n in plan.nodes] == [1, 1, 1]
    argvs = [n.workers[0].argv for n in plan.nodes]
    assert [a[3] for a in argvs] == ["n0.example"] * 3 and {a[5] for a in argvs} == {"29555"}
    assert [(a[7], a[9], a[11]) for a in argvs] == [("6", "0", "2"), ("6", "2", "2"),
                                                     ("6", "4", "2")]
    node = plan.nodes[1]
    assert node.workers[0].rank is None and "RANK" not in node.env
    assert node.env["WORLD_SIZE"] == "6" and node.env["GROUP_RANK"] == "1"
    assert node.defaults == {}  # nothing of torchrun's stands in for the user's launcher
    assert plan.owner(1) == "the node's process on node 1"
    assert "node process (2 ranks): python spawn.py" in describe(plan)


def test_static_plan_gives_torchruns_defaults_and_the_route_only_across_nodes():
    spec = parse_jobspec(SPEC)
    plan = plan_attempt(spec, "demo-abc123", master_port=1)
    assert plan.nodes[0].defaults == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                                      "OMP_NUM_THREADS": "1"}
    assert plan.nodes[0].env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == \
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert {n.route_to for n in plan.nodes} == {"n0.example"}
    one = plan_attempt(spec, "demo-abc123", master_port=1, node_indices=[2])
    assert one.nodes[0].route_to is None  # one node: nothing crosses a network
