"""Imported by every Python worker at start (the agent puts this file's directory on the
workers' PYTHONPATH): a faulthandler hook, so that the agent can ask for a stack without
ptrace (SIGUSR2 writes all threads' stacks to a file); a sampler that tells how much of the
time the rank waits in collectives (orchestrator/diagnosis.stragglers) and dumps torch's
flight recorder when the agent asks; then whatever ``sitecustomize`` this one hides.

Stdlib only, any Python 3, and never the worker's problem: every step is guarded, nothing
is printed, nothing is imported from torch that the worker has not imported itself.
"""
import os
import sys


def _orchestrator_hook():
    stack_dir = os.environ.get("ORCHESTRATOR_STACK_DIR")
    if stack_dir and os.environ.get("RANK"):
        import faulthandler
        import signal
        if signal.getsignal(signal.SIGUSR2) is not signal.SIG_DFL:
            return  # ignored where it was started (as under torchrun), or the worker's own
        path = os.path.join(stack_dir, "stack-%s.txt" % os.environ["RANK"])
        faulthandler.register(signal.SIGUSR2, file=open(path, "a"), all_threads=True,
                              chain=False)
        open(os.path.join(stack_dir, "hook-%d" % os.getpid()), "w").close()


# Straggler sampling (see orchestrator/diagnosis.stragglers): a few times a second, is the
# main thread inside a collective? Under synchronous collectives the rank that makes the others
# wait is the one seldom seen waiting. Counting starts once the process group is up (imports
# and rendezvous say nothing), over a sliding window; one small file a second for the agent.
_COLLECTIVES = frozenset((
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "batch_isend_irecv", "wait_tensor"))
_COLLECTIVE_FILES = ("distributed_c10d.py", "_functional_collectives.py")


def _orchestrator_sampler():
    sample_dir = os.environ.get("ORCHESTRATOR_STACK_DIR")
    rank = os.environ.get("RANK")
    interval = float(os.environ.get("ORCHESTRATOR_SAMPLE_INTERVAL") or 0.1)
    # One sampler a rank: not in processes this worker starts (they inherit the marker).
    if not (sample_dir and rank and interval > 0) or os.environ.get("ORCHESTRATOR_SAMPLED"):
        return
    os.environ["ORCHESTRATOR_SAMPLED"] = rank
    import collections
    import threading
    import time
    main = threading.main_thread().ident
    path = os.path.join(sample_dir, "waits-%s.json" % rank)
    window = collections.deque(maxlen=max(1, int(30.0 / interval)))

    def waiting():
        frame, depth = sys._current_frames().get(main), 0
        while frame is not None and depth < 256:
            code = frame.f_code
            if code.co_name in _COLLECTIVES and code.co_filename.endswith(_COLLECTIVE_FILES):
                return True
            frame, depth = frame.f_back, depth + 1
        return False

    def started():  # torch.distributed initialized (only looked up, never imported here)
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        # While the main thread imports it, the module is there but half-made.
        initialized = getattr(c10d, "is_initialized", None)
        return initialized is not None and initialized()

    trigger = os.path.join(sample_dir, "flight-recorder-wanted")
    dump_prefix = (os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
                   or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))
    handled = [0.0]

    def dump_flight_recorder():
        # Asked by the agent (a hang): write what this rank's flight recorder holds where
        # torch itself dumps on a collective timeout. The main thread may be stuck inside a
        # collective; this thread is not.
        try:
            asked = os.stat(trigger).st_mtime
        except OSError:
            return
        if asked <= handled[0] or not dump_prefix or not started():
            return
        handled[0] = asked
        from torch._C import _distributed_c10d as c
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        nccl = "nccl" in str(c10d.get_backend()) and hasattr(c, "_dump_nccl_trace")
        dump = c._dump_nccl_trace if nccl else c._dump_fr_trace
        path = dump_prefix + rank
        # First without the call sites (at once), then with them: turning those into text
        # imports parts of torch, a second or more of CPU. Then say it is complete.
        for stack_traces in (False, True):
            data = dump(includeStackTraces=stack_traces)
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
        open(os.path.join(sample_dir, "flight-recorder-done-" + rank), "w").close()

    def run():
        next_write = 0.0
        while True:
            time.sleep(interval)
            try:
                dump_flight_recorder()
                w = waiting()
                if window or w or started():
                    window.append(w)
                now = time.monotonic()
                if window and now >= next_write:
                    next_write = now + 1.0
                    with open(path + ".tmp", "w") as f:
                        f.write('{"samples": %d, "waiting": %d, "interval": %g}'
                                % (len(window), sum(window), interval))
                    os.replace(path + ".tmp", path)
            except Exception:
                pass  # never the worker's problem, never a line in its output

    threading.Thread(target=run, name="orchestrator-sampler", daemon=True).start()


def _next_sitecustomize():
    # The one this file hides, run as it would have been (never put in sys.modules twice).
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


for _step in (_orchestrator_hook, _orchestrator_sampler, _next_sitecustomize):
    try:
        _step()
    except Exception:
        pass  # a worker must start, whatever happens here
