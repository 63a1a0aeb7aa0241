"""Job spec validation: every bad input gets a clear error naming its field."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from orchestrator._schema import SCHEMA_PATH, schema_text
from orchestrator.errors import SpecError
from orchestrator.spec import load_jobspec, parse_jobspec

BASE = "nodes: [{host: local}]\ncommand: [python, train.py]\n"
BOMB = "".join(
    f"{chr(97 + i)}: &{chr(97 + i)} [" + ",".join([f"*{chr(96 + i)}" if i else "x"] * 9) + "]\n"
    for i in range(9)
) + BASE

BAD = [
    # (case id, YAML text, text the error must contain)
    ("unknown key", BASE + "nproc_per_nod: 2\n", "nproc_per_nod: unknown field; did you mean 'nproc_per_node'"),
    ("unknown nested key", "nodes: [{host: local, prot: 2}]\ncommand: [x]\n", "nodes[0].prot: unknown field; did you mean 'port'"),
    ("unknown rendezvous key", BASE + "rendezvous: {backnd: c10d}\n", "rendezvous.backnd"),
    ("unknown health key", BASE + "health: {node_timout: 3}\n", "health.node_timout"),
    ("missing command", "nodes: [{host: local}]\n", "command: required"),
    ("empty command", "nodes: [{host: local}]\ncommand: []\n", "command: must not be empty"),
    ("empty command string", "nodes: [{host: local}]\ncommand: ''\n", "command: must not be empty"),
    ("empty nodes", "nodes: []\ncommand: [x]\n", "nodes: at least one node"),
    ("no nodes", "command: [x]\n", "nodes: at least one node"),
    ("nodes and hostfile", BASE + "hostfile: hosts\n", "hostfile: give nodes or hostfile"),
    ("duplicate host with port", "nodes: [{host: a}, {host: 'a:22'}]\ncommand: [x]\n", "nodes[1].host: duplicate host"),
    ("duplicate host with user", "nodes: [{host: 'alice@h'}, {host: h}]\ncommand: [x]\nssh: {user: alice}\n", "nodes[1].host: duplicate host"),
    ("nproc true", BASE + "nproc_per_node: true\n", "nproc_per_node"),
    ("nproc fraction", BASE + "nproc_per_node: 2.5\n", "nproc_per_node"),
    ("nproc string", BASE + "nproc_per_node: two\n", "nproc_per_node"),
    ("nproc zero", BASE + "nproc_per_node: 0\n", "nproc_per_node"),
    ("max_restarts negative", BASE + "max_restarts: -1\n", "max_restarts"),
    ("nnodes min>max", "nodes: [{host: a}, {host: b}]\ncommand: [x]\nnnodes: '2:1'\n", "nnodes: MIN is larger"),
    ("nnodes max>hosts", BASE + "nnodes: '1:3'\n", "nnodes: MAX 3 is more"),
    ("nnodes garbage", BASE + "nnodes: 'a:b'\n", "nnodes"),
    ("port zero", "nodes: [{host: a, port: 0}]\ncommand: [x]\n", "nodes[0].port"),
    ("port too big", "nodes: [{host: a, port: 70000}]\ncommand: [x]\n", "nodes[0].port"),
    ("port in host string", "nodes: [{host: 'a:99999'}]\ncommand: [x]\n", "nodes[0].host"),
    ("rendezvous port string", BASE + "rendezvous: {port: x}\n", "rendezvous.port"),
    ("env bad name", BASE + "env: {'1X': a}\n", "env: '1X' is not a valid variable name"),
    ("env dash name", BASE + "env: {A-B: a}\n", "env: 'A-B'"),
    ("env newline value", BASE + 'env: {A: "x\\ny"}\n', "env: A: value must not contain"),
    ("env NUL value", BASE + 'env: {A: "x\\0y"}\n', "env: A: value must not contain"),
    ("env bool value", BASE + "env: {A: true}\n", "env: A: value must be a string"),
    ("env reserved RANK", BASE + "env: {RANK: '1'}\n", "env: RANK is set by the orchestrator"),
    ("env reserved MASTER_PORT", BASE + "env: {MASTER_PORT: '1'}\n", "env: MASTER_PORT"),
    ("env reserved prefix", BASE + "env: {TORCHELASTIC_FOO: '1'}\n", "env: TORCHELASTIC_FOO"),
    ("zero grace", BASE + "stop_grace_period: 0\n", "stop_grace_period"),
    ("negative node timeout", BASE + "health: {node_timeout: -1}\n", "health.node_timeout"),
    ("timeout as string", BASE + "launch_timeout: '5'\n", "launch_timeout"),
    ("timeout as bool", BASE + "launch_timeout: true\n", "launch_timeout"),
    ("node_timeout <= heartbeat", BASE + "health: {heartbeat_interval: 5, node_timeout: 5}\n", "health"),
    ("backoff max < initial", BASE + "restart_backoff: {initial: 5, max: 1}\n", "restart_backoff"),
    ("name uppercase", "name: Bad_Name\n" + BASE, "name: must be"),
    ("name empty", "name: ''\n" + BASE, "name: must be"),
    ("name too long", "name: " + "a" * 41 + "\n" + BASE, "name: must be"),
    ("host semicolon", "nodes: [{host: 'a;reboot'}]\ncommand: [x]\n", "nodes[0].host"),
    ("host command substitution", "nodes: [{host: '$(id)'}]\ncommand: [x]\n", "nodes[0].host"),
    ("host space", "nodes: [{host: 'a b'}]\ncommand: [x]\n", "nodes[0].host"),
    ("host backtick", "nodes: [{host: '`id`'}]\ncommand: [x]\n", "nodes[0].host"),
    ("host leading dash", "nodes: [{host: '-oProxyCommand=x'}]\ncommand: [x]\n", "nodes[0].host"),
    ("user with shell chars", "nodes: [{host: 'a', user: 'x;y'}]\ncommand: [x]\n", "nodes[0].user"),
    ("python with space", BASE + "python: 'python3 -c x'\n", "python"),
    ("unknown backend", BASE + "rendezvous: {backend: etcd}\n", "rendezvous.backend"),
    ("unknown host key policy", BASE + "ssh: {host_key_policy: yolo}\n", "ssh.host_key_policy"),
    ("fail_on_exit_codes 0", BASE + "fail_on_exit_codes: [0]\n", "fail_on_exit_codes[0]"),
    ("list document", "- a\n- b\n", "must be a mapping"),
    ("scalar document", "hello\n", "must be a mapping"),
    ("empty document", "", "empty"),
    ("two documents", BASE + "---\n" + BASE, "several YAML documents"),
    ("duplicate top key", BASE + "command: [y]\n", "command: duplicate key"),
    ("duplicate nested key", "nodes: [{host: a, host: b}]\ncommand: [x]\n", "nodes[0].host: duplicate key"),
    ("alias bomb", BOMB, "alias bomb"),
    ("syntax error", "nodes: [{host: a}\ncommand: [x]\n", "invalid YAML: line 2"),
    ("python tag", BASE + "x: !!python/object/apply:os.system ['id']\n", "invalid YAML"),
]


@pytest.mark.parametrize("text,expected", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_spec_is_refused_naming_the_field(text, expected):
    with pytest.raises(SpecError) as info:
        parse_jobspec(text)
    assert expected in str(info.value)


def test_alias_bomb_is_refused_fast():
    started = time.monotonic()
    with pytest.raises(SpecError):
        parse_jobspec(BOMB)
    assert time.monotonic() - started < 1.0


def test_file_checks(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(BASE + "#" * (1024 * 1024))
    with pytest.raises(SpecError, match="larger than"):
        load_jobspec(big)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(BASE.encode() + b"# caf\xe9\n")
    with pytest.raises(SpecError, match="not UTF-8"):
        load_jobspec(latin)
    with pytest.raises(SpecError, match="cannot read spec file"):
        load_jobspec(tmp_path / "missing.yaml")


def test_hostfile_expands_to_nodes_and_slots(tmp_path):
    (tmp_path / "hosts").write_text("# cluster\nn1 slots=4\nbob@n2:2222 slots=4\n\n")
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text("hostfile: hosts\ncommand: [x]\n")
    spec = load_jobspec(spec_path)
    assert [n.host for n in spec.nodes] == ["n1", "bob@n2:2222"]
    assert spec.nproc_per_node == 4
    assert spec.nodes[1].resolved(spec.ssh) == ("bob", "n2", 2222)


@pytest.mark.parametrize("hostfile,expected", [
    ("n1 slots=4\nn2 slots=2\n", "same slots"),
    ("n1 gpus=4\n", "expected 'host slots=N'"),
])
def test_bad_hostfile(tmp_path, hostfile, expected):
    (tmp_path / "hosts").write_text(hostfile)
    with pytest.raises(SpecError, match=expected) as info:
        parse_jobspec("hostfile: hosts\ncommand: [x]\n", base_dir=tmp_path)
    assert info.value.field == "hostfile"
    with pytest.raises(SpecError, match="hostfile: cannot read"):
        parse_jobspec("hostfile: nope\ncommand: [x]\n", base_dir=tmp_path)


def test_good_specs():
    minimal = parse_jobspec(BASE)
    assert minimal.name == "job" and minimal.nproc_per_node == 1 and minimal.max_restarts == 0
    assert minimal.min_nodes == minimal.max_nodes == 1
    assert minimal.rendezvous.backend == "static" and minimal.rendezvous.port == "auto"
    assert minimal.ssh.host_key_policy == "reject"

    full = parse_jobspec("""
name: ddp-demo
nodes:
  - host: local
  - {host: 'alice@gpu1:2200', identity_file: ~/.ssh/id, address: 10.0.0.5}
  - {host: gpu2, user: bob, port: 22}
nproc_per_node: 2
nnodes: "2:3"
command: 'python train.py --name "a b"'
env: {NCCL_DEBUG: WARN, SEED: 3}
max_restarts: 3
fail_on_exit_codes: [2]
rendezvous: {backend: c10d, port: 29400, master_addr: 10.0.0.5}
restart_backoff: {initial: 0.5, max: 4}
health: {heartbeat_interval: 0.5, node_timeout: 3, hang_timeout: 60}
ssh: {user: carol, known_hosts: /tmp/kh, host_key_policy: accept-new, connect_timeout: 3}
""")
    assert full.command == ("python", "train.py", "--name", "a b")
    assert full.env == {"NCCL_DEBUG": "WARN", "SEED": "3"}
    assert (full.min_nodes, full.max_nodes) == (2, 3)
    assert full.nodes[1].resolved(full.ssh) == ("alice", "gpu1", 2200)
    assert full.nodes[2].resolved(full.ssh) == ("bob", "gpu2", 22)
    assert full.nodes[0].is_local and not full.nodes[1].is_local
    ipv6 = parse_jobspec("nodes: [{host: '[fd00::5]:2222'}]\ncommand: [x]\n")
    assert ipv6.nodes[0].resolved(ipv6.ssh) == (None, "fd00::5", 2222)


def test_schema_file_is_in_sync():
    assert SCHEMA_PATH.read_text() == schema_text(), "run: python -m orchestrator._schema"


@pytest.mark.parametrize("path", sorted(Path(SCHEMA_PATH.parent).glob("*.yaml")),
                         ids=lambda p: p.name)
def test_reference_specs_load(path):
    load_jobspec(path)
