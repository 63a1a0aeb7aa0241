"""A node's checkpoint memory outlives an agent killed together with its watchdog (a Slurm
step's end, an OOM kill of the tree): the next agent of this user on the node removes it
(agents/paths.py: sweep_memory), and never a live agent's."""

from __future__ import annotations

import os
import time

from agents.paths import OWNER_NAME, UNOWNED_FOR, own_memory, sweep_memory


def test_the_memory_of_dead_agents_goes_and_a_live_ones_stays(tmp_path):
    base = tmp_path / "orchestrator-0"
    roots = {name: base / name for name in ("job-a.0", "job-b.1", "job-c.0", "job-d.2",
                                            "mine.0")}
    for root in roots.values():
        (root / "rank-0").mkdir(parents=True)
        (root / "rank-0" / "slot-0").write_bytes(b"x" * 100)
    live = own_memory(str(roots["job-a.0"]))  # a live agent's
    dead = own_memory(str(roots["job-b.1"]))
    os.close(dead)  # its agent (and watchdog) died: the lock went with them
    old = time.time() - UNOWNED_FOR - 60  # job-d.2: no owner file, untouched for a day
    os.utime(roots["job-d.2"], (old, old))
    (base / "not-a-root").mkdir()  # not a name an agent makes: left alone
    try:
        removed = sweep_memory(str(roots["mine.0"]))
        assert sorted(os.path.basename(p) for p in removed) == ["job-b.1", "job-d.2"]
        assert sorted(os.listdir(base)) == ["job-a.0", "job-c.0", "mine.0", "not-a-root"]
        assert os.path.exists(roots["job-a.0"] / OWNER_NAME)
        assert not [n for n in os.listdir(roots["job-a.0"]) if n.startswith(OWNER_NAME + ".")]
    finally:
        os.close(live)
