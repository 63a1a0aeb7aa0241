"""The submitter's world kept with a job: its soft limits travel with it, come back only in
the children that start an agent, and an older record (none kept) changes nothing."""

from __future__ import annotations

import resource
import subprocess
import sys

from orchestrator.world import UserWorld

NOFILE = resource.RLIMIT_NOFILE
SOFT = "import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"


def soft_in_child(world: UserWorld) -> int:
    run = subprocess.run([sys.executable, "-c", SOFT], capture_output=True, text=True,
                         timeout=30, preexec_fn=world.restore_limits())
    assert run.returncode == 0, run.stderr
    return int(run.stdout)


def test_soft_limits_round_trip_and_an_older_record_restores_nothing():
    world = UserWorld.capture()
    assert world.soft_limits == {"RLIMIT_NOFILE": resource.getrlimit(NOFILE)[0]}
    assert UserWorld.from_dict(world.to_dict()) == world
    assert world.restore_limits() is None  # nothing differs: the fast spawn stays
    older = UserWorld.from_dict({"env": {"A": "1"}, "umask": 0o022})
    assert older.soft_limits == {} and older.restore_limits() is None


def test_a_child_gets_the_kept_soft_limit_within_this_process_hard_limit():
    soft, hard = resource.getrlimit(NOFILE)
    lower = min(soft, 1000 if hard == resource.RLIM_INFINITY else hard) - 1
    assert soft_in_child(UserWorld({}, 0o022, {"RLIMIT_NOFILE": lower})) == lower
    assert resource.getrlimit(NOFILE) == (soft, hard)  # never this process's own
    if hard != resource.RLIM_INFINITY:  # more than the hard limit allows: the hard one
        above = UserWorld({}, 0o022, {"RLIMIT_NOFILE": resource.RLIM_INFINITY})
        assert soft_in_child(above) == hard
