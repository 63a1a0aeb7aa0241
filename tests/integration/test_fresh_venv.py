"""The README's first command, in a brand-new venv: what a newcomer runs first.

``pip install torch==2.13.0 && pip install -e . && orchestrator submit jobspecs/local-ddp.yaml
--follow``, with nothing else installed: numpy only because we depend on it (torch does not,
and warns in every rank without it), no system site-packages. pip reuses its cache, so torch
is not downloaded again.

It takes under a minute (about 45 s), so a developer may deselect it locally with
``ORCHESTRATOR_SKIP_VENV_TEST=1``; under ``CI=true`` it always runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, assert_no_job_processes

SKIP = os.environ.get("CI") != "true" and bool(os.environ.get("ORCHESTRATOR_SKIP_VENV_TEST"))

pytestmark = pytest.mark.skipif(
    SKIP, reason="ORCHESTRATOR_SKIP_VENV_TEST is set (outside CI): fresh-venv install skipped")


def _venv_env(venv, home) -> dict[str, str]:
    """The environment of a shell where the new venv is activated, and nothing leaks in."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV",
                        "CONDA_PREFIX", "PIP_USER", "PIP_TARGET", "PIP_PREFIX")
           and not k.startswith("ORCHESTRATOR_")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", os.defpath)])
    env["ORCHESTRATOR_HOME"] = str(home)
    return env


def _run(argv, env, timeout, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], env=env, timeout=timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)


def test_readme_first_command_in_fresh_venv(home, tmp_path):
    venv = tmp_path / "venv"
    try:
        _check_readme_first_command(venv, home)
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # about 1 GB; pytest would keep 3 runs of it


def _check_readme_first_command(venv, home) -> None:
    env = _venv_env(venv, home)
    timings = {}

    def step(name, argv, timeout, **kwargs):
        started = time.monotonic()
        result = _run(argv, env, timeout, **kwargs)
        timings[name] = round(time.monotonic() - started, 1)
        return result

    result = step("venv", [sys.executable, "-m", "venv", venv], 120)
    assert result.returncode == 0, result.stdout[-4000:]
    python = venv / "bin" / "python"
    # "python3" in the job's command must be the venv's, as in an activated shell.
    assert shutil.which("python3", path=env["PATH"]) == str(venv / "bin" / "python3")
    # pip's cache (filled by the CI's own install of torch) serves the wheels.
    for name, target in (("pip torch", ["torch==2.13.0"]), ("pip -e", ["-e", ROOT])):
        result = step(name, [python, "-m", "pip", "install", "-q", *target], 600)
        assert result.returncode == 0, (name, result.stdout[-4000:])

    result = step("submit", [venv / "bin" / "orchestrator", "submit", "jobspecs/local-ddp.yaml",
                             "--follow"], 300, cwd=ROOT)
    out = result.stdout
    found = re.search(r"submitted (\S+)", out)
    job_id = found.group(1) if found else None
    print(f"fresh-venv timings (s): {timings}")
    try:
        assert "Numpy is not available" not in out, out[-4000:]
        # The first screen is the job's, not torch's warnings.
        assert "Failed to initialize NumPy" not in out, out[-4000:]
        assert result.returncode == 0, (result.returncode, out[-4000:])
        assert job_id, out[-4000:]
        assert re.search(r"^\[local:0\] epoch 2 loss \d", out, re.M), out[-4000:]
        digests = dict(re.findall(r"^\[local:\d\] rank (\d) final weights (\w+)", out, re.M))
        assert sorted(digests) == ["0", "1", "2", "3"], out[-4000:]
        assert len(set(digests.values())) == 1, digests  # every rank ends with the same model
        assert f"{job_id}: SUCCEEDED" in out, out[-4000:]
        assert_no_job_processes(job_id)
    finally:
        # The example checkpoints into <repo>/checkpoints/<job id> (git ignores it): remove it.
        if job_id and re.fullmatch(r"[a-z0-9-]+", job_id):
            shutil.rmtree(ROOT / "checkpoints" / job_id, ignore_errors=True)
            try:
                (ROOT / "checkpoints").rmdir()  # only if nothing else is in it
            except OSError:
                pass
