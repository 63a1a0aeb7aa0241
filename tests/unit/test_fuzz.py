"""Fuzzing the two doors with hypothesis: whatever a spec holds (valid or broken YAML, wrong
types, huge values, any field) load_jobspec and check raise nothing but our errors, and
whatever a node sends, the protocol raises nothing but ProtocolError."""

from __future__ import annotations

import copy
import json
import typing

import pydantic
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agents import protocol as P
from orchestrator import api
from orchestrator.errors import OrchestratorError
from orchestrator.spec import JobSpec, load_jobspec, parse_jobspec

FUZZ = settings(max_examples=300, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

BASE = {
    "name": "fuzz", "nodes": [{"host": "local"}, {"host": "local", "slots": 2}],
    "nproc_per_node": 1, "command": ["python3", "-c", "pass"], "workdir": "/tmp",
    "env": {"A": "1"}, "setup": ["true"], "max_restarts": 1, "nnodes": "1:2",
    "health": {"heartbeat_interval": 1, "node_timeout": 5}, "logs": {"max_bytes_per_rank": 100_000},
    "rendezvous": {"backend": "static"}, "restart_backoff": {"initial": 1, "max": 2},
}


def _fields(model: type[pydantic.BaseModel], prefix: tuple = ()) -> list[tuple]:
    """Every field path of the spec's model, into its sections and its lists' first item."""
    paths = []
    for name, info in model.model_fields.items():
        path = (*prefix, info.alias or name)
        paths.append(path)
        for inner in typing.get_args(info.annotation) or (info.annotation,):
            if isinstance(inner, type) and issubclass(inner, pydantic.BaseModel):
                is_list = typing.get_origin(info.annotation) is tuple
                paths += _fields(inner, (*path, 0) if is_list else path)
    return paths


PATHS = _fields(JobSpec)
HUGE = st.sampled_from([10 ** 400, -(10 ** 400), 2 ** 63, -1, 0, 1e308, float("inf"),
                        float("nan"), "x" * 100_000, "\x00", "..", "../../etc/passwd", "-o",
                        "local\nhost", "😀", True, [], {}])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | HUGE,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


def _put(doc: dict, path: tuple, value: object) -> None:
    target = doc
    for step in path[:-1]:
        if isinstance(target, dict):
            target = target.setdefault(step, {})
        elif isinstance(target, list) and isinstance(step, int) and step < len(target):
            target = target[step]
        else:
            return
    if isinstance(target, dict):
        target[path[-1]] = value
    elif isinstance(target, list) and isinstance(path[-1], int) and path[-1] < len(target):
        target[path[-1]] = value


MUTATED = st.lists(st.tuples(st.sampled_from(PATHS), JSON | st.just(...)), min_size=1,
                   max_size=4).map(lambda changes: _mutate(changes))


# Values a user might well write: more of these specs are valid, so check gets to the nodes.
PLAUSIBLE = st.lists(st.tuples(st.sampled_from(PATHS), st.none() | st.integers(0, 4)
                               | st.floats(0.5, 10) | st.just(...)
                               | st.sampled_from(["local", "1:2", "auto", "c10d", "lo", "30s"])),
                     max_size=2).map(lambda changes: _mutate(changes))


def _mutate(changes: list) -> dict:
    doc = copy.deepcopy(BASE)
    for path, value in changes:
        if value is ...:  # removed
            parent = doc
            for step in path[:-1]:
                parent = parent.get(step, {}) if isinstance(parent, dict) else {}
            if isinstance(parent, dict):
                parent.pop(path[-1], None)
        else:
            _put(doc, path, value)
    return doc


def _ours(call, *args, **kwargs):
    """The call's result, or None when it refused with one of our errors; anything else
    raised fails the test (hypothesis shows the input)."""
    try:
        return call(*args, **kwargs)
    except OrchestratorError as exc:
        assert str(exc)  # every refusal says something
        return None


@FUZZ
@given(st.text(max_size=2000))
def test_any_text_is_a_spec_or_a_spec_error(text):
    _ours(parse_jobspec, text)


@FUZZ
@given(st.binary(max_size=2000))
def test_any_file_is_a_spec_or_a_spec_error(tmp_path, data):
    path = tmp_path / "spec.yaml"
    path.write_bytes(data)
    _ours(load_jobspec, path)


@FUZZ
@given(st.data())
def test_a_valid_spec_broken_anywhere_is_a_spec_or_a_spec_error(data):
    text = yaml.safe_dump(BASE)
    at = data.draw(st.integers(0, len(text)))
    cut = data.draw(st.integers(0, 20))
    inserted = data.draw(st.text(alphabet=":-[]{}&*!|>'\"#%@`,? \n\t\\x0", max_size=10))
    _ours(parse_jobspec, text[:at] + inserted + text[at + cut:])


@FUZZ
@given(MUTATED)
def test_any_value_in_any_field_is_a_spec_or_a_spec_error(doc):
    _ours(parse_jobspec, yaml.safe_dump(doc, allow_unicode=True))


@FUZZ
@given(st.text(max_size=200), st.dictionaries(st.text(max_size=20), st.text(max_size=20),
                                              max_size=3))
def test_any_set_override_or_env_is_a_spec_or_a_spec_error(item, env):
    _ours(parse_jobspec, yaml.safe_dump(BASE), overrides=[item], env=env)


@settings(max_examples=20, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(MUTATED | PLAUSIBLE)
@example(copy.deepcopy(BASE))  # at least one reaches the nodes
def test_check_of_any_spec_on_local_nodes_raises_only_our_errors(home, tmp_path, doc):
    # Only local nodes: a fuzzed host would send traffic off this machine.
    doc.pop("hostfile", None)
    doc.pop("slurm", None)
    doc["nodes"] = [{"host": "local"}, {"host": "local"}]
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    report = _ours(api.check, path)
    if report is not None:
        assert report["nodes"], report


# --- the protocol's door ----------------------------------------------------------------------

VALID = [
    {"type": "hello", "protocol": P.VERSION, "pid": 5, "attempt": 1, "hostname": "n",
     "python": "3.11", "torch": None, "gpus": 0, "instance": "ab", "last_seq": 0,
     "workers": [{"rank": 0, "local_rank": 0, "pid": 9, "running": True}]},
    {"type": "heartbeat", "attempt": 1},
    {"type": "heartbeat", "attempt": 1, "notice": {"source": "SIGTERM", "deadline": 1.8e9}},
    {"type": "progress", "attempt": 1, "beat": True,
     "ranks": {"0": {"step": 3, "metrics": {"loss": 0.5}, "at": 1.5, "waits": [4, 1],
                     "total_steps": 100}}},
    {"type": "held", "attempt": 1, "memory": {"0": [3, 4]}, "persisted": {"1": [2]},
     "bytes": 4096, "store": "ab", "saves": {"0": [4, 2048, 0.01]},
     "restored": {"0": [1, 3, "memory", 0.2, 0]}},
    {"type": "setup_output", "lines": ["a"]},
    {"type": "relay", "launched": True}, {"type": "gone", "outcome": {"reason": "x"}},
    {"type": "holding", "standby": False},
    {"type": "failed", "req": 1, "error": "e"},
    {"type": "port", "req": 1, "port": 80, "ok": True},
    {"type": "listening", "req": 1, "ports": [1], "busy": [], "ok": True, "error": None},
    {"type": "probe", "req": 1, "interface": "lo", "reachable": True, "unreachable": []},
    {"type": "sync_missing", "req": 1, "missing": ["ab"]},
    {"type": "sync_put", "req": 1, "ok": True}, {"type": "sync_built", "req": 1, "path": "/x"},
    {"type": "setup_done", "req": 1, "exit_code": 0, "cached": False, "tail": ["t"]},
    {"type": "stacks", "req": 1, "stacks": {"0": {"method": "py-spy", "text": "t"}},
     "traces": {"0": "/t"}, "refused": {"1": "a FIFO"}},
    {"type": "trace_chunk", "req": 1, "data": "aGk=", "size": 2},
    {"type": "checked", "req": 1, "problems": ["GPU 0: a row remapping failed"], "tail": []},
    {"type": "net_listening", "req": 1, "port": 40000},
    {"type": "net_sent", "req": 1, "seconds": 0.25}, {"type": "net_sent", "req": 1,
                                                       "error": "timed out"},
    {"type": "started", "seq": 1, "attempt": 1, "rank": 0, "local_rank": 0, "pid": 7},
    {"type": "spawn_failed", "seq": 2, "attempt": 1, "rank": 0, "local_rank": 0, "error": "e"},
    {"type": "output", "seq": 3, "attempt": 1, "rank": 0, "stream": "stdout", "lines": ["x"]},
    {"type": "exited", "seq": 4, "attempt": 1, "rank": 0, "local_rank": 0, "exit_code": 1,
     "signal": None, "error_file": None},
    {"type": "stopped", "seq": 5, "attempt": 1},
    {"type": "dropped", "seq": 6, "attempt": 1, "rank": 0, "stream": "stderr", "lines": 3},
    {"type": "error", "seq": 7, "attempt": 1, "message": "m"},
]
FIELD_NAMES = sorted({k for m in VALID for k in m} | {k for m in VALID for v in m.values()
                                                        if isinstance(v, dict) for k in v})


def test_every_valid_example_passes_the_door():
    for message in VALID:
        assert P.check(message) is None, (message, P.check(message))


def _wire(message: dict) -> dict | None:
    """What the controller would have decoded from the line the message makes."""
    try:
        line = json.dumps(message).encode()
    except ValueError:
        return None
    return P.decode(line)


MESSAGE_CHANGES = st.lists(st.tuples(st.sampled_from(FIELD_NAMES), JSON | st.just(...)),
                           max_size=4)


@FUZZ
@given(st.sampled_from(VALID), MESSAGE_CHANGES,
       st.sampled_from([None, "0", "ranks", "stacks", "memory", "notice"]))
def test_any_message_is_parsed_or_a_protocol_error(base, changes, inner):
    message = copy.deepcopy(base)
    for name, value in changes:
        target = message
        if inner and isinstance(message.get(inner), dict):  # inside a nested record
            target = message[inner]
            if isinstance(target.get("0"), dict):
                target = target["0"]
        if value is ...:
            target.pop(name, None)
        else:
            target[name] = value
    raw = _wire(message)
    if raw is None:
        return
    try:
        P.parse(raw)
    except P.ProtocolError as exc:
        assert str(exc)
    assert P.check(raw) is None or isinstance(P.check(raw), str)


@FUZZ
@given(st.binary(max_size=500) | st.text(max_size=300).map(str.encode))
def test_any_line_decodes_to_a_mapping_or_nothing(line):
    raw = P.decode(line)
    assert raw is None or isinstance(raw, dict)
    if raw is not None:
        assert P.check(raw) is None or isinstance(P.check(raw), str)


@pytest.mark.parametrize("line", [b"[" * 100_000, b'{"a":' * 50_000, b"1" * 5000,
                                  b'{"type": "progress", "attempt": 1, "ranks": {"0": '
                                  b'{"at": 1' + b"0" * 400 + b"}}}"])
def test_pathological_lines_are_refused_not_raised(line):
    raw = P.decode(line)
    assert raw is None or isinstance(P.check(raw), str)


def test_a_notice_is_read_whole_or_refused_naming_its_field():
    good = P.parse({"type": "heartbeat", "attempt": 2,
                    "notice": {"source": "SIGTERM to the agent", "deadline": 1.8e9}})
    assert good == P.Heartbeat(2, P.Notice("SIGTERM to the agent", 1.8e9))
    assert P.parse({"type": "heartbeat", "attempt": 2, "notice": None}) == P.Heartbeat(2)
    for notice, field in (([1], "notice"), ({"source": "x", "deadline": 1e300}, "deadline"),
                          ({"source": "x" * 201, "deadline": 1.0}, "source"),
                          ({"deadline": 1.0}, "source")):
        with pytest.raises(P.ProtocolError) as exc:
            P.parse({"type": "heartbeat", "attempt": 2, "notice": notice})
        assert exc.value.field == field, (notice, exc.value)
