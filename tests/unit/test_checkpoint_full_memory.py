"""A node's shared memory full at a save: the save is skipped and said once, and training
goes on, the newest save kept (before: the copy into a slot whose pages tmpfs could not give
was a SIGBUS, the worker's end)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from agents.shims import orchestrator_checkpoint_format as F
from tests.helpers import ROOT
from tests.integration.test_endurance import small_disk

WORKER = textwrap.dedent("""
    import torch
    from agents.shims import orchestrator_checkpoint as ckpt
    state = {"w": torch.zeros(3 << 18)}  # 3 MiB: one copy fits the 4 MiB memory, two do not
    assert ckpt.save(1, state) > 0
    assert ckpt.save(2, state) == 0.0  # no room: skipped
    assert ckpt.save(3, state) == 0.0
    print("trained on", flush=True)
""")


def test_a_save_with_no_room_left_is_skipped_and_training_goes_on(tmp_path):
    with small_disk(tmp_path / "shm", "4m") as memory:
        (memory / "rank-0").mkdir()
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RANK": "0",
               F.MEMORY_VAR: str(memory), F.BUDGET_VAR: str(1 << 30)}
        run = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, (run.returncode, run.stderr)  # -7: SIGBUS
        assert run.stdout == "trained on\n"
        said = [ln for ln in run.stderr.splitlines() if "no room" in ln]
        assert len(said) == 1 and "step 2" in said[0], run.stderr
        assert sorted(n for n in (memory / "rank-0").iterdir() if n.suffix == ".meta") == \
            [memory / "rank-0" / "step-1.meta"]
