"""Descriptors are a budget: a job of 2,000 ranks runs under the common limit of 1,024 open
files (every rank's log held open would take 2,000), and running out anyway is said with
the limit named (the supervisor ends a job whose controller keeps dying of it)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

from tests.helpers import ROOT

SIMULATE = f"""
import json, logging, sys
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
logging.basicConfig(level=logging.WARNING)
from bench_scale import simulate
result = simulate(250, nproc=8, lines_per_s=1, node_timeout=3, steady=1.0,
                  after_restart=1.0, home=sys.argv[1], timeout=240)
print(json.dumps({{"ranks": result["ranks_started"], "lines": result["lines"]}}))
"""


def limited(soft: int, hard: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_2000_fake_ranks_under_a_limit_of_1024_descriptors(tmp_path):
    run = subprocess.run([sys.executable, "-c", SIMULATE, str(tmp_path)], capture_output=True,
                         text=True, timeout=400, preexec_fn=limited(1024, 1024))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # Every rank of both attempts started, and every line of every rank was checked in its
    # log (simulate raises otherwise).
    assert result["ranks"] == {"1": 2000, "2": 1992} and result["lines"] > 2000, result


def test_running_out_of_descriptors_fails_the_job_once_naming_the_limit(tmp_path):
    script = f"""
import logging, sys
sys.path.insert(0, {str(ROOT)!r})
logging.basicConfig(level=logging.WARNING)
from orchestrator import controller
from orchestrator.spec import parse_jobspec
from orchestrator.store import Store
from orchestrator.transport.fake import FakeCluster
from orchestrator.supervisor import _one_line
controller.log_files_budget = lambda nodes: 10 ** 6  # as if there were no budget
spec = parse_jobspec('''
name: emfile
nodes: [{{host: a}}, {{host: b}}]
nproc_per_node: 400
command: [train]
max_restarts: 3
restart_backoff: {{initial: 0.1, max: 0.1}}
''')
store = Store(sys.argv[1] + "/home")
store.create_job("emfile-000001", "emfile", spec.model_dump_json(), sys.argv[1], 3, ["a", "b"])
cluster = FakeCluster(lines_per_s=2, run=True)
try:
    controller.Controller(store, "emfile-000001", spec, sys.argv[1], cluster).run()
except OSError as exc:  # crash-only: the workers go on, the supervisor decides
    job = store.get_job("emfile-000001")
    print(job.state.value, job.restarts, _one_line(exc))
"""
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, preexec_fn=limited(512, 512))
    assert run.returncode == 0, run.stderr[-3000:]
    state, restarts, message = run.stdout.strip().split(" ", 2)
    # Not FAILED by the controller itself any more: it is crash-only, and a supervisor
    # whose controllers keep failing so ends the job CONTROLLER_FAILED with this line
    # (tests/integration/test_endurance.py), without charging a restart.
    assert state in ("LAUNCHING", "RUNNING") and restarts == "0", run.stdout
    assert "too many open files" in message and "limit of 512 descriptors" in message
