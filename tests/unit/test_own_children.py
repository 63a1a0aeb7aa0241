"""The agent reaps the orphans it adopts as a subreaper (agents/containment.py ``reap_adopted``)
but never a child of its own, whose owner waits for its exit status. A child that exited
before it was registered as the agent's own used to be reaped as adopted, and its owner's
wait then said 0 (subprocess's answer to ECHILD): a preemption_check that failed at once read
as a notice (the drain tests' rare flake: node 0 "noticed" with no output), a worker that
failed at once as one that succeeded."""

from __future__ import annotations

import threading

from agents import containment


def test_a_child_of_our_own_keeps_its_exit_status_while_the_reaper_runs():
    stop = threading.Event()

    def reaper() -> None:  # as the agent's loop does, only as often as it can
        while not stop.is_set():
            containment.reap_adopted()

    thread = threading.Thread(target=reaper, daemon=True)
    thread.start()
    try:
        codes = [containment.run(["/bin/sh", "-c", "exit 3"], 5).returncode for _ in range(100)]
    finally:
        stop.set()
        thread.join(5)
    assert codes == [3] * 100, f"{sum(c != 3 for c in codes)} of 100 read as {set(codes)}"
