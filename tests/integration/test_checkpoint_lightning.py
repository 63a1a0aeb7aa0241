"""Lightning on the checkpoint store (orchestrator/checkpoint_lightning.py), as real jobs: 2
local nodes x 2 ranks of Lightning DDP (gloo, CPU) saving every step through
``OrchestratorCheckpoint``; rank 3 SIGKILLs itself right after the save of step 6 in the
first attempt. The job succeeds; the second attempt restores step 6 on every rank (from the
agents' memory), each rank goes on at step 7 (epoch 1, batch 2, data index 6) and trains
7..12; every rank ends with the weights of a run that never failed. The same script under
plain ``torchrun`` (no agent), run again after the kill, resumes from files in
``$ORCHESTRATOR_CHECKPOINT_DIR``."""

from __future__ import annotations

import os
import signal
import subprocess

import torch

import orchestrator
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes, write_spec

WORKER = WORKERS / "lightning_ckpt_train.py"
PER_EPOCH, STEPS, KILLED_AT = 4, 12, 6


def reference_weights(world: int) -> dict[str, torch.Tensor]:
    """What the worker's ranks end with when nothing fails (one process, no Lightning)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    for index in range(STEPS):
        grads = []
        for rank in range(world):
            g = torch.Generator().manual_seed(index * world + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / world
        opt.step()
        sched.step()
    return model.state_dict()


def worker_lines(lines: list[str]) -> list[dict[str, str]]:
    return [dict(kv.split("=", 1) for kv in ln.split("LCKPT ", 1)[1].split() if "=" in kv)
            for ln in lines if "LCKPT " in ln]


def steps_of(seen: list[dict[str, str]], attempt: str, rank: int) -> list[tuple[int, ...]]:
    return [(int(s["step"]), int(s["epoch"]), int(s["batch"]), int(s["data"])) for s in seen
            if s["attempt"] == attempt and s["rank"] == str(rank) and "step" in s]


def expected(steps: range) -> list[tuple[int, ...]]:
    return [(s, (s - 1) // PER_EPOCH, (s - 1) % PER_EPOCH, s - 1) for s in steps]


def check_resumed(seen: list[dict[str, str]], out, world: int) -> None:
    """Every rank started the first attempt fresh and trained 1..6; resumed 6 in the
    second, trained 7..12 on the data it would have had; ended with the reference weights."""
    for rank in range(world):
        resumed = {s["attempt"]: s["resumed"] for s in seen
                   if s["rank"] == str(rank) and "resumed" in s}
        assert resumed == {"1": "0", "2": str(KILLED_AT)}, (rank, resumed)
        # The survivors may have begun step 7 before the kill stopped them.
        assert steps_of(seen, "1", rank)[:KILLED_AT] == expected(range(1, KILLED_AT + 1))
        assert steps_of(seen, "2", rank) == expected(range(KILLED_AT + 1, STEPS + 1)), rank
    reference = reference_weights(world)
    for rank in range(world):
        final = torch.load(out / f"final-{rank}.pt")
        for name, value in reference.items():
            assert torch.allclose(final[name], value, atol=1e-6), (rank, name)


def test_a_killed_rank_resumes_with_every_rank_at_the_step_it_saved(tmp_path, home):
    out = tmp_path / "out"
    out.mkdir()
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "lightning-ckpt", "nodes": [{"host": "local"}, {"host": "local"}],
        "nproc_per_node": 2, "command": [PYTHON, str(WORKER)], "workdir": str(tmp_path),
        "max_restarts": 1, "restart_backoff": {"initial": 0.1}, "stop_grace_period": 2,
        "launch_timeout": 120,
        "env": {"OUT": str(out), "CRASH_AT": str(KILLED_AT), "CRASH_RANK": "3"}}))
    result = orchestrator.wait(job_id, timeout=240)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result.get("failure"), lines[-20:])
    assert [a["restored_step"] for a in result["attempts"]] == [None, KILLED_AT]
    seen = worker_lines(lines)
    assert any(s["rank"] == "3" and s["attempt"] == "1" for s in seen)
    assert any(f"killed after the save of step {KILLED_AT}" in ln for ln in lines)
    check_resumed(seen, out, 4)
    assert_no_job_processes(job_id)


def workers_of(out) -> list[int]:
    """Live processes started with this test's OUT (torchrun starts each worker in a session
    of its own: they outlive a torchrun that is killed)."""
    needle = f"OUT={out}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def torchrun(tmp_path, env: dict[str, str]) -> tuple[int | None, str]:
    proc = subprocess.Popen(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(WORKER)], cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun stops its workers on SIGTERM
        output, _ = proc.communicate(timeout=30)
    return proc.returncode, output


def test_under_plain_torchrun_the_same_script_resumes_from_files(tmp_path):
    out, ckdir = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env.update({"OUT": str(out), "ORCHESTRATOR_CHECKPOINT_DIR": str(ckdir),
                "CRASH_AT": str(KILLED_AT), "CRASH_RANK": "1",
                # Every step kept (the default keeps 2), to see that every save went there.
                "ORCHESTRATOR_CHECKPOINT_KEEP": str(STEPS)})
    # Two torchrun runs, the second started as a user would after the first failed (a
    # torchrun --max-restarts restart failed here under load, in its gloo init).
    try:
        code, first = torchrun(tmp_path, {**env, "ATTEMPT": "1"})
        assert code != 0 and f"killed after the save of step {KILLED_AT}" in first, \
            first[-3000:]
        code, second = torchrun(tmp_path, {**env, "ATTEMPT": "2"})
        assert code == 0, second[-3000:]
    finally:
        left = workers_of(out)
        for pid in left:
            os.kill(pid, signal.SIGKILL)  # this test's workers: they carry its OUT
    assert not left
    check_resumed(worker_lines((first + second).splitlines()), out, 2)
    # Every save went to files, every rank's: none in memory without an agent.
    assert sorted(p.name for p in ckdir.iterdir()) == [
        f"step-{s:012d}" for s in range(1, STEPS + 1)]
    assert {p.name for p in (ckdir / f"step-{STEPS:012d}").iterdir()} == {
        f"rank-{r}.{s}" for r in (0, 1) for s in ("data", "meta", "manifest")}
