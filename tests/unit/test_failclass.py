"""Failure classes and error signatures alone (orchestrator/failclass.py): pure, no cluster."""

from __future__ import annotations

import json

from orchestrator.attempt import Failure
from orchestrator.failclass import FailureClass, classify, same_error, signature
from orchestrator.state import FailureCause

MISSING_IMPORT = [
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "/work/job/train.py", line 4, in <module>',
    "[rank1]:     import mymodel",
    "[rank1]: ModuleNotFoundError: No module named 'mymodel'",
]
# As torch's @record writes it (a real file's shape, from torch 2.13).
ERROR_FILE = json.dumps({"message": {"message": "ValueError: bad value 7", "extraInfo": {
    "py_callstack": 'Traceback (most recent call last):\n  File "/venv/site-packages/torch/'
                    'distributed/elastic/multiprocessing/errors/__init__.py", line 367, in '
                    'wrapper\n    return f(*args, **kwargs)\n           ^^^^^^^^^^^^^^^^^^\n'
                    '  File "/work/job/train.py", line 8, in main\n    inner()\n'
                    '  File "/work/job/model.py", line 7, in inner\n'
                    '    raise ValueError("bad value 7")\nValueError: bad value 7\n',
    "timestamp": "1795561569"}}})


def worker(code=1, sig=None, tail=(), rank=1, step=None, error_file=None):
    return Failure(FailureCause.WORKER_FAILED, "rank failed", rank=rank, exit_code=code,
                   signal=sig, stderr_tail=list(tail), step=step, error_file=error_file)


def test_a_python_exception_is_the_users_with_its_line_as_evidence():
    v = classify(worker(tail=MISSING_IMPORT))
    assert v.klass == FailureClass.USER
    assert v.evidence == "ModuleNotFoundError: No module named 'mymodel'"
    assert classify(worker(code=3)).evidence == "exit code 3"
    assert classify(worker(code=3)).klass == FailureClass.USER


def test_what_the_infrastructure_did():
    killed = classify(worker(code=None, sig="SIGKILL"))
    assert killed.klass == FailureClass.INFRASTRUCTURE and "OOM killer" in killed.evidence
    peer = classify(worker(tail=[
        "[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[10.231.1.11]:30623"]))
    assert peer.klass == FailureClass.INFRASTRUCTURE
    assert peer.evidence.startswith("RuntimeError: [../gloo")  # the rank prefix is gone
    nccl = classify(worker(tail=["torch.distributed.DistBackendError: NCCL error in: x, "
                                 "unhandled system error (run with NCCL_DEBUG=INFO)"]))
    assert nccl.klass == FailureClass.INFRASTRUCTURE
    # Ours: a rank whose copy of the agreed step could not be pulled (agents/pulls.py).
    pulled = classify(worker(tail=[
        "orchestrator_checkpoint_format.CheckpointError: rank 2 has no copy of step 23, the "
        "step every rank was to resume: checkpoint: no copy of step 23 of rank 2 from "
        "10.0.0.2:4001: the peer has no replica of step 23 of rank 2"]))
    assert pulled.klass == FailureClass.INFRASTRUCTURE, pulled
    node = classify(Failure(FailureCause.NODE_FAIL, "b: heartbeats stopped"))
    assert node.klass == FailureClass.INFRASTRUCTURE and "b: heartbeats stopped" in node.evidence
    unreachable = classify(Failure(FailureCause.LAUNCH_FAILED, "b: [Errno 113] No route to host"))
    assert unreachable.klass == FailureClass.INFRASTRUCTURE
    assert classify(Failure(FailureCause.LAUNCH_FAILED, "rank 0 could not start: no such "
                                                        "file")).klass == FailureClass.USER


def test_preempted_hung_and_unknown():
    assert classify(worker(code=None, sig="SIGTERM")).klass == FailureClass.PREEMPTED
    assert classify(Failure(FailureCause.HUNG, "no output for 60s")).klass == FailureClass.HUNG
    segv = classify(worker(code=None, sig="SIGSEGV"))
    assert segv.klass == FailureClass.UNKNOWN and segv.evidence == "killed by SIGSEGV"


def test_an_abort_while_exiting_after_an_exception_is_that_exception():
    """A rank that raised and then aborted as the interpreter exited (C++ ``terminate`` from a
    thread torch left running: seen in CI after a FloatingPointError) failed of its exception:
    the user's class, so that the same error twice is still seen as one (stop_on_repeat)."""
    raised = MISSING_IMPORT + ["terminate called without an active exception"]
    aborted = classify(worker(code=None, sig="SIGABRT", tail=raised))
    assert aborted.klass == FailureClass.USER, aborted
    assert aborted.evidence.startswith("ModuleNotFoundError: No module named 'mymodel'")
    assert same_error(worker(code=None, sig="SIGABRT", tail=raised), worker(tail=MISSING_IMPORT))
    # An abort with anything else after the exception, or with no exception, is no bug of its.
    later = raised[:-1] + ["[rank1]: still running", raised[-1]]
    assert classify(worker(code=None, sig="SIGABRT", tail=later)).klass == FailureClass.UNKNOWN
    bare = classify(worker(code=None, sig="SIGABRT", tail=["terminate called recursively"]))
    assert bare.klass == FailureClass.UNKNOWN and bare.evidence == "killed by SIGABRT"
    segv = classify(worker(code=None, sig="SIGSEGV", tail=MISSING_IMPORT))
    assert segv.klass == FailureClass.UNKNOWN


def test_the_signature_is_the_exception_type_and_the_innermost_frame():
    assert signature(worker(tail=MISSING_IMPORT)) == "ModuleNotFoundError at train.py:4"
    # torch's error file wins over the tail, and its innermost frame is the one raising.
    assert signature(worker(tail=MISSING_IMPORT, error_file=ERROR_FILE)) == \
        "ValueError at model.py:7"
    chained = ["Traceback (most recent call last):", '  File "/a/x.py", line 2, in <module>',
               "    f()", "KeyError: 'k'", "",
               "During handling of the above exception, another exception occurred:", "",
               "Traceback (most recent call last):", '  File "/a/x.py", line 9, in <module>',
               "    g()", '  File "/a/y.py", line 3, in g', "    raise RuntimeError('r')",
               "    ^^^^^^^^^^^^^^^^^^^^^^^^", "RuntimeError: r"]
    assert signature(worker(tail=chained)) == "RuntimeError at y.py:3"
    assert signature(worker(code=5, tail=["some output", "exiting"])) is None
    assert signature(worker(error_file="{not json")) is None


def test_the_same_error_is_the_same_signature_and_step():
    a = worker(tail=MISSING_IMPORT, step=None)
    assert same_error(worker(tail=MISSING_IMPORT), a)
    assert not same_error(worker(tail=MISSING_IMPORT), None)
    assert same_error(worker(tail=MISSING_IMPORT, rank=0), a)  # first to fail is a race
    assert not same_error(worker(tail=MISSING_IMPORT[:2] + ["    x", "KeyError: 'x'"]), a)
    assert same_error(worker(tail=MISSING_IMPORT, step=30), worker(tail=MISSING_IMPORT, step=30))
    assert not same_error(worker(tail=MISSING_IMPORT, step=31),
                          worker(tail=MISSING_IMPORT, step=30))
    assert not same_error(worker(code=5), worker(code=5))  # no traceback: nothing to compare
