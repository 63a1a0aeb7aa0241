"""``orchestrator init`` writes a commented starter spec that validates as written, for this
machine, SSH and Slurm, and never overwrites a file unasked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from orchestrator import starters
from orchestrator.spec import load_jobspec
from tests.helpers import ROOT


@pytest.mark.parametrize("kind", ["local", "ssh", "slurm"])
def test_each_starter_validates_as_written(tmp_path, kind):
    path = starters.write(kind, str(tmp_path / "my_job.yaml"))
    spec = load_jobspec(path)
    assert spec.name == "my-job" and spec.max_restarts == 3
    assert list(spec.command) == ["python3", "train.py"]
    text = path.read_text()
    assert text.count("#") > 8 and "EDIT" in text  # commented, the lines to change marked
    if kind == "slurm":
        assert spec.slurm is not None and spec.slurm.nodes == 2
    else:
        assert [n.is_local for n in spec.nodes] == [kind == "local"] * len(spec.nodes)


def test_init_never_overwrites_unasked_and_says_what_next(tmp_path):
    run = [sys.executable, "-m", "orchestrator", "init", "--ssh", "cluster.yaml"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    first = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                           env={**env, "PYTHONPATH": str(ROOT)})
    assert first.returncode == 0, first.stderr
    assert "orchestrator check cluster.yaml" in first.stderr
    (tmp_path / "cluster.yaml").write_text("mine\n")
    again = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                           env={**env, "PYTHONPATH": str(ROOT)})
    assert again.returncode == 2 and again.stderr.startswith("error: init: cluster.yaml exists")
    assert (tmp_path / "cluster.yaml").read_text() == "mine\n"
