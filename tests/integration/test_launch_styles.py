"""The ways real projects launch, each a real job on local nodes: a script with modules and a
package beside it, ``python -m pkg.mod`` with relative imports, a src-layout project installed
by ``setup:`` into a venv, legacy ``--local_rank``/``--local-rank`` scripts, PyTorch
Lightning and Hugging Face Accelerate (which must see torchrun's world and spawn nothing),
and a script that starts its own workers on each node (``launch: per-node``)."""

from __future__ import annotations

import re
import shlex
import shutil
import site
import sys

import orchestrator
from tests.helpers import PYTHON, ROOT, WORKERS, assert_no_job_processes, write_spec

PROJECTS = ROOT / "tests" / "projects"


def local_spec(tmp_path, command, workdir, *, nodes=2, nproc=2, **extra):
    return write_spec(tmp_path, {
        "name": "styles", "nodes": [{"host": "local"}] * nodes, "nproc_per_node": nproc,
        "command": command, "workdir": str(workdir), "stop_grace_period": 2,
        "launch_timeout": 120, **extra})


def run(spec, timeout=180):
    job_id = orchestrator.submit(spec)
    result = orchestrator.wait(job_id, timeout=timeout)
    lines = list(orchestrator.logs(job_id))
    assert result["state"] == "SUCCEEDED", (result["failure"], lines[-15:])
    assert_no_job_processes(job_id)
    return result, lines


def copy_project(tmp_path, name):
    target = tmp_path / name
    shutil.copytree(PROJECTS / name, target)
    return target


def test_a_script_importing_a_module_and_a_package_beside_it(home, tmp_path):
    project = copy_project(tmp_path, "twofile")
    # Run from elsewhere, by relative path: the script's directory is what matters.
    _, lines = run(local_spec(tmp_path, [PYTHON, "twofile/train.py"], tmp_path))
    found = sorted(ln.split("] ", 1)[1] for ln in lines if "two-file" in ln)
    assert found == [f"two-file rank {r}/4 sum 60" for r in range(4)], lines[-10:]
    assert project.exists()


def test_python_dash_m_with_relative_imports(home, tmp_path):
    project = copy_project(tmp_path, "twofile")
    _, lines = run(local_spec(tmp_path, [PYTHON, "-m", "mypkg.train"], project))
    found = [ln for ln in lines if "module rank" in ln]
    assert len(found) == 4 and all("sum 6 from __main__ in mypkg" in ln for ln in found), found


def running_interpreters_site_dirs(tmp_path):
    """A .pth that gives a venv the site directories of the interpreter running the tests,
    in its order: the system python's (as CI runs them) or a venv's, with or without
    --system-site-packages (``--system-site-packages`` alone would give a venv made from a
    venv the base interpreter's, which may have no torch, and a setuptools without
    bdist_wheel). Through site.addsitedir, so their own .pth files work as they do here."""
    sites = set(site.getsitepackages()) | {site.getusersitepackages()}
    pth = tmp_path / "running-interpreter.pth"
    pth.write_text("".join(f"import site; site.addsitedir({d!r})\n"
                           for d in dict.fromkeys(p for p in sys.path if p in sites)))
    return pth


def test_a_src_layout_project_installed_by_setup_into_a_venv(home, tmp_path):
    project = copy_project(tmp_path, "srclayout")
    # The venv sees the torch, pip and setuptools of the interpreter running the tests (a
    # venv's own, bundled ones are older, and there is no torch); nothing is fetched (tests
    # stay off the network).
    site_packages = f".venv/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
    setup = [f"{shlex.quote(PYTHON)} -m venv --without-pip .venv",
             f"cp {shlex.quote(str(running_interpreters_site_dirs(tmp_path)))} {site_packages}/",
             ".venv/bin/python -m pip install -q --no-index --no-build-isolation -e ."]
    _, lines = run(local_spec(tmp_path, [".venv/bin/python", "-m", "tinyproj.train"],
                              project, setup=setup), timeout=300)
    found = [ln for ln in lines if "src-layout rank" in ln]
    assert len(found) == 4, lines[-10:]
    for line in found:
        assert "sum 12 from " in line and f"{project}/src/tinyproj/__init__.py" in line, line
        assert f"prefix {project}/.venv" in line, line


def test_legacy_launch_scripts_with_either_spelling_of_local_rank(home, tmp_path):
    _, lines = run(local_spec(tmp_path, [PYTHON, str(ROOT / "examples" / "legacy_launch.py"),
                                         "--local_rank=${local_rank}"], tmp_path))
    assert sum(bool(re.search(r"legacy rank \d/4 local_rank \d sum 6", ln)) for ln in lines) == 4
    _, lines = run(local_spec(tmp_path, [PYTHON, str(WORKERS / "legacy_local_rank.py"),
                                         "--local-rank=${local_rank}"], tmp_path))
    seen = {m.groups() for ln in lines if (m := re.search(r"local-rank (\d) of rank (\d)", ln))}
    assert seen == {("0", "0"), ("1", "1"), ("0", "2"), ("1", "3")}


def framework_lines(lines, tag):
    return [dict(kv.split("=", 1) for kv in ln.split(f"{tag} ", 1)[1].split())
            for ln in lines if f"] {tag} " in ln]


def test_lightning_ddp_sees_torchrun_and_spawns_nothing(home, tmp_path):
    result, lines = run(local_spec(tmp_path, [PYTHON, str(WORKERS / "lightning_train.py"),
                                              "--num-nodes", "2", "--devices", "2"], tmp_path),
                        timeout=300)
    seen = framework_lines(lines, "LIGHTNING")
    assert sorted(int(s["rank"]) for s in seen) == [0, 1, 2, 3], lines[-15:]
    pids = {r["rank"]: r["pid"] for r in result["ranks"]}
    for s in seen:
        assert s["world"] == "4" and s["env_rank"] == s["rank"]
        assert s["cluster"] == "TorchElasticEnvironment" and s["steps"] == "4"
        # The process that trained is the one the agent started: Lightning launched nothing.
        assert int(s["pid"]) == pids[int(s["rank"])]


def test_accelerate_sees_torchrun_and_spawns_nothing(home, tmp_path):
    result, lines = run(local_spec(tmp_path, [PYTHON, str(WORKERS / "accelerate_train.py")],
                                   tmp_path), timeout=300)
    seen = framework_lines(lines, "ACCELERATE")
    assert sorted(int(s["rank"]) for s in seen) == [0, 1, 2, 3], lines[-15:]
    pids = {r["rank"]: r["pid"] for r in result["ranks"]}
    for s in seen:
        assert s["world"] == "4" and s["type"] == "MULTI_CPU" and s["backend"] == "gloo"
        assert s["local"] == str(int(s["rank"]) % 2)
        assert int(s["pid"]) == pids[int(s["rank"])]
    assert len({s["weights"] for s in seen}) == 1  # gradients were all-reduced


def test_a_script_that_starts_its_own_workers_per_node(home, tmp_path):
    result, lines = run(write_spec(tmp_path, {
        **__import__("yaml").safe_load((ROOT / "jobspecs" / "per-node.yaml").read_text()),
        "command": [PYTHON, str(ROOT / "examples" / "per_node_spawn.py"),
                    "--master_addr", "${master_addr}", "--master_port", "${master_port}",
                    "--world_size", "${world_size}", "--start_rank", "${node_start_rank}",
                    "--num_gpus", "${nproc_per_node}"],
        "workdir": str(tmp_path)}))
    found = {int(m.group(2)): (m.group(1), m.group(3), m.group(4)) for ln in lines
             if (m := re.match(r"\[local:(node\d)\] per-node rank (\d)/4 local (\d) "
                               r"final weights (\w+)", ln))}
    # Node 0's process owns ranks 0-1, node 1's ranks 2-3; all trained the same model.
    assert {r: v[:2] for r, v in found.items()} == {
        0: ("node0", "0"), 1: ("node0", "1"), 2: ("node1", "0"), 3: ("node1", "1")}, lines
    assert len({v[2] for v in found.values()}) == 1
    assert result["attempts"][0]["world_size"] == 4 and result["ranks"] == []
