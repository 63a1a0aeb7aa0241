"""A worker that tells how it was started, to compare a warm start with a cold one
(tests/integration/test_warm_restarts.py): what tests/workers/world.py dumps, and what only a
script sees of its own start: ``__main__``'s globals at its first line, ``__file__``,
``__loader__``, ``sys.orig_argv``, signal handlers, threads, a module beside it, a class of
``__main__`` through pickle, and which big modules were already imported. Writes
``<out>/attempt-<N>/world-<RANK>.json``; on the first attempt rank 0 then waits for
``<out>/fail`` and exits 3 (the other ranks wait to be stopped); ``WARM_RAISE=1``: raises
instead, in every attempt; ``WARM_HOLD=1``: a later attempt's workers run until stopped."""
START = {k: type(v).__name__ for k, v in globals().items()}  # first, before any import
PRELOADED = sorted(m for m in ("torch", "torch._dynamo", "numpy")
                   if m in __import__("sys").modules)

import json  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import warm_helper  # noqa: E402  (beside this file, found through sys.path[0])


class Thing:
    def __init__(self, n):
        self.n = n


def umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def proc_status(*keys):
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = value.strip()
    return out


main = sys.modules["__main__"]
world = {
    "start_globals": START,
    "preloaded": PRELOADED,
    "name": __name__,
    "file": __file__,
    "loader": [type(__loader__).__name__, getattr(__loader__, "path", None)],
    "spec": None if __spec__ is None else [__spec__.name, __spec__.origin,
                                           type(__spec__.loader).__name__],
    "main_is_globals": main.__dict__ is globals(),
    "argv": sys.argv,
    "orig_argv": getattr(sys, "orig_argv", None),
    "sys_path": sys.path,
    "env": dict(os.environ),
    "cwd": os.getcwd(),
    "umask": umask(),
    "nice": os.getpriority(os.PRIO_PROCESS, 0),
    "rlimits": {n: list(resource.getrlimit(getattr(resource, n)))
                for n in dir(resource) if n.startswith("RLIMIT_")},
    "signals": proc_status("SigIgn", "SigBlk"),
    "handlers": {s: repr(signal.getsignal(getattr(signal, s)))
                 for s in ("SIGINT", "SIGTERM", "SIGPIPE", "SIGUSR1", "SIGUSR2")},
    "flags": {n: getattr(sys.flags, n) for n in dir(sys.flags)
              if not n.startswith("_") and n not in ("count", "index")},
    "executable": sys.executable,
    "helper": warm_helper.__file__,
    "pickled": pickle.loads(pickle.dumps(Thing(7))).n,
    "threads": sorted(t.name for t in threading.enumerate()),
    "open_fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "pid": os.getpid(),
}
out = os.path.join(sys.argv[-1], "attempt-" + os.environ["ORCHESTRATOR_ATTEMPT"])
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "world-" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(world, f)
print("world of rank " + os.environ["RANK"] + " written", flush=True)
first = os.environ["ORCHESTRATOR_ATTEMPT"] == "1"
if first:  # rank 0 fails when told; the others are stopped
    while not os.path.exists(os.path.join(sys.argv[-1], "fail")) or os.environ["RANK"] != "0":
        time.sleep(0.05)
if os.environ.get("WARM_RAISE"):  # the same line and message in every attempt
    warm_helper.fail("on purpose")
if os.environ.get("WARM_HOLD") and not first:  # a warm worker that runs until it is killed
    time.sleep(600)
sys.exit(3 if first else 0)
