"""Planned interruptions with real jobs (orchestrator/drain.py): an operator drains a node of
a running job; every rank saves the agreed step and waits there, the spare takes the drained
node's place warm from that step, nothing is redone and no restart is charged, and the
weights at the end are those of a run never interrupted. The SSH test
(tests/cluster/test_drain_ssh.py) runs the same over real nodes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import orchestrator
from orchestrator.ui.metrics import exposition
from tests.helpers import PYTHON, ROOT, WORKERS, wait_for, wait_for_output, write_spec
from tests.integration.test_checkpoints import memory_dirs, reference_weights
from tests.integration.test_notify import Receiver

STEPS = 60


def train_spec(tmp_path, nodes, out, **extra):
    return {"name": "drain", "nodes": nodes, "nnodes": 2, "nproc_per_node": 2,
            "command": [PYTHON, str(WORKERS / "ckpt_train.py")], "workdir": str(tmp_path),
            "max_restarts": 0, "restart": {"warm": True}, "stop_grace_period": 2,
            # A second attempt (after the move, or resumed) has only to finish.
            "env": {"OUT": str(out), "STEPS": str(STEPS), "STEP_SLEEP": "0.1",
                    "STEP_SLEEP_LATER": "0.01", "STATE_MB": "1"}, **extra}


def shown_drained(node: dict) -> bool:
    return (node["drained"] or {}).get("reason") == "maintenance"


def drain_moves_to_the_spare(job_id, out, drain, shown=shown_drained) -> dict:
    """Once rank 3 saved step 10, ``drain(job_id, node)`` drains node rank 1's node: the job
    must end as one never interrupted, the second attempt on the other two nodes from the
    agreed step, none done twice, no restart charged."""
    import torch

    wait_for_output(job_id, "rank 3 step 10 saved", 1, timeout=120)
    leaving = next(n["node_index"] for n in orchestrator.status(job_id)["nodes"]
                   if n["node_rank"] == 1)
    drain(job_id, leaving)
    # What a user sees while it happens: the node drained, with the reason, and Prometheus.
    wait_for(lambda: shown(orchestrator.status(job_id)["nodes"][leaving]), 10,
             what="the node shown drained")
    node = orchestrator.status(job_id)["nodes"][leaving]
    metrics = exposition()[0].decode()
    labels = f'host="{node["host"]}",job_id="{job_id}",node="{leaving}"'  # sorted, as shown
    if node["drained"]:
        assert f"orchestrator_node_drained{{{labels}}} 1.0" in metrics, metrics
    else:
        source = node["notice"]["source"]
        assert re.search(rf'orchestrator_node_notice_deadline_seconds{{{labels},'
                         rf'source="{re.escape(source)}"}} \d', metrics), metrics
    result = orchestrator.wait(job_id, timeout=180)
    assert result["state"] == "SUCCEEDED", result["failure"]
    first = result["attempts"][0]["failure"]
    assert (first["cause"], first["failure_class"], first["node_index"]) == (
        "PREEMPTED", "preempted", leaving), first
    agreed = int(re.search(r"every rank saved step (\d+)", first["message"])[1])
    assert result["restarts"] == 0 and result["attempts"][1]["restored_step"] == agreed
    assert leaving not in {r["node_index"] for r in result["ranks"]}
    for rank in range(4):
        assert (out / f"resumed-2-{rank}").read_text() == str(agreed)
    # Nothing redone: no rank of the first attempt got past the agreed step.
    reached = [int(m[1]) for ln in orchestrator.logs(job_id, attempt=1)
               if (m := re.search(r"step (\d+) saved", ln))]
    assert max(reached) <= agreed, (max(reached), agreed)
    expected = reference_weights(STEPS, 4)
    for rank in range(4):
        final = torch.load(out / f"final-{rank}.pt")
        for name, value in expected.items():
            assert torch.allclose(final[name], value, atol=1e-6), (rank, name)
    assert result["attempts"][1]["warm_starts"] == 4
    wait_for(lambda: memory_dirs(job_id) == [], 15, what="every node's memory removed")
    return result


def test_a_drained_node_leaves_at_a_step_every_rank_saved_and_the_spare_goes_on(
        tmp_path, home):
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(write_spec(tmp_path, train_spec(
        tmp_path, [{"host": "local"}] * 3, out)))

    def by_cli(job, node):  # as an operator types it
        done = subprocess.run([PYTHON, "-m", "orchestrator", "drain", str(node), "--job", job,
                               "--reason", "maintenance"], capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
        assert done.returncode == 0 and f"drained {node} for {job}" in done.stdout, done

    drain_moves_to_the_spare(job_id, out, by_cli)
    # A drained node stays up: the move ended once every rank held the step in memory, and
    # the spare pulled the leaving ranks' copies from the drained node as its workers started.
    log = (home / "jobs" / job_id / "controller.log").read_text()
    assert "(the leaving ranks' copies are pulled from their node)" in log and \
        "(2 ranks from the memory of the node(s) leaving)" in log, \
        [ln for ln in log.splitlines() if "every rank saved" in ln or "resumes checkpoint" in ln]
    assert [d["target"] for d in orchestrator.drains()] == ["1"]
    assert orchestrator.undrain_node("1", job=job_id) and orchestrator.drains() == []


def test_after_a_move_the_drained_node_and_the_former_spare_keep_nothing_they_need_not(
        tmp_path, home):
    """What a user sees of each node's memory while the job goes on after a drain: the
    drained node (out of the job, and the ranks that took its place loaded) kept its ranks'
    copies and its buddy's replicas for as long as the job ran, and the former spare its
    last replica of each rank it now runs. Both let go; the drained node says so in
    ``status``, and its agent still serves (undrained, it is a spare again)."""
    import glob

    out = tmp_path / "out"
    out.mkdir()
    spec = train_spec(tmp_path, [{"host": "local"}] * 3, out)
    spec["env"]["STEPS"] = "400"
    del spec["env"]["STEP_SLEEP_LATER"]  # the job after the move is looked at
    job_id = orchestrator.submit(write_spec(tmp_path, spec))
    wait_for_output(job_id, "rank 3 step 10 saved", 1, timeout=120)
    nodes = orchestrator.status(job_id)["nodes"]
    leaving = next(n["node_index"] for n in nodes if n["node_rank"] == 1)
    spare = next(n["node_index"] for n in nodes if n["node_rank"] is None)
    orchestrator.drain_node(str(leaving), job=job_id, reason="maintenance")
    wait_for_output(job_id, "attempt 2 starts", 4, timeout=120)

    def memory(index: int) -> int | None:
        return (orchestrator.status(job_id)["nodes"][index]["checkpoint"] or {}).get(
            "memory_bytes")
    wait_for(lambda: memory(leaving) == 0, 30, what=f"the drained node's memory: {memory(leaving)}")
    (root,) = glob.glob(f"/dev/shm/orchestrator-{os.getuid()}/{job_id}.{spare}")
    runs = {int(n[5:]) for n in os.listdir(root) if n.startswith("rank-")}
    assert runs == {2, 3}, runs  # node rank 1's ranks, now on the former spare

    def stale() -> list[str]:
        replicas = os.path.join(root, "replicas")
        return [f"{r}/{f}" for r in os.listdir(replicas) if int(r[5:]) in runs
                for f in os.listdir(os.path.join(replicas, r))]
    wait_for(lambda: not stale(), 30, what=f"the former spare's own ranks' replicas gone: "
             f"{stale()}")
    assert memory(spare) and memory(leaving) == 0
    orchestrator.cancel(job_id)
    assert orchestrator.wait(job_id, timeout=60)["state"] == "CANCELLED"
    assert orchestrator.undrain_node(str(leaving), job=job_id)


def sigterm_moves_to_the_spare(job_id, out) -> None:
    """SIGTERM to node rank 1's agent, as its host's shutdown sends it: the job moves off the
    node as a drain moves it, shown as the node's notice meanwhile, and the agent leaves."""
    pids = {}

    def sigterm(job, node):
        pids[node] = orchestrator.status(job)["nodes"][node]["agent_pid"]
        os.kill(pids[node], signal.SIGTERM)

    def noticed(node):
        notice = node["notice"] or {}
        return notice.get("source") == "SIGTERM to the agent" and notice.get("deadline")

    result = drain_moves_to_the_spare(job_id, out, sigterm, shown=noticed)
    assert "SIGTERM to the agent" in result["attempts"][0]["failure"]["message"]
    (pid,) = pids.values()
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10, what="the noticed agent gone")


def test_a_sigterm_to_a_nodes_agent_is_a_notice_and_the_spare_goes_on(tmp_path, home):
    """Its workers go on while the job moves off the node at a step every rank saved,
    within stop_grace_period; then the agent leaves. A webhook hears of a move (drained),
    not of a restart."""
    out = tmp_path / "out"
    out.mkdir()
    receiver = Receiver()
    try:
        job_id = orchestrator.submit(write_spec(tmp_path, train_spec(
            tmp_path, [{"host": "local"}] * 3, out, stop_grace_period=30, notify=[{
                "url": receiver.url, "on": ["drained", "restarted", "succeeded"]}])))
        sigterm_moves_to_the_spare(job_id, out)
        wait_for(lambda: receiver.events(job_id) == ["drained", "succeeded"], 10,
                 what=f"the webhook told of the move: {receiver.events(job_id)}")
    finally:
        receiver.close()


def long_job_at_step_10(tmp_path) -> str:
    """Two local nodes and a spare training 400 steps (long enough to look at the job after
    a move), stop_grace_period 60; returns once rank 3 saved step 10."""
    out = tmp_path / "out"
    out.mkdir()
    spec = train_spec(tmp_path, [{"host": "local"}] * 3, out, stop_grace_period=60)
    spec["env"]["STEPS"] = "400"
    del spec["env"]["STEP_SLEEP_LATER"]  # the job after the move is looked at
    job_id = orchestrator.submit(write_spec(tmp_path, spec))
    try:
        wait_for_output(job_id, "rank 3 step 10 saved", 1, timeout=120)
    except BaseException:
        orchestrator.cancel(job_id, wait_seconds=30)
        raise
    return job_id


def test_a_noticed_nodes_next_agent_is_no_spare_until_the_notices_deadline(tmp_path, home):
    """The noticed agent leaves once the job moved off its node, and the transport starts
    another there at once (0.2 s here). That host still goes away by the notice's deadline:
    the node was a spare again, shown so, and the next failure could place ranks on it."""
    job_id = long_job_at_step_10(tmp_path)
    try:
        node = next(n for n in orchestrator.status(job_id)["nodes"] if n["node_rank"] == 1)
        os.kill(node["agent_pid"], signal.SIGTERM)
        leaving, first = node["node_index"], node["agent_pid"]

        def back() -> dict | None:
            shown = orchestrator.status(job_id)
            n = shown["nodes"][leaving]
            again = n["agent_pid"] not in (None, first) and n["state"] == "CONNECTED"
            return shown if again and shown["attempt"] == 2 else None
        shown = wait_for(back, 60, what="the noticed node's next agent attached")
        n = shown["nodes"][leaving]
        assert (n["notice"] or {}).get("source") == "SIGTERM to the agent", n
        assert not n["spare"], n
        assert [x["spare"] for x in shown["nodes"]].count(True) == 0, shown["nodes"]
        assert shown["state"] == "RUNNING" and leaving not in {
            r["node_index"] for r in shown["ranks"]}
    finally:
        orchestrator.cancel(job_id, wait_seconds=30)


def test_a_sigterm_to_a_spares_agent_is_a_notice_and_the_spare_is_none(tmp_path, home):
    """A host shutdown (or a reclaim) that reaches a hot spare: its agent, without workers,
    left at once, the transport started another there, and the node was a spare again, the
    one a participant's move would go onto though it goes away. It is a notice too: the
    agent stays up until its deadline, its heartbeats saying so, and the node is no spare."""
    job_id = long_job_at_step_10(tmp_path)
    try:
        spare = next(n for n in orchestrator.status(job_id)["nodes"] if n["spare"])
        os.kill(spare["agent_pid"], signal.SIGTERM)

        def noticed() -> dict | None:
            n = orchestrator.status(job_id)["nodes"][spare["node_index"]]
            return n if n["notice"] else None
        n = wait_for(noticed, 10, what="the spare shown noticed")
        assert n["notice"]["source"] == "SIGTERM to the agent" and not n["spare"], n
        time.sleep(2)  # it stays: the same agent, no spare, the job undisturbed
        shown = orchestrator.status(job_id)
        n = shown["nodes"][spare["node_index"]]
        assert n["agent_pid"] == spare["agent_pid"] and n["notice"] and not n["spare"], n
        assert (shown["state"], shown["attempt"]) == ("RUNNING", 1), shown["failure"]
    finally:
        orchestrator.cancel(job_id, wait_seconds=30)


def test_a_shutdown_that_ends_the_workers_with_the_agent_lets_the_agent_leave_at_once(
        tmp_path, home):
    """A host shutdown SIGTERMs the whole session: the agent and its workers. The workers die
    before the agent's next look (two a second), which then took itself for a spare told to
    go and stayed until the deadline (stop_grace_period: 60 s here), holding up the
    shutdown. Its workers ran when the notice came: it leaves once they are gone."""
    job_id = long_job_at_step_10(tmp_path)
    try:
        shown = orchestrator.status(job_id)
        node = next(n for n in shown["nodes"] if n["node_rank"] == 1)
        workers = [r["pid"] for r in shown["ranks"] if r["node_index"] == node["node_index"]]
        assert len(workers) == 2 and all(workers), shown["ranks"]
        for pid in workers:  # (first: gone before the agent reads its SIGTERM)
            os.kill(pid, signal.SIGKILL)
        os.kill(node["agent_pid"], signal.SIGTERM)
        wait_for(lambda: not os.path.exists(f"/proc/{node['agent_pid']}"), 10,
                 what="the agent gone with its workers")
    finally:
        orchestrator.cancel(job_id, wait_seconds=30)


def preemption_check(tmp_path) -> dict:
    """``health`` with a preemption_check that says a node goes in 30 s once its file is
    there (standing in for a cloud's metadata service): the script runs from its agent's
    directory, ``<job>.<node index>``, so the file names one node."""
    return {"preemption_check": f"d=${{0%/*}}; test -e {tmp_path}/notice-${{d##*/}} && echo 30",
            "preemption_check_interval": 0.5}


def check_moves_to_the_spare(job_id, out, tmp_path) -> None:
    """Node rank 1's preemption_check says so: the job moves off it as a drain moves it."""
    def notice(job, node):
        (tmp_path / f"notice-{job}.{node}").touch()

    def noticed(node):
        return (node["notice"] or {}).get("source") == "preemption_check: 30"

    drain_moves_to_the_spare(job_id, out, notice, shown=noticed)


def test_a_preemption_check_saying_so_is_a_notice_and_the_spare_goes_on(tmp_path, home):
    out = tmp_path / "out"
    out.mkdir()
    check_moves_to_the_spare(orchestrator.submit(write_spec(tmp_path, train_spec(
        tmp_path, [{"host": "local"}] * 3, out, health=preemption_check(tmp_path)))),
        out, tmp_path)


def test_a_notice_shorter_than_the_move_falls_back_to_the_newest_save_and_says_so(
        tmp_path, home):
    """SIGTERM to node rank 1's agent with a stop_grace_period of 2 s: the agreed step is
    further ahead than the ranks get in that time. At the deadline the job moves all the
    same, from the newest step every rank holds, and the failure says so; nothing hangs,
    nothing is charged, and the weights are an uninterrupted run's."""
    import torch

    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(write_spec(tmp_path, train_spec(
        tmp_path, [{"host": "local"}] * 3, out, stop_grace_period=2)))
    wait_for_output(job_id, "rank 3 step 10 saved", 1, timeout=120)
    leaving = next(n for n in orchestrator.status(job_id)["nodes"] if n["node_rank"] == 1)
    os.kill(leaving["agent_pid"], signal.SIGTERM)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]
    first = result["attempts"][0]["failure"]
    assert (first["cause"], first["node_index"]) == ("PREEMPTED", leaving["node_index"]), first
    agreed = re.search(r"not every rank saved step (\d+) within [\d.]+s: the next attempt "
                       r"resumes the newest step every rank holds", first["message"])
    assert agreed, first["message"]
    restored = result["attempts"][1]["restored_step"]
    assert restored is not None and 10 <= restored < int(agreed[1])
    assert result["restarts"] == 0
    expected = reference_weights(STEPS, 4)
    for rank in range(4):
        final = torch.load(out / f"final-{rank}.pt")
        for name, value in expected.items():
            assert torch.allclose(final[name], value, atol=1e-6), (rank, name)


def test_a_drain_the_job_cannot_do_without_keeps_the_node_and_says_so(tmp_path, home):
    """Two nodes, nnodes 2, no spare: the drained node keeps running its ranks (a drain
    stops new work), and the controller's log says why; undrained, nothing happened."""
    out = tmp_path / "out"
    out.mkdir()
    spec = train_spec(tmp_path, [{"host": "local"}] * 2, out)
    job_id = orchestrator.submit(write_spec(tmp_path, spec))
    wait_for_output(job_id, "rank 3 step 5 saved", 1, timeout=120)
    orchestrator.drain_node("1", job=job_id, reason="maintenance")
    log = home / "jobs" / job_id / "controller.log"
    wait_for(lambda: "cannot go on without it" in log.read_text(), 10,
             what="the controller saying why it stays")
    time.sleep(1)
    assert orchestrator.status(job_id)["attempt"] == 1
    result = orchestrator.wait(job_id, timeout=180)
    assert result["state"] == "SUCCEEDED" and result["attempt"] == 1, result["failure"]


def preempted_and_resumed(job_id, out, tmp_path, notice, steps=STEPS) -> dict:
    """Once rank 3 saved step 10, ``notice(job_id)`` tells every node to go: the job must
    stop PREEMPTED at a step every rank saved and persisted, with no restart charged and no
    agent left; ``resume`` then trains from exactly that step to the end of a run never
    interrupted."""
    import torch

    wait_for_output(job_id, "rank 3 step 10 saved", 1, timeout=120)
    notice(job_id)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "PREEMPTED", result
    failure = result["failure"]
    assert (failure["cause"], failure["failure_class"], failure["node_index"]) == (
        "PREEMPTED", "preempted", None), failure
    saved = re.search(r"every rank saved step (\d+), persisted", failure["message"])
    assert saved, failure["message"]  # which ending it was, when not this one
    agreed = int(saved[1])
    assert result["restarts"] == 0 and result["attempts"][0]["outcome"] == "FAILED"
    for rank in range(4):  # persisted at the agreed step though persist_every is 1000
        assert (tmp_path / "ckpt" / f"step-{agreed:012d}" / f"rank-{rank}.manifest").exists()
    wait_for(lambda: memory_dirs(job_id) == [], 15, what="every node's memory removed")
    reached = [int(m[1]) for ln in orchestrator.logs(job_id, attempt=1)
               if (m := re.search(r"step (\d+) saved", ln))]
    assert max(reached) <= agreed, (max(reached), agreed)

    orchestrator.undrain_node("*", job=job_id)  # no-op where none was drained
    assert orchestrator.resume(job_id)["resumed"]
    result = orchestrator.wait(job_id, timeout=180)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert result["restarts"] == 0 and result["attempt"] == 2
    for rank in range(4):
        assert (out / f"resumed-2-{rank}").read_text() == str(agreed)
    expected = reference_weights(steps, 4)
    for rank in range(4):
        final = torch.load(out / f"final-{rank}.pt")
        for name, value in expected.items():
            assert torch.allclose(final[name], value, atol=1e-6), (rank, name)
    return result


def whole_job_spec(tmp_path, out, steps=STEPS) -> dict:
    spec = train_spec(tmp_path, [{"host": "local"}] * 2, out, stop_grace_period=30,
                      checkpoint={"dir": str(tmp_path / "ckpt"), "persist_every": 1000})
    spec["env"]["STEPS"] = str(steps)
    return spec


def test_drain_all_stops_the_job_preempted_and_resume_goes_on_from_the_saved_step(
        tmp_path, home):
    """The webhook (a secret the PREEMPTED job keeps) hears it stop, and end after resume."""
    out = tmp_path / "out"
    out.mkdir()
    receiver = Receiver()
    spec = whole_job_spec(tmp_path, out)
    spec["notify"] = [{"url": receiver.url, "on": ["preempted", "restarted", "succeeded"]}]
    job_id = orchestrator.submit(write_spec(tmp_path, spec))

    def drain_all(job):  # as an operator types it
        done = subprocess.run([PYTHON, "-m", "orchestrator", "drain", "--all", "--job", job,
                               "--reason", "maintenance"], capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
        assert done.returncode == 0 and f"drained * for {job}" in done.stdout, done

    try:
        preempted_and_resumed(job_id, out, tmp_path, drain_all)
        wait_for(lambda: receiver.events(job_id) == ["preempted", "succeeded"], 10,
                 what=f"the webhook told: {receiver.events(job_id)}")
    finally:
        receiver.close()
    assert orchestrator.drains() == []


def test_a_sigterm_to_every_agent_stops_the_job_preempted_and_resume_goes_on(tmp_path, home):
    """A whole allocation preempted (every node's agent told SIGTERM): the same."""
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(write_spec(tmp_path, whole_job_spec(tmp_path, out)))

    def sigterm_all(job):
        for node in orchestrator.status(job)["nodes"]:
            os.kill(node["agent_pid"], signal.SIGTERM)

    preempted_and_resumed(job_id, out, tmp_path, sigterm_all)


def test_notices_a_moment_apart_to_every_node_and_the_spare_stop_the_job_preempted(
        tmp_path, home):
    """A whole allocation preempted reaches its nodes a heartbeat or more apart. A move begun
    for the first noticed node went on without the others (the spare could take its place),
    and the job never stopped PREEMPTED with the step persisted: the nodes noticed later
    join the move at its step, and the job stops and resumes as if all had come at once."""
    out = tmp_path / "out"
    out.mkdir()
    spec = whole_job_spec(tmp_path, out, steps=40)
    spec["nodes"] = [{"host": "local"}] * 3
    spec["env"]["STEP_SLEEP"] = "0.3"  # the move lasts the 1.5 s lead and a step or more
    job_id = orchestrator.submit(write_spec(tmp_path, spec))
    log = home / "jobs" / job_id / "controller.log"

    def one_then_the_rest(job):
        nodes = sorted(orchestrator.status(job)["nodes"],
                       key=lambda n: (n["node_rank"] is None, n["node_rank"]))
        os.kill(nodes[0]["agent_pid"], signal.SIGTERM)
        wait_for(lambda: "every rank saves step" in log.read_text(), 10,
                 what="the move for the first node begun")
        for node in nodes[1:]:  # the other participant, then the spare
            os.kill(node["agent_pid"], signal.SIGTERM)

    preempted_and_resumed(job_id, out, tmp_path, one_then_the_rest, steps=40)
    assert "drained too (SIGTERM to the agent)" in log.read_text()


def test_a_notice_the_job_cannot_do_without_stops_it_preempted_and_resume_goes_on(
        tmp_path, home):
    """Two nodes, no spare, and one of them noticed (it goes away whatever we do): unlike a
    drain, the job cannot keep running there, so it stops PREEMPTED at a saved step, and
    resume goes on from it (on a node that came back: here, the same host)."""
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(write_spec(tmp_path, whole_job_spec(tmp_path, out)))

    def sigterm_one(job):
        node = next(n for n in orchestrator.status(job)["nodes"] if n["node_rank"] == 1)
        os.kill(node["agent_pid"], signal.SIGTERM)

    preempted_and_resumed(job_id, out, tmp_path, sigterm_one)


def test_ranks_held_at_a_moves_step_longer_than_hang_timeout_are_not_hung(tmp_path, home):
    """A whole-job stop waits, its ranks held at the agreed step, until every rank persisted
    it: a slow shared filesystem takes minutes for a big state. The ranks are silent
    meanwhile, by our doing, and the hang check declared the job HUNG (a failure charged to
    it) at health.hang_timeout. Here the persist never succeeds (checkpoint.dir lies under a
    file): the move runs to its time, and the job stops PREEMPTED at the newest step every
    rank holds, as a move that ran out of time does."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "a-file").write_text("")
    spec = whole_job_spec(tmp_path, out, steps=400)
    spec["checkpoint"]["dir"] = str(tmp_path / "a-file" / "ckpt")
    # The ranks' start (4 of them importing torch on 2 cores: 9 s idle, more under load) is
    # silent too, and no part of what this tests: startup_timeout covers it.
    spec["health"] = {"hang_timeout": 10, "startup_timeout": 120}
    job_id = orchestrator.submit(write_spec(tmp_path, spec))
    wait_for_output(job_id, "rank 3 step 10 saved", 1, timeout=120)
    orchestrator.drain_node("*", job=job_id, reason="maintenance", within=25)
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "PREEMPTED", result["failure"]
    assert re.search(r"not every rank saved step \d+ within 25s", result["failure"]["message"])
    orchestrator.undrain_node("*", job=job_id)


def test_on_sigterm_worker_passes_a_sigterm_to_the_workers_at_once(tmp_path, home):
    """A script that handles SIGTERM itself says so (on_sigterm: worker): a SIGTERM to its
    node's agent reaches every worker there at once, as from torchrun, and is no notice."""
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "sigterm", "nodes": [{"host": "local"}], "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "sigterm_handler.py")], "workdir": str(tmp_path),
        "env": {"OUT": str(out)}, "on_sigterm": "worker", "stop_grace_period": 30}))
    for rank in range(2):
        wait_for_output(job_id, f"rank {rank} ready", 1, timeout=60)
    started = time.monotonic()
    os.kill(orchestrator.status(job_id)["nodes"][0]["agent_pid"], signal.SIGTERM)
    wait_for(lambda: all((out / f"handled-{r}").exists() for r in range(2)), 10,
             what="both workers' own handlers run")
    assert time.monotonic() - started < 10  # at once: not after stop_grace_period
    assert [(out / f"handled-{r}").read_text() for r in range(2)] == ["SIGTERM"] * 2
    result = orchestrator.wait(job_id, timeout=60)  # how it ends is the script's to say
    assert result["state"] in ("SUCCEEDED", "FAILED") and result["nodes"][0]["notice"] is None


def test_resume_waits_for_the_controller_that_stopped_the_job_to_finish_ending(tmp_path, home):
    """A waiter wakes as soon as PREEMPTED is written, before the controller has let go of
    its nodes (lingering for unreachable agents, its notifications, its Slurm allocation):
    a ``resume`` typed then waits for it to exit, and the job goes on. (Fails on the old
    code: resume found the controller alive and did nothing, ``resumed`` False.)"""
    import secrets
    import socket
    import threading

    from orchestrator.pids import pid_namespace
    from orchestrator.spec import load_jobspec
    from orchestrator.state import JobState
    from orchestrator.store import Store
    from orchestrator.world import UserWorld

    job = load_jobspec(write_spec(tmp_path, {"name": "ending", "nodes": [{"host": "local"}],
                                             "command": [PYTHON, "-c", "print('went on')"],
                                             "workdir": str(tmp_path)}))
    job_id = "ending-000001"
    ending = subprocess.Popen(["sleep", "2"])  # the controller, still ending
    threading.Thread(target=ending.wait, daemon=True).start()  # reaped once it exits
    store = Store()
    try:
        store.create_job(job_id, job.name, job.model_dump_json(), str(tmp_path), 0, ["local"],
                         secret=secrets.token_hex(32), world=UserWorld.capture().to_dict())
        for state in (JobState.LAUNCHING, JobState.RUNNING, JobState.PREEMPTED):
            store.set_state(job_id, state)
        store.claim_controller(job_id, ending.pid, socket.gethostname(), pid_namespace())
    finally:
        store.close()
    began = time.monotonic()
    assert orchestrator.resume(job_id)["resumed"]
    assert ending.poll() is not None and time.monotonic() - began > 1.0
    result = orchestrator.wait(job_id, timeout=60)
    assert result["state"] == "SUCCEEDED", result
    assert any("went on" in line for line in orchestrator.logs(job_id))
