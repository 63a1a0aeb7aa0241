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
