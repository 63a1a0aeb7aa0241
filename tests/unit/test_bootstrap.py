"""The bootstrap runs the agent from the code the controller compiled when the node's Python
reads it (the same bytecode magic), and from the source on any other Python."""

from __future__ import annotations

import subprocess
import sys

from orchestrator.transport.base import BOOTSTRAP, agent_payload


def _relay_answer(payload: bytes, probe: str = "") -> subprocess.CompletedProcess[bytes]:
    program = BOOTSTRAP if not probe else BOOTSTRAP.replace(
        "import agents.main;sys.exit(agents.main.main())", probe)
    return subprocess.run([sys.executable, "-I", "-u", "-c", program], input=payload + b"{}\n",
                          capture_output=True, timeout=30)


def test_a_node_of_the_same_python_runs_the_shipped_code_and_any_other_the_source():
    payload = agent_payload()
    head, rest = payload.split(b"\n", 1)
    count, magic, size = head.split()
    other = b" ".join([count, b"00000000", size]) + b"\n" + rest  # another Python's magic
    assert len(payload) < 400_000  # compressed: a node's login carries it every time
    for data in (payload, other):
        assert b"expected connect" in _relay_answer(data).stdout
    probe = "import agents.relay;print(o)"
    assert _relay_answer(payload, probe).stdout.strip() == b"True"
    assert _relay_answer(other, probe).stdout.strip() == b"False"


def test_the_workers_shims_are_shipped_as_source_alone_and_still_import():
    """The agent only writes the worker shims out as text: they carry no code object (the
    payload is smaller by those), and one imported all the same is compiled from its source."""
    import agents

    payload = agent_payload()
    probe = ("import agents.shims.orchestrator_worker as w;"
             "print(sorted(n for n in c if not c[n]), hasattr(w, 'heartbeat'))")
    shown = _relay_answer(payload, probe).stdout.decode().strip()
    assert shown == f"{sorted(agents.TEXT_ONLY)} True", shown
