"""``orchestrator.checkpoint_hf.OrchestratorCheckpointCallback`` in a real job
(docs/guides/checkpoints.md): two local nodes of two ranks train a tiny model with the Hugging
Face Trainer (no download, no network), saving every step; a rank SIGKILLed right after the
save of global step 8 (first attempt only) is restarted with every other rank at step 8,
through the directory ``resume(trainer)`` writes in memory, and the job ends with the state of
the same job that was never interrupted: weights (AdamW and the linear schedule behind them),
the data skipped in the epoch, dropout's RNG, the log history saved."""

from __future__ import annotations

import glob
import os

import torch

import orchestrator
from tests.helpers import PYTHON, WORKERS, assert_no_job_processes, wait_for, write_spec

SHM = f"/dev/shm/orchestrator-{os.getuid()}"
CRASH_AT = 8  # 6 steps an epoch: the resume skips two batches of the second epoch


def run(tmp_path, name: str, env: dict) -> tuple[str, dict, object]:
    out = tmp_path / name
    out.mkdir()
    job_id = orchestrator.submit(write_spec(tmp_path, {
        "name": "hf-ckpt", "nodes": [{"host": "local"}, {"host": "local"}],
        "nproc_per_node": 2, "command": [PYTHON, str(WORKERS / "hf_trainer_ckpt_train.py")],
        "workdir": str(tmp_path), "max_restarts": 1, "restart_backoff": {"initial": 0.1},
        "stop_grace_period": 2, "env": {"OUT": str(out), "HF_HUB_OFFLINE": "1", **env}},
        f"{name}.yaml"))
    result = orchestrator.wait(job_id, timeout=240)
    assert_no_job_processes(job_id)
    wait_for(lambda: glob.glob(os.path.join(SHM, f"{job_id}.*")) == [], 15,
             what="the nodes' checkpoint memory removed")
    return job_id, result, out


def test_every_rank_resumes_the_saved_step_and_ends_as_a_run_never_killed(tmp_path, home):
    job_id, result, out = run(tmp_path, "killed", {"CRASH_AT": str(CRASH_AT), "CRASH_RANK": "3"})
    assert result["state"] == "SUCCEEDED", result.get("failure")
    assert len(result["attempts"]) == 2, result["attempts"]
    assert result["attempts"][0]["failure"]["cause"] == "WORKER_FAILED"
    assert result["attempts"][1]["restored_step"] == CRASH_AT
    for rank in range(4):
        assert (out / f"resumed-1-{rank}").read_text() == "0"  # a fresh start
        assert (out / f"resumed-2-{rank}").read_text() == str(CRASH_AT), rank
    _, reference, expected = run(tmp_path, "reference", {})
    assert reference["state"] == "SUCCEEDED", reference.get("failure")
    assert len(reference["attempts"]) == 1
    for rank in range(4):
        final, want = (torch.load(d / f"final-{rank}.pt") for d in (out, expected))
        assert final["global_step"] == want["global_step"] == 12
        assert final["resume_dir_left"] is None  # the callback removed what it wrote
        assert final["lr"] == want["lr"], rank
        assert torch.equal(final["rng"], want["rng"]), rank
        # The loss logged at step 5 came back with the trainer state (later ones average
        # only the steps since the resume, as with the Trainer's own checkpoints).
        assert [e for e in final["losses"] if e[0] <= CRASH_AT] == \
            [e for e in want["losses"] if e[0] <= CRASH_AT] != [], (final["losses"], want["losses"])
        for name, value in want["model"].items():
            assert torch.allclose(final["model"][name], value, atol=1e-6), (rank, name)
