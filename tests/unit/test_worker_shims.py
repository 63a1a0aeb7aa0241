"""The modules the agent writes onto workers' PYTHONPATH are valid Python, and the sitecustomize
shim's sampler counts time spent in collectives (run for real, in a child interpreter)."""

import json
import os
import subprocess
import sys

from agents import source

SITECUSTOMIZE = source("agents.shims.sitecustomize")
WORKER_MODULE = source("agents.shims.orchestrator_worker")


def test_the_shims_compile():
    compile(SITECUSTOMIZE, "sitecustomize.py", "exec")
    compile(WORKER_MODULE, "orchestrator_worker.py", "exec")


def test_the_sampler_counts_waiting_in_a_collective_and_nothing_else(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)
    fake = tmp_path / "torch_fake"  # a module whose file name and function name match c10d's
    fake.mkdir()
    (fake / "distributed_c10d.py").write_text(
        "import time\ndef all_reduce():\n    time.sleep(1.5)\n")
    script = (f"import sys, time\nsys.path.insert(0, {str(fake)!r})\nimport distributed_c10d\n"
              "distributed_c10d.all_reduce()\ntime.sleep(2.5)\n")
    env = {**os.environ, "PYTHONPATH": str(shim), "RANK": "5",
           "ORCHESTRATOR_STACK_DIR": str(tmp_path), "ORCHESTRATOR_SAMPLE_INTERVAL": "0.02"}
    env.pop("ORCHESTRATOR_SAMPLED", None)
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=30)
    report = json.loads((tmp_path / "waits-5.json").read_text())
    share = report["waiting"] / report["samples"]
    # Counting starts at the first collective: 1.5 s waiting, then not (the report is
    # rewritten once a second, so the last one holds 2 to 3 s of the 4).
    assert report["samples"] > 90 and 0.35 < share < 0.8, report


def test_a_half_imported_torch_distributed_neither_stops_the_sampler_nor_prints(tmp_path):
    # The sampler may look while the main thread is still importing torch.distributed: the
    # module is in sys.modules, half made. It must carry on, silently (a worker's stderr is
    # the user's).
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)
    script = ("import sys, time, types\n"
              "m = types.ModuleType('torch.distributed.distributed_c10d')\n"
              "sys.modules[m.__name__] = m\n"
              "time.sleep(0.5)\n"
              "m.is_initialized = lambda: True\n"
              "time.sleep(1.6)\n")
    env = {**os.environ, "PYTHONPATH": str(shim), "RANK": "2",
           "ORCHESTRATOR_STACK_DIR": str(tmp_path), "ORCHESTRATOR_SAMPLE_INTERVAL": "0.02"}
    env.pop("ORCHESTRATOR_SAMPLED", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == "", done
    report = json.loads((tmp_path / "waits-2.json").read_text())
    assert report["samples"] > 20 and report["waiting"] == 0, report


def test_every_module_of_the_agent_is_shipped_and_runs_from_what_is_shipped(tmp_path):
    """A node has nothing installed: the bootstrap must carry every module, and the agent
    must import nothing of ours from anywhere else."""
    from pathlib import Path

    import agents
    from orchestrator.transport.base import BOOTSTRAP, agent_payload

    root = Path(agents.__file__).parent
    on_disk = {".".join(("agents", *p.relative_to(root).with_suffix("").parts))
               .removesuffix(".__init__") for p in root.rglob("*.py")}
    assert on_disk == set(agents.MODULES)
    # Run the bootstrap where no `agents` package can be found, as on a bare node, and have
    # it import every shipped module (a relay told nothing valid answers and exits).
    probe = subprocess.run(
        [sys.executable, "-I", "-c", BOOTSTRAP], input=agent_payload() + b"{}\n",
        capture_output=True, timeout=30, cwd=tmp_path)
    assert b"expected connect" in probe.stdout, probe.stderr.decode()[-2000:]
    imports = "import sys;" + ";".join(f"import {m}" for m in agents.MODULES
                                        if not m.startswith("agents.shims."))
    check = BOOTSTRAP.replace("import agents.main;sys.exit(agents.main.main())",
                              imports + ";print(sorted(n for n in sys.modules "
                              "if n.startswith('agents') and "
                              "getattr(sys.modules[n], '__shipped__', None) is None))")
    run = subprocess.run([sys.executable, "-I", "-c", check], input=agent_payload(),
                         capture_output=True, timeout=30, cwd=tmp_path)
    assert run.stdout.strip() == b"[]", (run.stdout, run.stderr.decode()[-2000:])
