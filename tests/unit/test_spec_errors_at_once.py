"""A spec's errors all at once, each where it is: its line and column in the file, or the
``--set`` that wrote it; a missing field names its likely misspelling (issue: a misspelt
``comand:`` said only "command: required field is missing", and the next error came only
after that one was fixed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from orchestrator.errors import SpecError
from orchestrator.spec import parse_jobspec
from tests.helpers import ROOT

THREE = """\
name: three
nodes: [{host: local}]
comand: [python3, train.py]
max_restarts: two
health: {heartbeat_interval: 0}
"""


def test_every_error_at_once_each_with_its_line():
    with pytest.raises(SpecError) as caught:
        parse_jobspec(THREE)
    shown = [f"{p}{p.where}" for p in caught.value.problems]
    assert len(shown) == 4, shown
    assert any(s.startswith("comand: unknown field; did you mean 'command'?") and
               s.endswith("(line 3, column 1)") for s in shown), shown
    assert any(s.startswith("command: required field is missing; is 'comand' (line 3) a "
                            "misspelling of it?") for s in shown), shown
    assert any(s.startswith("max_restarts: ") and "(got 'two')" in s and
               s.endswith("(line 4, column 1)") for s in shown), shown
    assert any(s.startswith("health.heartbeat_interval: ") and
               s.endswith("(line 5, column 10)") for s in shown), shown


def test_an_error_a_set_made_says_which_set():
    spec = "name: s\nnodes: [{host: local}]\ncommand: [x]\nmax_restarts: 1\n"
    with pytest.raises(SpecError) as caught:
        parse_jobspec(spec, overrides=["max_restarts=two", "health.node_timeout=-1"])
    shown = {f"{p}{p.where}" for p in caught.value.problems}
    assert any(s.startswith("max_restarts:") and s.endswith("(from --set max_restarts=two)")
               for s in shown), shown
    assert any(s.startswith("health.node_timeout:") and
               s.endswith("(from --set health.node_timeout=-1)") for s in shown), shown


def test_the_cli_prints_one_error_line_per_problem(tmp_path):
    path = tmp_path / "three.yaml"
    path.write_text(THREE)
    run = subprocess.run([sys.executable, "-m", "orchestrator", "submit", str(path),
                          "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                              "ORCHESTRATOR_HOME": str(tmp_path / "home")})
    assert run.returncode == 2, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 4 and all(ln.startswith("error: ") for ln in lines), lines
    assert "Traceback" not in run.stderr
