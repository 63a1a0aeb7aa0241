"""Which commands a warm standby can become, what of the environment must match, and the
standby itself: a real interpreter started by agents/standby.py, given a script, runs it as
``python script.py`` would (the whole comparison with a cold start is in
tests/integration/test_warm_restarts.py)."""

from __future__ import annotations

import os
import sys

import pytest

from agents import standby
from agents.standby import PythonCommand, Standbys, import_env, parse


@pytest.mark.parametrize("argv, expected", [
    (["python3", "train.py", "--lr", "1"], ((), None, "train.py", ("--lr", "1"))),
    (["/usr/bin/python3.11", "-u", "train.py"], (("-u",), None, "train.py", ())),
    (["python", "-uB", "-X", "dev", "-W", "ignore", "t.py"],
     (("-uB", "-X", "dev", "-W", "ignore"), None, "t.py", ())),
    (["python", "-Xfaulthandler", "-m", "pkg.mod", "a"],
     (("-Xfaulthandler",), "pkg.mod", None, ("a",))),
    (["python", "-mpkg.mod", "-m", "x"], ((), "pkg.mod", None, ("-m", "x"))),
    (["python3", "-O", "-m", "torch.distributed.run", "t.py"],
     (("-O",), "torch.distributed.run", None, ("t.py",))),
])
def test_a_python_command_is_understood(argv, expected):
    command = parse(argv)
    assert command is not None
    assert (command.flags, command.module, command.script, command.args) == expected
    assert command.interpreter == argv[0]


@pytest.mark.parametrize("argv", [
    [], ["bash", "run.sh"], ["torchrun", "t.py"], ["python3", "-c", "print(1)"],
    ["python3", "-"], ["python3"], ["python3", "-u"], ["python3", "-m"], ["python3", "-i", "t.py"],
    ["python3", "-X"], ["python3", "--check-hash-based-pycs", "always", "t.py"],
])
def test_anything_else_starts_cold(argv):
    assert parse(argv) is None


def test_sys_argv_and_path0_are_pythons(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "t.py").write_text("")
    (tmp_path / "link.py").symlink_to(tmp_path / "real" / "t.py")
    script = parse(["python3", "link.py", "a"])
    assert script is not None and script.sys_argv() == ["link.py", "a"]
    assert script.path0(str(tmp_path)) == str(tmp_path / "real")  # realpath, as Python does
    module = parse(["python3", "-m", "pkg", "a"])
    assert module is not None and module.sys_argv() == ["-m", "a"]
    assert module.path0(str(tmp_path)) == str(tmp_path)


def test_what_is_read_at_start_may_differ_and_nothing_else():
    env = {"RANK": "1", "MASTER_PORT": "1", "ORCHESTRATOR_ATTEMPT": "2", "OMP_NUM_THREADS": "1",
           "TORCHELASTIC_ERROR_FILE": "x", "ORCHESTRATOR_JOB_ID": "j", "PYTHONPATH": "p"}
    assert import_env(env) == {"OMP_NUM_THREADS": "1", "ORCHESTRATOR_JOB_ID": "j",
                               "PYTHONPATH": "p"}


def _standbys(tmp_path):
    return Standbys("t" * 32, str(tmp_path))


def test_a_standby_becomes_the_script_it_is_given(tmp_path, capfd):
    work = tmp_path / "work"
    work.mkdir()
    (work / "beside.py").write_text("VALUE = 42\n")
    (work / "t.py").write_text(
        "import sys, os, beside\n"
        "print(__name__, sys.argv, beside.VALUE, os.environ['RANK'], 'torch' in sys.modules,"
        " sys.path[0] == os.path.dirname(os.path.abspath(__file__)))\n"
        "raise SystemExit(5)\n")
    argv = [sys.executable, "t.py", "x"]
    env = {**os.environ, "RANK": "0"}
    pool = _standbys(tmp_path)
    pool.refill(0, argv, env, str(work), ("beside",))
    proc, why = pool.take(0, argv, {**env, "RANK": "3"}, str(work), ("beside",))
    assert why is None and proc is not None
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 5, err
    assert out.decode().split() == ["__main__", "['t.py',", "'x']", "42", "3", "True", "True"]
    pool.close()


def test_a_standby_whose_import_fails_says_why_and_the_worker_starts_cold(tmp_path):
    (tmp_path / "t.py").write_text("")
    argv = [sys.executable, "t.py"]
    pool = _standbys(tmp_path)
    pool.refill(0, argv, dict(os.environ), str(tmp_path), ("no_such_module_here",))
    standby_proc = pool._by_local[0].proc
    standby_proc.wait(timeout=60)
    proc, why = pool.take(0, argv, dict(os.environ), str(tmp_path), ("no_such_module_here",))
    assert proc is None and "import no_such_module_here: ModuleNotFoundError" in why
    pool.refill(0, argv, dict(os.environ), str(tmp_path), ("no_such_module_here",))
    assert 0 not in pool._by_local  # not tried again for the same start
    pool.close()


def test_a_changed_environment_starts_cold_and_names_the_variable(tmp_path):
    (tmp_path / "t.py").write_text("")
    argv = [sys.executable, "t.py"]
    pool = _standbys(tmp_path)
    pool.refill(0, argv, {**os.environ, "MY_SETTING": "1"}, str(tmp_path), ())
    pid = pool._by_local[0].proc.pid
    proc, why = pool.take(0, argv, {**os.environ, "MY_SETTING": "2"}, str(tmp_path), ())
    assert proc is None and "MY_SETTING" in why
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    pool.close()


def test_close_leaves_no_standby(tmp_path):
    (tmp_path / "t.py").write_text("")
    pool = _standbys(tmp_path)
    for local in range(3):
        pool.refill(local, [sys.executable, "t.py"], dict(os.environ), str(tmp_path), ())
    pids = [s.proc.pid for s in pool._by_local.values()]
    assert len(pids) == 3
    pool.close()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}")


def test_the_boot_file_is_shipped_with_the_agent():
    import agents
    assert "agents.shims.standby_boot" in agents.MODULES and "agents.standby" in agents.MODULES
    assert isinstance(standby.PythonCommand, type) and PythonCommand.__doc__


def test_a_standby_for_another_start_is_replaced_and_one_for_the_same_is_kept(tmp_path):
    """A spare told of a new place (its start's environment changed): its standby is ended
    and a new one started; told the same again, the standby stays."""
    (tmp_path / "t.py").write_text("")
    argv = [sys.executable, "t.py"]
    pool = _standbys(tmp_path)
    pool.refill(0, argv, {**os.environ, "MY_SETTING": "1"}, str(tmp_path), ())
    first = pool._by_local[0].proc
    pool.refill(0, argv, {**os.environ, "MY_SETTING": "1"}, str(tmp_path), ())
    assert pool._by_local[0].proc is first
    pool.refill(0, argv, {**os.environ, "MY_SETTING": "2"}, str(tmp_path), ())
    assert pool._by_local[0].proc is not first and first.poll() is not None
    proc, why = pool.take(0, argv, {**os.environ, "MY_SETTING": "2"}, str(tmp_path), ())
    assert proc is not None and why is None
    proc.wait(timeout=30)
    pool.close()
