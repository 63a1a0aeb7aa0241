"""``orchestrator init`` writes a commented starter spec that validates as written, for this
machine, SSH and Slurm, and never overwrites a file unasked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from orchestrator import starters
from orchestrator.errors import SpecError
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


@pytest.mark.parametrize("kind", ["local", "ssh", "slurm"])
def test_each_commented_field_validates_when_uncommented(tmp_path, kind):
    """A starter's commented lines are offers: taking any one of them (removing its '# ')
    still gives a spec that validates; one offered "instead of" another field is refused
    beside it, by name."""
    import re

    path = starters.write(kind, str(tmp_path / "job.yaml"))
    lines = path.read_text().splitlines()
    offers = [i for i, line in enumerate(lines) if re.match(r"^\s*# [a-z_]+: \S", line)]
    assert len(offers) >= 4, lines
    for i in offers:
        taken = lines[:i] + [lines[i].replace("# ", "", 1)] + lines[i + 1:]
        path.write_text("\n".join(taken) + "\n")
        instead = re.search(r"instead of (\w+)", lines[i])
        if instead is None:
            load_jobspec(path)  # raises SpecError naming the field
            continue
        with pytest.raises(SpecError, match=f"give {instead.group(1)} or"):
            load_jobspec(path)
