"""The controller's half of the protocol (agents/commands.py): every command round-trips
through its encoding and the agent's door; whatever a controller (or anything that reached
the agent's socket with the secret) sends, the door raises nothing but ProtocolError; every
request is bound to its reply type, and the agent's replies parse at the controller's door
as what they are; and no module reads a raw message field outside the protocol modules."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import pathlib
import threading
import typing
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents import commands as C
from agents import protocol as P
from orchestrator.channel import Channel, ask

ROOT = pathlib.Path(__file__).resolve().parents[2]
FUZZ = settings(max_examples=300, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow])

LAUNCH = C.Launch("s3cret", 0.5, 5.0, 60.0, 1 << 20, 2.0)
WORKER = C.WorkerStart(0, 0, ("python3", "-c", "pass"), {"A": "1"})
START = C.Start(2, "/w", {"X": "1"}, {"OMP_NUM_THREADS": "1"}, "10.0.0.1", (WORKER,), 5.0,
                2000, C.WarmImports(("numpy",)))
#: One of each command, with its req (None: not a request).
EXAMPLES: list[tuple[C.Command, int | None]] = [
    (C.Connect("j-1", 3, LAUNCH), None), (C.Connect("j-1", 0), None), (C.Hold("j-1"), None),
    (C.Attach("s3cret", 7), None), (C.Ack(9), None), (C.Spool(), None), (C.Ping(), None),
    (C.Shutdown(), None), (START, None),
    (C.Warm(*(getattr(START, f.name) for f in dataclasses.fields(START))), None),
    (C.Start(1, None, {}, {}, None, (C.WorkerStart(None, 1, ("a",), {}),)), None),
    (dataclasses.replace(START, checkpoint=C.CheckpointConfig(
        "ck", 5, 3, 1 << 30, 42, (C.Pull(3, 42, "10.0.0.2", 40000),))), None),
    (dataclasses.replace(START, checkpoint=C.CheckpointConfig(
        "ck", 5, 3, 1 << 30, 42, (), (C.Copies(4, (40, 42), "10.0.0.3", 40001),))), None),
    (C.ReplicateTo("10.0.0.2", 40000), None), (C.ReplicateTo("", 0), None), (C.Retain(41), None),
    (C.SaveAt(57, 120.0), None), (C.SaveAt(None), None), (C.SaveAt(3, 1.0, True, False), None),
    (C.Release(), None), (C.Resumed(90, 2), None),
    (C.ReplicateTo("10.0.0.2", 40000, (("10.0.0.3", 40001),)), None),
    (C.Stop(2, 1.5), None), (C.Stop(), None),
    (C.FreePort(), 1), (C.FreePort(range=(29500, 29510)), 2), (C.Listen(ports=(1, 2)), 3),
    (C.Probe("10.0.0.1", (29500,), 1.5), 4), (C.MissingBlobs(("ab" * 32,)), 5),
    (C.PutChunk("ab" * 32, 0, "aGk=", True), 6),
    (C.BuildTree("cd" * 32, (("a.py", "ab" * 32, False),), 3), 7),
    (C.RunSetup("k", "pip install x", "/w", {"A": "1"}, 30.0), 8),
    (C.CheckNode(("true",), None, {}, 10.0, 1 << 30, True, 8), 9),
    (C.NetListen("00ff", 1 << 20, 30.0), 10), (C.NetSend("10.0.0.2", 4000, "00ff", 100, 5.0), 11),
    (C.NetClose(), None), (C.GetStacks(10.0, True), 12), (C.ReadTrace("/t/x", 4096), 13),
]


def _line(command: C.Command, req: int | None) -> dict:
    """What the agent decodes from the line the controller writes."""
    return P.decode(P.encode(C.wire(command, req)))


def test_every_command_has_an_example_and_round_trips():
    assert {type(c) for c, _ in EXAMPLES} == set(C.COMMANDS.values())
    for command, req in EXAMPLES:
        assert C.parse(_line(command, req)) == (command, req), command


def test_the_holder_socket_speaks_the_same_way():
    start = C.HolderStart(2, LAUNCH)
    assert C.parse_holder_start(_line(start, None)) == start
    for answer in (C.HolderStarted(True), C.HolderStarted(False, "no room")):
        assert C.parse_holder_started(json.loads(json.dumps(C.holder_started(answer)))) == answer
    assert C.parse_holder_started(None) == C.HolderStarted(False, None)
    via = C.via_holder(C.wire(C.Connect("j", 1, LAUNCH)))
    assert via is not None
    assert C.parse(via)[0] == C.Connect("j", 1, dataclasses.replace(LAUNCH, holder=True))
    assert C.via_holder(C.wire(C.Connect("j", 1))) is None
    assert C.via_holder(C.wire(C.Ping())) is None


def test_every_request_is_bound_to_its_reply_type():
    requests = [c for c in C.COMMANDS.values() if issubclass(c, C.Request)]
    assert len(requests) == 12
    for cls in requests:
        (bound,) = typing.get_args(cls.__orig_bases__[0])  # type: ignore[attr-defined]
        assert bound is cls.REPLY, cls


REPLIES = [
    P.Failed(1, "e"), P.PortReply(1, 29500, True), P.Listening(1, (1, 2), (3,), True, None),
    P.ProbeResult(1, "eth0", False, (29500,), "refused"), P.SyncMissing(1, ("ab",)),
    P.SyncPut(1, False, "disk full"), P.SyncBuilt(1, "/t"),
    P.SetupDone(1, 1, False, ("x",), True), P.Checked(1, ("GPU 0 lost",), ("t",)),
    P.NetListening(1, 4000), P.NetSent(1, 0.25), P.NetSent(1, None, "timed out"),
    P.Stacks(1, {0: P.Stack("py-spy", "t", None, "n")}, {0: "/t/0"}),
    P.TraceChunk(1, b"\x00\xff", 2),
]


def test_what_the_agent_replies_parses_at_the_controllers_door_as_itself():
    """The agent builds replies from the same classes the door parses into: a field one
    side sends and the other lacks (``listening.port``, ``sync_put.part``) cannot be."""
    kinds = {type(r) for r in REPLIES}
    assert kinds == {c.REPLY for c in C.COMMANDS.values() if issubclass(c, C.Request)} | \
        {P.Failed}
    for reply in REPLIES:
        wire = P.decode(P.encode(P.reply_wire(reply, 3)))
        assert P.parse(wire) == reply, reply


def test_a_reply_of_the_wrong_type_fails_the_request_instead_of_reaching_its_caller():
    sent: list[dict] = []
    channel = Channel(0, SimpleNamespace(host="h", send=sent.append), 1,  # type: ignore[arg-type]
                      P.Hello(P.VERSION, 1, 0), False)
    threading.Timer(0.05, lambda: channel.resolve(P.Listening(sent[-1]["req"], (1,)))).start()
    answer = ask(channel, C.FreePort(), 5.0)
    assert isinstance(answer, P.Failed) and "Listening, not PortReply" in answer.error
    threading.Timer(0.05, lambda: channel.resolve(P.PortReply(sent[-1]["req"], 5, True))).start()
    assert ask(channel, C.FreePort(), 5.0) == P.PortReply(sent[-1]["req"], 5, True)


FIELD_NAMES = sorted({k for c, r in EXAMPLES for k in C.wire(c, r)} |
                     {k for c, r in EXAMPLES for v in C.wire(c, r).values()
                      if isinstance(v, dict) for k in v} | {"workers", "rank", "argv"})
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) |
    st.sampled_from([10 ** 400, 2 ** 63, -1, float("nan"), "x" * 100_000, "\ud800", "zz"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=10)


@FUZZ
@given(st.sampled_from(EXAMPLES), st.lists(st.tuples(st.sampled_from(FIELD_NAMES),
                                                     JSON | st.just(...)), max_size=4),
       st.sampled_from([None, "launch", "warm", "workers"]))
def test_any_command_is_parsed_or_a_protocol_error(example, changes, inner):
    message = copy.deepcopy(C.wire(*example))
    for name, value in changes:
        target = message
        if inner and isinstance(message.get(inner), dict):
            target = message[inner]
        elif inner and isinstance(message.get(inner), list) and message[inner] and \
                isinstance(message[inner][0], dict):
            target = message[inner][0]
        if value is ...:
            target.pop(name, None)
        else:
            target[name] = value
    try:
        line = json.dumps(message).encode()
    except ValueError:
        return
    raw = P.decode(line)
    if raw is None:
        return
    try:
        command, req = C.parse(raw)
    except P.ProtocolError as exc:
        assert str(exc)
        return
    assert isinstance(command, C.Command) and (req is None or isinstance(req, int))


@pytest.mark.parametrize("raw", [{}, {"op": None}, {"op": "rm -rf"}, {"op": "start"},
                                 {"op": "free_port"}, {"op": "free_port", "req": -1},
                                 {"op": "attach", "secret": 5}])
def test_what_the_door_refuses_names_the_field(raw):
    with pytest.raises(P.ProtocolError) as refused:
        C.parse(raw)
    assert refused.value.field in ("op", "req", "attempt", "secret", "workers")


# --- nobody else reads a raw field ----------------------------------------------------------

#: The protocol itself; the agent's outbox, which numbers and batches the agent's own
#: outgoing messages; the fake agent of tests and the scale simulation, which plays a node.
OWNERS = {"agents/protocol.py", "agents/commands.py", "agents/fields.py", "agents/outbox.py",
          "orchestrator/transport/fake.py"}
#: What a message is called where one is read.
MESSAGE_NAMES = {"msg", "message", "raw", "first", "reply", "request", "given", "launch",
                 "config", "command", "answer"}


def _raw_reads(path: pathlib.Path) -> list[str]:
    reads = []
    for node in ast.walk(ast.parse(path.read_text())):
        receiver = key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            receiver, key = node.value, node.slice.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant):
            receiver, key = node.func.value, node.args[0].value
        if isinstance(receiver, ast.Name) and receiver.id in MESSAGE_NAMES and \
                isinstance(key, str):
            reads.append(f"{path.relative_to(ROOT)}:{node.lineno} {receiver.id}[{key!r}]")
    return reads


def test_no_module_reads_a_raw_message_field_outside_the_protocol():
    """Every module that speaks the protocol (it imports agents.protocol or
    agents.commands) gets typed messages: a read of ``msg["port"]`` or ``msg.get("part")``
    is how fields drift between the two sides."""
    speakers = []
    for path in sorted([*ROOT.glob("agents/*.py"), *ROOT.glob("orchestrator/**/*.py")]):
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        if rel not in OWNERS and ("agents import protocol" in text or
                                  "agents import commands" in text or
                                  rel.startswith("agents/")):
            speakers.append(path)
    assert len(speakers) > 30
    reads = [r for path in speakers for r in _raw_reads(path)]
    assert reads == []


def test_a_synced_tree_of_more_files_than_a_mapping_may_hold_still_passes_the_door():
    blobs = C.MissingBlobs(tuple(f"{i:064x}" for i in range(70_000)))
    assert C.parse(_line(blobs, 1)) == (blobs, 1)
    tree = C.BuildTree("ab" * 32, tuple((f"f{i}.py", f"{i:064x}", False) for i in range(70_000)))
    assert C.parse(_line(tree, 2)) == (tree, 2)


def test_a_wait_longer_than_a_lock_can_wait_is_no_limit_not_an_error():
    """A spec's huge timeout (network_check.timeout: 9223372032) once reached a lock's
    wait as an OverflowError (found by test_fuzz)."""
    sent: list[dict] = []
    channel = Channel(0, SimpleNamespace(host="h", send=sent.append), 1,  # type: ignore[arg-type]
                      P.Hello(P.VERSION, 1, 0), False)
    threading.Timer(0.05, lambda: channel.resolve(P.PortReply(sent[-1]["req"], 7, True))).start()
    assert ask(channel, C.FreePort(), 1e12) == P.PortReply(sent[-1]["req"], 7, True)
