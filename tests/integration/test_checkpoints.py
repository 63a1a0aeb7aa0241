"""Checkpoints in the agents' memory (README, "Checkpoints"): a rank SIGKILLed right after a
save resumes, with every other rank, from that very step, read from its node's memory; the
weights at the end are those of a run that never failed; a corrupt copy is named, skipped,
and the next good one used; nothing is left in shared memory when the job ends."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess

import pytest
import torch

import orchestrator
from orchestrator.ui.metrics import exposition
from tests.helpers import (
    PYTHON,
    WORKERS,
    assert_no_job_processes,
    wait_for,
    wait_for_output,
    write_spec,
)

SHM = f"/dev/shm/orchestrator-{os.getuid()}"


def reference_weights(steps: int, world: int) -> dict[str, torch.Tensor]:
    """What tests/workers/ckpt_train.py ends with when nothing fails (one process)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        grads = []
        for rank in range(world):
            g = torch.Generator().manual_seed(step * world + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / world
        opt.step()
    return model.state_dict()


def memory_dirs(job_id: str) -> list[str]:
    return glob.glob(os.path.join(SHM, f"{job_id}.*"))


def run(tmp_path, home, env: dict, checkpoint: dict | None = None, restarts: int = 1):
    out = tmp_path / "out"
    out.mkdir()
    spec = {"name": "ckpt", "nodes": [{"host": "local"}], "nproc_per_node": 2,
            "command": [PYTHON, str(WORKERS / "ckpt_train.py")], "workdir": str(tmp_path),
            "max_restarts": restarts, "restart_backoff": {"initial": 0.1},
            "env": {"OUT": str(out), **env}}
    if checkpoint is not None:
        spec["checkpoint"] = checkpoint
    job_id = orchestrator.submit(write_spec(tmp_path, spec))
    result = orchestrator.wait(job_id, timeout=180)
    return job_id, result, out


def test_a_killed_rank_resumes_with_everyone_from_the_step_it_saved_last(tmp_path, home,
                                                                         monkeypatch):
    # What the node's own environment says of checkpoints is not what the workers are told.
    monkeypatch.setenv("ORCHESTRATOR_CHECKPOINT_STEP", "3")
    job_id, result, out = run(tmp_path, home, {"CRASH_AT": "5", "STEPS": "10"})
    assert result["state"] == "SUCCEEDED", result.get("failure")
    attempts = result["attempts"]
    assert [a["restored_step"] for a in attempts] == [None, 5]
    assert (out / "resumed-1-0").read_text() == "-1"  # a fresh start
    # Both ranks resumed step 5 (one step past it), from memory: nothing persisted here.
    assert (out / "resumed-2-0").read_text() == "5" and (out / "resumed-2-1").read_text() == "5"
    expected = reference_weights(10, 2)
    for rank in (0, 1):
        final = torch.load(out / f"final-{rank}.pt")
        for name, value in expected.items():
            assert torch.allclose(final[name], value, atol=1e-6), (rank, name)
    assert_no_job_processes(job_id)
    assert memory_dirs(job_id) == []
    # What a scrape and status say: the step resumed; the node holds nothing any more.
    text = exposition(home)[0].decode()
    assert f'orchestrator_checkpoint_restored_step{{job_id="{job_id}",name="ckpt"}} 5.0' in text
    assert f'orchestrator_checkpoint_memory_bytes{{host="local",job_id="{job_id}",node="0"}} ' \
        '0.0' in text, [ln for ln in text.splitlines() if "checkpoint" in ln]
    assert result["nodes"][0]["checkpoint"]["memory_bytes"] == 0


def test_saves_beside_the_training_resume_the_same_step_everywhere_after_a_kill(tmp_path,
                                                                                 home):
    """``save(..., wait=False)``, waited for before each optimizer step: rank 1 is SIGKILLed
    right after its save of step 5 returned, its copy maybe still under way (32 MiB of
    state). Every rank resumes one step, 5 or the one before (never a copy not whole), and
    the job ends with the weights of a run never killed: each copy held the state as of its
    step, although the training went on while it was made."""
    job_id, result, out = run(tmp_path, home, {"CRASH_AT": "5", "STEPS": "10",
                                               "BACKGROUND": "1", "STATE_MB": "32"})
    assert result["state"] == "SUCCEEDED", result.get("failure")
    resumed = {(out / f"resumed-2-{rank}").read_text() for rank in (0, 1)}
    assert resumed in ({"4"}, {"5"}), resumed
    assert [a["restored_step"] for a in result["attempts"]] == [None, int(resumed.pop())]
    expected = reference_weights(10, 2)
    for rank in (0, 1):
        final = torch.load(out / f"final-{rank}.pt")
        for name, value in expected.items():
            assert torch.allclose(final[name], value, atol=1e-6), (rank, name)
    assert_no_job_processes(job_id)
    assert memory_dirs(job_id) == []


def test_the_persisted_copies_are_kept_verified_and_a_corrupt_one_is_skipped(tmp_path, home):
    ckdir = tmp_path / "ckpts"
    job_id, result, _ = run(tmp_path, home, {"STEPS": "9"},
                            {"dir": str(ckdir), "persist_every": 2, "keep": 3}, restarts=0)
    assert result["state"] == "SUCCEEDED", result.get("failure")
    # Saves 2, 4, 6, 8 (steps 1, 3, 5, 7) were persisted; the 3 newest kept.
    steps = sorted(p.name for p in ckdir.glob("step-*"))
    assert steps == ["step-000000000003", "step-000000000005", "step-000000000007"], steps
    for step_dir in ckdir.glob("step-*"):
        assert sorted(p.name for p in step_dir.iterdir()) == [
            f"rank-{r}.{s}" for r in (0, 1) for s in ("data", "manifest", "meta")]
    assert memory_dirs(job_id) == []
    # A byte flipped in rank 1's newest copy: a new job resumes from the one before, at
    # every rank, and says which copy it skipped and why.
    data = ckdir / "step-000000000007" / "rank-1.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x40
    data.write_bytes(bytes(raw))
    (tmp_path / "out").rename(tmp_path / "out-1")
    job_id, result, out = run(tmp_path, home, {"STEPS": "9"},
                              {"dir": str(ckdir), "persist_every": 2, "keep": 3}, restarts=0)
    assert result["state"] == "SUCCEEDED", result.get("failure")
    log = "\n".join(orchestrator.logs(job_id))
    assert "persisted copy of step 7 (rank 1" in log and "fails its checksum" in log, log[-2000:]
    assert (out / "resumed-1-0").read_text() == "5" and (out / "resumed-1-1").read_text() == "5"
    json.dumps(result)  # the status stays JSON


def start_saving(tmp_path, home, name: str) -> tuple[str, str]:
    """A job whose two ranks save every step for a long while, once it holds copies."""
    out = tmp_path / name
    out.mkdir()
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "ckpt", "nodes": [{"host": "local"}], "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "ckpt_train.py")], "workdir": str(tmp_path),
        "env": {"OUT": str(out), "STEPS": "100000", "STATE_MB": "4"}}, f"{name}.yaml"))
    def both_ranks_saved() -> bool:
        metas = [glob.glob(os.path.join(d, "rank-*", "step-*.meta")) for d in memory_dirs(job_id)]
        return any(len({os.path.dirname(m) for m in found}) == 2 for found in metas)
    wait_for(both_ranks_saved, 60, what="two ranks' saves in memory")
    return job_id, memory_dirs(job_id)[0]


def test_no_memory_is_left_after_a_cancel_or_the_agents_death(tmp_path, home):
    job_id, _ = start_saving(tmp_path, home, "cancelled")
    orchestrator.cancel(job_id, wait_seconds=30)
    assert orchestrator.status(job_id)["state"] == "CANCELLED"
    assert_no_job_processes(job_id)
    assert memory_dirs(job_id) == []

    job_id, _ = start_saving(tmp_path, home, "agent-killed")
    agent = orchestrator.status(job_id)["nodes"][0]["agent_pid"]
    os.kill(agent, signal.SIGKILL)  # its watchdog stops the workers and removes the memory
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "FAILED", result["state"]
    assert_no_job_processes(job_id)
    wait_for(lambda: memory_dirs(job_id) == [], 10, what="the memory removed")


def replicated(job_id: str, node_index: int, ranks: tuple[int, ...]) -> int:
    """The newest step of which ``node_index`` holds a replica of every one of ``ranks``."""
    steps = [[int(os.path.basename(f)[5:-9]) for f in glob.glob(os.path.join(
        SHM, f"{job_id}.{node_index}", "replicas", f"rank-{rank}", "step-*.manifest"))]
        for rank in ranks]
    return min(max(s, default=-1) for s in steps)


def restored_from(shown: dict) -> dict[str, int]:
    """Ranks of the running attempt by where their load found its copy, as status has it."""
    found: dict[str, int] = {}
    for n in shown["nodes"]:
        for load in ((n.get("checkpoint") or {}).get("restored") or {}).values():
            found[load["source"]] = found.get(load["source"], 0) + 1
    return found


def lost_node_resumes_from_its_buddy(job_id: str, out, before_kill=None,
                                     while_resumed=None) -> dict:
    """Node rank 1's agent SIGKILLed once rank 3 saved step 15: the job must succeed, every
    rank resuming the same step (from memory, and the lost ranks from their replicas), with
    the weights of a run that never failed, nothing left running and no memory left. The
    SSH and Slurm tests (tests/cluster/) run the same."""
    wait_for_output(job_id, "rank 3 step 15 saved", 1, timeout=120)
    shown = orchestrator.status(job_id)
    if before_kill is not None:
        before_kill(shown)
    buddy = next(n["node_index"] for n in shown["nodes"] if n["node_rank"] == 0)

    def replicated(rank: int) -> int:
        found = glob.glob(os.path.join(SHM, f"{job_id}.{buddy}", "replicas", f"rank-{rank}",
                                       "step-*.manifest"))
        return max((int(os.path.basename(f)[5:-9]) for f in found), default=-1)
    # Replication trails the saves by a save or two on a loaded machine: once the buddy holds
    # step 15 of the lost node's ranks, every rank must resume at 15 or later.
    wait_for(lambda: min(replicated(2), replicated(3)) >= 15, 60, what="step 15 replicated")
    lost = next(n for n in shown["nodes"] if n["node_rank"] == 1)
    os.kill(lost["agent_pid"], signal.SIGKILL)  # the agent of this test's job on that node
    if while_resumed is not None:
        wait_for(lambda: while_resumed(orchestrator.status(job_id)), 60, interval=0.05,
                 what="the resumed attempt as status shows it")
    result = orchestrator.wait(job_id, timeout=180)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert result["attempts"][0]["failure"]["cause"] == "NODE_FAIL"
    assert result["attempts"][0]["failure"]["node_index"] == lost["node_index"]
    step = result["attempts"][1]["restored_step"]
    assert step is not None and step >= 15, step
    assert lost["node_index"] not in {r["node_index"] for r in result["ranks"]}
    for rank in range(4):
        assert (out / f"resumed-2-{rank}").read_text() == str(step)
    expected = reference_weights(60, 4)
    for rank in range(4):
        final = torch.load(out / f"final-{rank}.pt")
        for name, value in expected.items():
            assert torch.allclose(final[name], value, atol=1e-6), (rank, name)
    assert_no_job_processes(job_id)
    wait_for(lambda: memory_dirs(job_id) == [], 15, what="every node's memory removed")
    return result


def test_a_lost_nodes_ranks_resume_from_their_replicas_on_its_buddy(tmp_path, home):
    """Three local nodes, nnodes 2 (the third a spare), no checkpoint.dir: node 1's agent is
    SIGKILLed (its workers and its memory go with it). Its ranks' copies live on only as
    replicas on its buddy, node 0; the spare pulls them, and every rank resumes one step,
    the same, with the weights of a run that never failed at the end."""
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "buddy", "nodes": [{"host": "local"}] * 3, "nnodes": 2, "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "ckpt_train.py")], "workdir": str(tmp_path),
        "max_restarts": 1, "restart_backoff": {"initial": 0.1}, "stop_grace_period": 2,
        "env": {"OUT": str(out), "STEPS": "60", "STEP_SLEEP": "0.1", "STATE_MB": "1"}}))

    def replicas_on_node_0(shown: dict) -> None:
        assert [n["spare"] for n in shown["nodes"]] == [False, False, True]
        replicas = glob.glob(os.path.join(SHM, f"{job_id}.0", "replicas", "rank-*"))
        assert sorted(os.path.basename(r) for r in replicas) == ["rank-2", "rank-3"]
        # The spare holds every participant's copies before it is needed.
        def on_spare() -> set[str]:
            return {os.path.basename(os.path.dirname(r)) for r in glob.glob(os.path.join(
                SHM, f"{job_id}.2", "replicas", "rank-*", "step-*.manifest"))}
        wait_for(lambda: on_spare() == {"rank-0", "rank-1", "rank-2", "rank-3"}, 30,
                 what="every rank's replicas on the spare")
        wait_for(lambda: (orchestrator.status(job_id)["nodes"][2]["checkpoint"] or {}).get(
            "replicas", {}).get("ranks") == 4, 30, what="status: the spare's replicas")
    # While attempt 2 runs, status says where each rank's copy came from: the spare's two
    # ranks from the replicas it pulled from the buddy, node 0's from its own memory.
    result = lost_node_resumes_from_its_buddy(
        job_id, out, replicas_on_node_0,
        lambda shown: restored_from(shown) == {"memory": 2, "buddy": 2})
    assert {r["node_index"] for r in result["ranks"]} == {0, 2}
    # The spare took the lost node's place with its copies already in its own replicas.
    log = (home / "jobs" / job_id / "controller.log").read_text()
    assert "(2 ranks from replicas, 2 of them held by the node that runs them)" in log, \
        [ln for ln in log.splitlines() if "resumes checkpoint" in ln]


def test_a_long_job_keeps_replicating_within_its_memory(tmp_path, home):
    """A job of two nodes saving every step, long enough for the saves to fill
    checkpoint.memory many times over: each node's buddy still holds a recent step of its
    ranks at the end, and no node ever holds more than its bound. (The saves kept every step
    from the retained one on while memory allowed: after a few seconds no replica had room,
    the replicas stayed at the step where that happened, and a node's loss would have cost
    every step since; memory went past the bound by the replicas it held.)"""
    out = tmp_path / "out"
    out.mkdir()
    bound = 256 << 20  # room for 4 copies of each rank's 16 MiB and 4 of its buddy's
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "long", "nodes": [{"host": "local"}] * 2, "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "ckpt_train.py")], "workdir": str(tmp_path),
        "checkpoint": {"memory": bound},
        "env": {"OUT": str(out), "STEPS": "300", "STEP_SLEEP": "0.05", "STATE_MB": "16"}}))
    peak = [0, 0]

    def far_on() -> dict | None:
        shown = orchestrator.status(job_id)
        held = [n["checkpoint"] or {} for n in shown["nodes"]]
        for i, h in enumerate(held):
            peak[i] = max(peak[i], h.get("memory_bytes") or 0)
        return shown if all((h.get("newest_in_memory") or 0) >= 200 for h in held) else None
    shown = wait_for(far_on, 150, interval=0.2, what="both nodes past step 200")
    for node in shown["nodes"]:
        held = node["checkpoint"]
        # The buddy's copies lag by the pushes under way only.
        assert held["replicas"]["ranks"] == 2 and \
            held["replicas"]["newest"] >= held["newest_in_memory"] - 60, held
        # And what a loss of the node would cost, as the job runs: its ranks' copies on
        # the other node are as recent.
        assert (held["newest_elsewhere"] or -1) >= held["newest_in_memory"] - 60, held
    assert max(peak) <= bound, peak
    result = orchestrator.wait(job_id, timeout=180)
    assert result["state"] == "SUCCEEDED", result["failure"]


def test_status_says_what_each_save_held_and_where_each_rank_restored_from(tmp_path, home):
    """While the resumed attempt runs: per node the newest save's bytes and the seconds it
    held the training, and per rank which copy it restored and how long that took; the
    same in the text of status and in Prometheus."""
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "shown", "nodes": [{"host": "local"}], "nproc_per_node": 2,
        "command": [PYTHON, str(WORKERS / "ckpt_train.py")], "workdir": str(tmp_path),
        "max_restarts": 1, "restart_backoff": {"initial": 0.1},
        "env": {"OUT": str(out), "CRASH_AT": "5", "STEPS": "60", "STEP_SLEEP": "0.1",
                "STATE_MB": "1"}}))
    seen: dict = {}

    def resumed(shown: dict) -> bool:
        seen.update(shown)
        return shown["attempt"] == 2 and restored_from(shown) == {"memory": 2}
    wait_for(lambda: resumed(orchestrator.status(job_id)), 60, interval=0.05,
             what="both ranks restored from memory")
    held = seen["nodes"][0]["checkpoint"]
    assert {r: load["step"] for r, load in held["restored"].items()} == {"0": 5, "1": 5}
    assert all(0 <= load["seconds"] < 30 and load["skipped"] == 0
               for load in held["restored"].values()), held
    last = held["last_save"]
    assert last["step"] >= 5 and 0 < last["block_s"] < 5, last
    assert last["bytes"] >= 2 << 20, last  # both ranks' state: 1 MiB of it each, and more
    text = subprocess.run([PYTHON, "-m", "orchestrator", "status", job_id], capture_output=True,
                          text=True, timeout=60).stdout
    assert "; restored memory in " in text and " MiB, held " in text, text
    metrics = exposition(home)[0].decode()
    assert f'orchestrator_checkpoint_restored_ranks{{job_id="{job_id}",name="shown",' \
        'source="memory"} 2.0' in metrics, [ln for ln in metrics.splitlines() if "restored" in ln]
    assert "orchestrator_checkpoint_block_seconds{" in metrics
    # The dashboard's attempts say the step each resumed.
    from tests.integration.test_dashboard import _chromium, _render, _Server
    server = _Server(home, auth=True)
    try:
        dom = _render(_chromium(), server.url(f"/jobs/{job_id}"))
    finally:
        server.close()
    assert [text for _, text in dom.find("td", **{"class": "restored-step"})] == ["-", "5"]
    result = orchestrator.wait(job_id, timeout=120)
    assert result["state"] == "SUCCEEDED", result["failure"]


def test_the_same_error_right_after_a_resume_falls_back_to_an_older_checkpoint_once(tmp_path,
                                                                                   home):
    """A copy that verifies but is bad (NaN weights saved at step 6): the first failure
    restarts from it, the same error right after resuming it would end the job
    (stop_on_repeat), but once per job the restart goes to an older checkpoint instead, and
    from there the job trains through."""
    job_id, result, out = run(tmp_path, home, {"POISON_AT": "6", "STEPS": "12"}, restarts=3)
    assert result["state"] == "SUCCEEDED", result.get("failure")
    attempts = result["attempts"]
    assert [a["restored_step"] for a in attempts] == [None, 6, 5], attempts
    assert all("FloatingPointError" in (a["failure"]["signature"] or "") for a in attempts[:2]), \
        [a["failure"] for a in attempts[:2]]
    assert "from a checkpoint older than step 6: the same error twice, after resuming step 6" \
        in attempts[1]["failure"]["decision"], attempts[1]["failure"]
    assert result["restarts"] == 2
    expected_final = torch.load(out / "final-0.pt")
    assert not any(torch.isnan(v).any() for v in expected_final.values())


def test_a_fall_back_happens_once_then_the_same_error_ends_the_job(tmp_path, home):
    """Every checkpoint bad from step 6 on and again after the fall back: the second repeat
    ends the job as stop_on_repeat says, with restarts left."""
    job_id, result, out = run(tmp_path, home, {"POISON_AT": "6", "STEPS": "12",
                                               "POISON_ALWAYS": "1"}, restarts=5)
    assert result["state"] == "FAILED"
    attempts = result["attempts"]
    assert [a["restored_step"] for a in attempts][:2] == [None, 6], attempts
    assert "not restarted: the same error twice" in attempts[-1]["failure"]["decision"]
    assert result["restarts"] < 5


def _dcp_job(tmp_path, name: str, nodes: int, nproc: int, steps: int,
             while_running=None) -> tuple[str, str]:
    """A job of tests/workers/dcp_train.py on ``nodes`` local nodes x ``nproc`` ranks, its
    copies persisted to tmp_path/ck: (its id, what its rank 0 found at the end); with
    ``while_running``, what status shows meanwhile must come to satisfy it."""
    out = tmp_path / f"out-{name}"
    out.mkdir()
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": name, "nodes": [{"host": "local"}] * nodes, "nproc_per_node": nproc,
        "command": [PYTHON, str(WORKERS / "dcp_train.py")], "workdir": str(tmp_path),
        "checkpoint": {"dir": str(tmp_path / "ck"), "persist_every": 1, "keep": 3},
        "env": {"OUT": str(out), "STEPS": str(steps), "STEP_SLEEP": "0.1"}}))
    if while_running is not None:
        wait_for(lambda: while_running(orchestrator.status(job_id)), 60, interval=0.05,
                 what=f"{name}: status while it runs")
    result = orchestrator.wait(job_id, timeout=180)
    assert result["state"] == "SUCCEEDED", result["failure"]
    assert_no_job_processes(job_id)
    return job_id, (out / "final.txt").read_text()


def test_a_dcp_checkpoint_goes_on_in_a_job_of_fewer_ranks_and_then_of_more(tmp_path, home):
    """A DTensor sharded over 4 ranks (2 nodes x 2), saved with checkpoint_dcp every step
    and persisted to one checkpoint.dir (what a shared filesystem gives every node). The same
    training submitted again on 2 ranks, then on 3, resumes from the newest step every old
    rank persisted, resharded (before: "another rank saved it" on 2, and from scratch on 3,
    whose rank 2 held no copy), and ends with every element equal to its number of steps."""
    _, final = _dcp_job(tmp_path, "four", 2, 2, 20)
    assert final == "20.0"
    for name, ranks, steps in (("two", 2, 40), ("three", 3, 60)):
        # Each rank's load, as status shows it: the step resharded, from the persisted copies.
        job_id, final = _dcp_job(tmp_path, name, 1, ranks, steps, lambda shown, n=ranks: {
            (r["step"], r["source"]) for r in ((shown["nodes"][0].get("checkpoint") or {})
                                              .get("restored") or {}).values()} == {
            (19 if n == 2 else 39, "persisted")})
        resumed = [ln for ln in orchestrator.logs(job_id) if "resumed step" in ln]
        assert len(resumed) == ranks, resumed
        assert all(f"in world {ranks}" in ln for ln in resumed), resumed
        assert final == f"{steps}.0", (name, final)
        # The attempt's own record says the step its ranks loaded (time lost counts from it),
        # not the step the controller found among the new ranks' copies (none for 3 ranks).
        restored = [a["restored_step"] for a in orchestrator.status(job_id)["attempts"]]
        assert restored == [19 if ranks == 2 else 39], (name, restored)


@pytest.mark.parametrize("how", [{"launch": "per-node"}, {"rendezvous": {"backend": "c10d"}}])
def test_each_rank_of_a_process_that_runs_a_nodes_ranks_gets_its_share_of_the_memory(
        home, tmp_path, how):
    """One process runs a node's 4 ranks (torchrun under c10d, the user's under per-node):
    the agent took it for one rank, gave each rank the whole of checkpoint.memory, and
    a node's ranks together kept four times what it allows."""
    memory = 64 << 20
    script = tmp_path / "budget.py"  # (torchrun runs a script, not -c)
    script.write_text("import os\n"
                      "print('budget', os.environ['ORCHESTRATOR_CHECKPOINT_MEMORY_BYTES'])\n")
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "share", "nodes": [{"host": "local"}], "nproc_per_node": 4,
        "command": [PYTHON, str(script)],
        "workdir": str(tmp_path), "checkpoint": {"memory": memory}, **how}))
    result = orchestrator.wait(job_id, timeout=120)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-10:])
    budgets = {ln.rsplit(" ", 1)[1] for ln in lines if " budget " in ln}
    assert budgets == {str(memory // 4)}, lines
