"""Writes this worker's world to ``<out>/world-<RANK>.json`` and exits 0: its environment,
sys.path, cwd, umask, resource limits, signal dispositions and interpreter flags, everything a
script could notice about how it was started. Run under torchrun and under the orchestrator,
the two dumps are compared key by key (tests/world.py)."""
import json
import os
import resource
import sys
import time

# WORLD_HOLD_ONCE=<path>: the first run of each rank only holds (a test then replaces the
# controller), the next one writes its world.
hold = os.environ.get("WORLD_HOLD_ONCE")
if hold and not os.path.exists(f"{hold}-{os.environ.get('RANK')}"):
    open(f"{hold}-{os.environ.get('RANK')}", "w").close()
    print("holding", flush=True)
    time.sleep(600)


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def signal_masks() -> dict[str, str]:
    """Ignored and blocked signals (inherited across exec, unlike handlers)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("SigIgn", "SigBlk"):
                out[key] = value.strip()
    return out


limits = {name: list(resource.getrlimit(getattr(resource, name)))
          for name in dir(resource) if name.startswith("RLIMIT_")}
world = {
    "env": dict(os.environ),
    "sys_path": sys.path,
    "cwd": os.getcwd(),
    "umask": umask(),
    "nice": os.getpriority(os.PRIO_PROCESS, 0),  # (this thread's: the one it started with)
    "rlimits": limits,
    "signals": signal_masks(),
    "flags": {name: getattr(sys.flags, name) for name in dir(sys.flags)
              if not name.startswith("_") and name not in ("count", "index")},
    "argv": sys.argv,
    "executable": sys.executable,
}
out = sys.argv[1]
with open(os.path.join(out, f"world-{os.environ.get('RANK', 'x')}.json"), "w") as f:
    json.dump(world, f)
print(f"world of rank {os.environ.get('RANK')} written", flush=True)
