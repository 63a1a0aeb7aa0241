"""Job spec validation: every bad input gets one clear SpecError naming its field."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from orchestrator._schema import SCHEMA_PATH, schema_text
from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec, load_jobspec, parse_jobspec

BASE = "nodes: [{host: local}]\ncommand: [python, train.py]\n"
CMD = "command: [x]\n"
# Nine levels of nine aliases each: 9**9 values once expanded, 300 bytes of text.
BOMB = "".join(
    f"{chr(97 + i)}: &{chr(97 + i)} [" + ",".join([f"*{chr(96 + i)}" if i else "x"] * 9) + "]\n"
    for i in range(9)
) + BASE

BAD = [
    # (case id, YAML text, the field path, a fragment of the message)
    ("unknown key", BASE + "nproc_per_nod: 2\n", "nproc_per_nod", "did you mean 'nproc_per_node'"),
    ("local node among SSH nodes", "nodes: [{host: local}, {host: gpu1}]\n" + CMD, "nodes[0].address", "needs the address"),
    ("unknown nested key", "nodes: [{host: local, prot: 2}]\n" + CMD, "nodes[0].prot", "did you mean 'port'"),
    ("unknown rendezvous key", BASE + "rendezvous: {backnd: c10d}\n", "rendezvous.backnd", "did you mean 'backend'"),
    ("unknown health key", BASE + "health: {node_timout: 3}\n", "health.node_timout", "did you mean 'node_timeout'"),
    ("unknown ssh key", BASE + "ssh: {usr: a}\n", "ssh.usr", "did you mean 'user'"),
    ("unknown backoff key", BASE + "restart_backoff: {maximum: 3}\n", "restart_backoff.maximum", "unknown field"),
    ("numeric key", BASE + "1: 2\n", "1", "unknown field"),
    ("missing command", "nodes: [{host: local}]\n", "command", "required"),
    ("empty command", "nodes: [{host: local}]\ncommand: []\n", "command", "must not be empty"),
    ("blank command string", "nodes: [{host: local}]\ncommand: '  '\n", "command", "must not be empty"),
    ("empty program", "nodes: [{host: local}]\ncommand: ['', x]\n", "command[0]", "must not be empty"),
    ("command with number", "nodes: [{host: local}]\ncommand: [x, 3]\n", "command[1]", 'quote it in YAML ("3")'),
    ("command with bool", "nodes: [{host: local}]\ncommand: [true]\n", "command[0]", 'quote it in YAML ("true")'),
    ("command NUL", 'nodes: [{host: local}]\ncommand: [x, "a\\0b"]\n', "command[1]", "NUL"),
    ("command bad quoting", "nodes: [{host: local}]\ncommand: 'python \"x'\n", "command", "cannot split"),
    ("empty nodes", "nodes: []\n" + CMD, "nodes", "at least one node"),
    ("no nodes", CMD, "nodes", "at least one node"),
    ("node not a mapping", "nodes: [local]\n" + CMD, "nodes[0]", "must be a mapping"),
    ("nodes and hostfile", BASE + "hostfile: hosts\n", "hostfile", "not both"),
    ("duplicate host with port", "nodes: [{host: a}, {host: 'a:22'}]\n" + CMD, "nodes[1].host", "same as nodes[0]"),
    ("duplicate host with ssh.user", "nodes: [{host: 'alice@h'}, {host: h}]\nssh: {user: alice}\n" + CMD, "nodes[1].host", "duplicate host"),
    ("duplicate host by fields", "nodes: [{host: h, port: 2}, {host: b}, {host: 'h:2'}]\n" + CMD, "nodes[2].host", "same as nodes[0]"),
    ("user contradicts host", "nodes: [{host: 'bob@a', user: alice}]\n" + CMD, "nodes[0].user", "contradicts"),
    ("port contradicts host", "nodes: [{host: 'a:23', port: 24}]\n" + CMD, "nodes[0].port", "contradicts"),
    ("ssh option on local node", "nodes: [{host: local, port: 22}]\n" + CMD, "nodes[0].port", "local node"),
    ("nproc true", BASE + "nproc_per_node: true\n", "nproc_per_node", "whole number"),
    ("nproc fraction", BASE + "nproc_per_node: 2.5\n", "nproc_per_node", "whole number"),
    ("nproc string", BASE + "nproc_per_node: two\n", "nproc_per_node", "whole number"),
    ("nproc zero", BASE + "nproc_per_node: 0\n", "nproc_per_node", "at least 1, \"gpu\" or \"auto\""),
    ("max_restarts negative", BASE + "max_restarts: -1\n", "max_restarts", "greater than or equal to 0"),
    ("nnodes min>max", "nodes: [{host: a}, {host: b}]\nnnodes: '3:2'\n" + CMD, "nnodes", "MIN is larger"),
    ("nnodes max>hosts", BASE + "nnodes: '1:3'\n", "nnodes", "MAX 3 is more than the 1 node"),
    ("nnodes int>hosts", BASE + "nnodes: 2\n", "nnodes", "MAX 2"),
    ("nnodes zero", BASE + "nnodes: '0:1'\n", "nnodes", "at least 1"),
    ("nnodes garbage", BASE + "nnodes: 'a:b'\n", "nnodes", '"MIN:MAX"'),
    ("nnodes bool", BASE + "nnodes: true\n", "nnodes", '"MIN:MAX"'),
    ("port zero", "nodes: [{host: a, port: 0}]\n" + CMD, "nodes[0].port", "greater than or equal to 1"),
    ("port too big", "nodes: [{host: a, port: 70000}]\n" + CMD, "nodes[0].port", "less than or equal to 65535"),
    ("port string", "nodes: [{host: a, port: '22'}]\n" + CMD, "nodes[0].port", "whole number"),
    ("port in host string", "nodes: [{host: 'a:99999'}]\n" + CMD, "nodes[0].host", "invalid port"),
    ("rendezvous port string", BASE + "rendezvous: {port: x}\n", "rendezvous.port", 'a port number 1..65535, or a range'),
    ("rendezvous port zero", BASE + "rendezvous: {port: 0}\n", "rendezvous.port", 'a port number 1..65535, or a range'),
    ("rendezvous port range reversed", BASE + "rendezvous: {port: 29550-29500}\n", "rendezvous.port", "or a range"),
    ("rendezvous port range too high", BASE + "rendezvous: {port: 65000-70000}\n", "rendezvous.port", "or a range"),
    ("unknown placeholder", "nodes: [{host: local}]\ncommand: [x, '${rnak}']\n", "command[1]", "unknown placeholder ${rnak}"),
    ("unclosed placeholder", "nodes: [{host: local}]\ncommand: [x, '${rank']\n", "command[1]", "unclosed placeholder"),
    ("placeholder in env", BASE + "env: {A: '${host}'}\n", "env.A", "unknown placeholder ${host}"),
    ("per-rank placeholder with c10d", "nodes: [{host: local}]\ncommand: [x, '${local_rank}']\nrendezvous: {backend: c10d}\n", "command[1]", "not known before torch's"),
    ("node start rank with c10d", "nodes: [{host: local}]\ncommand: [x, '${node_start_rank}']\nrendezvous: {backend: c10d}\n", "command[1]", "not known before torch's"),
    ("rank placeholder per node", "nodes: [{host: local}]\ncommand: [x, '${rank}']\nlaunch: per-node\n", "command[1]", "${node_start_rank}"),
    ("per-node with c10d", "nodes: [{host: local}]\ncommand: [x]\nlaunch: per-node\nrendezvous: {backend: c10d}\n", "launch", "choose one"),
    ("unknown launch", "nodes: [{host: local}]\ncommand: [x]\nlaunch: per-gpu\n", "launch", "per-rank"),
    ("sync max_bytes zero", "nodes: [{host: local}]\ncommand: [x]\nsync: {path: ., max_bytes: 0}\n", "sync.max_bytes", "greater than or equal to 1"),
    ("duration bad clock", BASE + "max_duration: '1:99:00'\n", "max_duration", "HH:MM:SS"),
    ("duration zero", BASE + "max_duration: 0\n", "max_duration", "greater than or equal to 0.01"),
    ("duration zero clock", BASE + "max_duration: '00:00:00'\n", "max_duration", "longer than 0"),
    ("secret_env bad name", BASE + "secret_env: ['A B']\n", "secret_env[0]", "not a valid variable name"),
    ("rendezvous port big", BASE + "rendezvous: {port: 70000}\n", "rendezvous.port", 'a port number 1..65535, or a range'),
    ("rendezvous not a mapping", BASE + "rendezvous: static\n", "rendezvous", "must be a mapping"),
    ("master_addr shell", BASE + "rendezvous: {master_addr: 'a;b'}\n", "rendezvous.master_addr", "not a valid host"),
    ("env bad name", BASE + "env: {'1X': a}\n", "env.1X", "not a valid variable name"),
    ("env dash name", BASE + "env: {A-B: a}\n", "env.A-B", "not a valid variable name"),
    ("env newline value", BASE + 'env: {A: "x\\ny"}\n', "env.A", "must not contain NUL or newline"),
    ("env NUL value", BASE + 'env: {A: "x\\0y"}\n', "env.A", "must not contain NUL or newline"),
    ("env bool value", BASE + "env: {A: true}\n", "env.A", "string or a number"),
    ("env null value", BASE + "env: {A: null}\n", "env.A", "string or a number"),
    ("env not a mapping", BASE + "env: [A]\n", "env", "must be a mapping"),
    ("env reserved RANK", BASE + "env: {RANK: '1'}\n", "env.RANK", "set by the orchestrator"),
    ("env reserved MASTER_PORT", BASE + "env: {MASTER_PORT: '1'}\n", "env.MASTER_PORT", "set by the orchestrator"),
    ("env reserved TORCHELASTIC_", BASE + "env: {TORCHELASTIC_FOO: '1'}\n", "env.TORCHELASTIC_FOO", "set by the orchestrator"),
    ("env reserved ORCHESTRATOR_", BASE + "env: {ORCHESTRATOR_X: '1'}\n", "env.ORCHESTRATOR_X", "set by the orchestrator"),
    ("zero grace", BASE + "stop_grace_period: 0\n", "stop_grace_period", "greater than or equal to 0.01"),
    ("negative launch timeout", BASE + "launch_timeout: -5\n", "launch_timeout", "greater than or equal to 0.01"),
    ("infinite timeout", BASE + "launch_timeout: .inf\n", "launch_timeout", "finite"),
    ("timeout as string", BASE + "launch_timeout: '5'\n", "launch_timeout", "must be a number"),
    ("timeout as bool", BASE + "launch_timeout: true\n", "launch_timeout", "must be a number"),
    ("zero connect timeout", BASE + "ssh: {connect_timeout: 0}\n", "ssh.connect_timeout", "greater than or equal to 0.01"),
    ("negative node timeout", BASE + "health: {node_timeout: -1}\n", "health.node_timeout", "greater than or equal to 0.01"),
    ("zero hang timeout", BASE + "health: {hang_timeout: 0}\n", "health.hang_timeout", "greater than or equal to 0.01"),
    ("node_timeout <= heartbeat", BASE + "health: {heartbeat_interval: 5, node_timeout: 5}\n", "health.node_timeout", "longer than heartbeat_interval"),
    ("backoff max < initial", BASE + "restart_backoff: {initial: 5, max: 1}\n", "restart_backoff.max", "at least initial"),
    ("backoff zero", BASE + "restart_backoff: {initial: 0}\n", "restart_backoff.initial", "greater than or equal to 0.01"),
    ("name uppercase", "name: Bad_Name\n" + BASE, "name", "[a-z0-9-]"),
    ("name empty", "name: ''\n" + BASE, "name", "[a-z0-9-]"),
    ("name too long", "name: " + "a" * 41 + "\n" + BASE, "name", "1..40"),
    ("name leading dash", "name: -a\n" + BASE, "name", "[a-z0-9-]"),
    ("host semicolon", "nodes: [{host: 'a;reboot'}]\n" + CMD, "nodes[0].host", "not a valid host"),
    ("host command substitution", "nodes: [{host: '$(id)'}]\n" + CMD, "nodes[0].host", "not a valid host"),
    ("host space", "nodes: [{host: 'a b'}]\n" + CMD, "nodes[0].host", "not a valid host"),
    ("host backtick", "nodes: [{host: '`id`'}]\n" + CMD, "nodes[0].host", "not a valid host"),
    ("host quote", "nodes: [{host: \"a'b\"}]\n" + CMD, "nodes[0].host", "not a valid host"),
    ("host leading dash", "nodes: [{host: '-oProxyCommand=x'}]\n" + CMD, "nodes[0].host", "not a valid host"),
    ("host bad user", "nodes: [{host: 'x;y@a'}]\n" + CMD, "nodes[0].host", "invalid user name"),
    ("host bad brackets", "nodes: [{host: '[abc]'}]\n" + CMD, "nodes[0].host", "IPv6"),
    ("user with shell chars", "nodes: [{host: a, user: 'x;y'}]\n" + CMD, "nodes[0].user", "invalid user name"),
    ("address with shell chars", "nodes: [{host: a, address: '$(x)'}]\n" + CMD, "nodes[0].address", "not a valid host"),
    ("identity_file newline", 'nodes: [{host: a, identity_file: "a\\nb"}]\n' + CMD, "nodes[0].identity_file", "newline"),
    ("workdir NUL", BASE + 'workdir: "a\\0"\n', "workdir", "NUL"),
    ("python with space", BASE + "python: 'python3 -c x'\n", "python", "[A-Za-z0-9_./+-]"),
    ("python leading dash", BASE + "python: -c\n", "python", "not starting with -"),
    ("unknown backend", BASE + "rendezvous: {backend: etcd}\n", "rendezvous.backend", "'static' or 'c10d'"),
    ("unknown host key policy", BASE + "ssh: {host_key_policy: yolo}\n", "ssh.host_key_policy", "'reject' or 'accept-new'"),
    ("fail_on_exit_codes 0", BASE + "fail_on_exit_codes: [0]\n", "fail_on_exit_codes[0]", "greater than or equal to 1"),
    ("fail_on_exit_codes 256", BASE + "fail_on_exit_codes: [1, 256]\n", "fail_on_exit_codes[1]", "less than or equal to 255"),
    ("network_check bytes too few", BASE + "health: {network_check: {bytes: 10}}\n", "health.network_check.bytes", "greater than or equal to 65536"),
    ("network_check misspelt", BASE + "health: {network_check: {min_mbps: 100}}\n", "health.network_check.min_mbps", "did you mean 'min_mb_per_s'"),
    ("network_check string", BASE + "health: {network_check: yes please}\n", "health.network_check", "must be a mapping"),
    ("gpus_per_node zero", BASE + "health: {gpus_per_node: 0}\n", "health.gpus_per_node", "greater than or equal to 1"),
    ("list document", "- a\n- b\n", "", "must be a mapping"),
    ("scalar document", "hello\n", "", "must be a mapping"),
    ("empty document", "", "", "empty"),
    ("comment-only document", "# nothing\n", "", "empty"),
    ("null document", "~\n", "", "empty"),
    ("two documents", BASE + "---\n" + BASE, "", "several YAML documents"),
    ("duplicate top key", BASE + "command: [y]\n", "command", "duplicate key (line 3)"),
    ("duplicate nested key", "nodes: [{host: a, host: b}]\n" + CMD, "nodes[0].host", "duplicate key"),
    ("duplicate env key", BASE + "env: {A: '1', A: '2'}\n", "env.A", "duplicate key"),
    ("alias bomb", BOMB, "f", "alias bomb"),
    ("recursive alias", BASE + "x: &a [*a]\n", "x[0]", "refers to a value that contains it"),
    ("deep nesting", "x: " + "[" * 5000 + "]" * 5000 + "\n" + BASE, "", "nested deeper than"),
    ("syntax error", "nodes: [{host: a}\ncommand: [x]\n", "", "invalid YAML: line 2"),
    ("tab indentation", "nodes: [{host: local}]\n\tcommand: [x]\n", "", "invalid YAML: line 2"),
    ("python tag", BASE + "x: !!python/object/apply:os.system ['id']\n", "", "invalid YAML"),
    ("complex key", BASE + "? [a]\n: 1\n", "", "keys must be plain names"),
]


@pytest.mark.parametrize("text,field,fragment", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_spec_is_refused_naming_the_field(text: str, field: str, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_jobspec(text)
    assert info.value.field == field
    assert fragment in str(info.value)
    if field:
        assert str(info.value).startswith(f"{field}: ")


def test_bad_value_is_shown() -> None:
    with pytest.raises(SpecError, match=r"nodes\[0\]\.host: not a valid host name or address "
                                        r"\(got 'a;b'\)"):
        parse_jobspec("nodes: [{host: 'a;b'}]\n" + CMD)


@pytest.mark.parametrize("text", [BOMB, "x: " + "[" * 100_000 + "\n"], ids=["bomb", "deep"])
def test_hostile_yaml_is_refused_fast(text: str) -> None:
    started = time.monotonic()
    with pytest.raises(SpecError):
        parse_jobspec(text)
    assert time.monotonic() - started < 1.0


def test_oversized_text_is_refused() -> None:
    with pytest.raises(SpecError, match="larger than"):
        parse_jobspec(BASE + "#" * (1024 * 1024))


BAD_FILES = [
    # (case id, spec file content, hostfile "hosts" beside it, the field path, a message fragment)
    ("over 1 MiB", (BASE + "#" * (1024 * 1024)).encode(), "", "", "larger than 1048576 bytes"),
    ("not UTF-8", BASE.encode() + b"# caf\xe9\n", "", "", "not UTF-8 (line 3, byte 56)"),
    ("hostfile unequal slots and nproc", b"hostfile: hosts\nnproc_per_node: 2\ncommand: [x]\n", "n1 slots=4\nn2 slots=2\n", "nproc_per_node", "different slots"),
    ("hostfile missing", b"hostfile: nope\ncommand: [x]\n", "", "hostfile", "cannot read hostfile"),
    ("hostfile not UTF-8", b"hostfile: hosts\ncommand: [x]\n", "n\udce9 slots=1\n", "hostfile", "not UTF-8"),
    ("nproc contradicts slots", b"hostfile: hosts\nnproc_per_node: 3\ncommand: [x]\n", "n1 slots=4\n", "nproc_per_node", "contradicts slots=4"),
    ("nproc bool with slots", b"hostfile: hosts\nnproc_per_node: true\ncommand: [x]\n", "n1 slots=1\n", "nproc_per_node", "whole number"),
]


@pytest.mark.parametrize("content,hosts,field,fragment", [c[1:] for c in BAD_FILES],
                         ids=[c[0] for c in BAD_FILES])
def test_bad_spec_file(tmp_path: Path, content: bytes, hosts: str, field: str,
                       fragment: str) -> None:
    (tmp_path / "hosts").write_bytes(hosts.encode("utf-8", "surrogateescape"))
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    with pytest.raises(SpecError) as info:
        load_jobspec(path)
    assert info.value.field == field
    assert fragment in str(info.value)


def test_missing_spec_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read spec file") as info:
        load_jobspec(tmp_path / "missing.yaml")
    assert info.value.field == ""


@pytest.mark.parametrize("hostfile,fragment", [
    ("n1 slots=4\nn2\n", "slots=N, or none (found 4, none)"),
    ("n1 gpus=4\n", "line 1: expected 'hostname slots=N'"),
    ("n1 slots=0\n", "line 1: expected 'hostname slots=N'"),
    ("# only a comment\n\n", "lists no hosts"),
    ("n1 slots=1\nn$(id) slots=1\n", "line 2: not a valid host name"),
    ("n1\n# again:\nn1\n", "line 3: duplicate host"),
])
def test_bad_hostfile(tmp_path: Path, hostfile: str, fragment: str) -> None:
    (tmp_path / "hosts").write_text(hostfile)
    with pytest.raises(SpecError) as info:
        parse_jobspec("hostfile: hosts\n" + CMD, base_dir=tmp_path)
    assert info.value.field == "hostfile"
    assert fragment in str(info.value)


def test_hostfile_expands_to_nodes_and_slots(tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text("# cluster\nn1 slots=4  # first\n\nbob@n2:2222 slots=4\n")
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text("hostfile: hosts\ncommand: [x]\n")
    spec = load_jobspec(spec_path)
    assert [n.host for n in spec.nodes] == ["n1", "bob@n2:2222"]
    assert spec.hostfile is None and spec.nproc_per_node == 4
    assert spec.nodes[1].resolved(spec.ssh) == ("bob", "n2", 2222)
    # An explicit nproc_per_node that agrees is fine; without slots it is the only source.
    (tmp_path / "hosts").write_text("n1 slots=4\n")
    assert parse_jobspec("hostfile: hosts\nnproc_per_node: 4\n" + CMD, base_dir=tmp_path)
    (tmp_path / "hosts").write_text("n1\nn2\n")
    assert parse_jobspec("hostfile: hosts\nnproc_per_node: 3\n" + CMD,
                         base_dir=tmp_path).nproc_per_node == 3


def test_minimal_spec_gets_the_defaults() -> None:
    spec = parse_jobspec("nodes: [{host: local}]\ncommand: [python, x.py]\n")
    assert spec.name == "job" and spec.command == ("python", "x.py") and spec.workdir == "."
    assert spec.nproc_per_node == 1 and spec.max_restarts == 0 and spec.fail_on_exit_codes == ()
    assert spec.min_nodes == spec.max_nodes == 1
    assert (spec.stop_grace_period, spec.launch_timeout, spec.python) == (10.0, 60.0, "python3")
    assert spec.rendezvous.backend == "static" and spec.rendezvous.port == "auto"
    assert (spec.restart_backoff.initial, spec.restart_backoff.max) == (1.0, 30.0)
    assert (spec.health.heartbeat_interval, spec.health.node_timeout) == (1.0, 30.0)
    assert spec.health.hang_timeout is None
    assert spec.ssh.host_key_policy == "reject" and spec.ssh.connect_timeout == 10.0
    assert spec.nodes[0].is_local and spec.nodes[0].hostname == "localhost"


FULL = """
name: ddp-demo
nodes:
  - host: local
  - {host: 'alice@gpu1:2200', identity_file: ~/.ssh/id, address: 10.0.0.5}
  - {host: gpu2, user: bob, port: 22}
  - {host: gpu3}
nproc_per_node: 2
nnodes: "2:3"
command: 'python train.py --name "a b"'
workdir: /srv/job
env: {NCCL_DEBUG: WARN, SEED: 3, VERSION: 1.10, MASK: 0x10, ON: x}
max_restarts: 3
fail_on_exit_codes: [2]
stop_grace_period: 2.5
launch_timeout: 30
python: /opt/venv/bin/python3
rendezvous: {backend: c10d, port: 29400, master_addr: 10.0.0.5}
restart_backoff: {initial: 0.5, max: 4}
health: {heartbeat_interval: 0.5, node_timeout: 3, hang_timeout: 60}
ssh: {user: carol, identity_file: ~/.ssh/id, known_hosts: /tmp/kh, host_key_policy: accept-new, connect_timeout: 3}
"""


def test_full_spec() -> None:
    spec = parse_jobspec(FULL)
    assert spec.command == ("python", "train.py", "--name", "a b")
    # Numbers stay the text written; ON stays a name (YAML 1.1 would make it the bool True).
    assert spec.env == {"NCCL_DEBUG": "WARN", "SEED": "3", "VERSION": "1.10", "MASK": "0x10",
                        "ON": "x"}
    assert (spec.min_nodes, spec.max_nodes) == (2, 3)
    assert spec.nodes[0].is_local and not spec.nodes[1].is_local
    assert spec.nodes[1].resolved(spec.ssh) == ("alice", "gpu1", 2200)
    assert spec.nodes[2].resolved(spec.ssh) == ("bob", "gpu2", 22)
    assert spec.nodes[3].resolved(spec.ssh) == ("carol", "gpu3", 22)
    assert spec.nodes[1].hostname == "gpu1" and spec.nodes[1].address == "10.0.0.5"
    assert spec.rendezvous.port == 29400 and spec.health.hang_timeout == 60
    assert spec.ssh.host_key_policy == "accept-new"
    # Frozen, and what the controller stores it as reads back the same.
    with pytest.raises(ValueError):
        spec.name = "other"  # type: ignore[misc]
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


@pytest.mark.parametrize("host,expected", [
    ("gpu1", (None, "gpu1", 22)),
    ("alice@gpu1", ("alice", "gpu1", 22)),
    ("alice@gpu1:2222", ("alice", "gpu1", 2222)),
    ("10.0.0.7:23", (None, "10.0.0.7", 23)),
    ("[fd00::5]:2222", (None, "fd00::5", 2222)),
    ("bob@[fd00::5]", ("bob", "fd00::5", 22)),
    ("fd00::5", (None, "fd00::5", 22)),
])
def test_host_strings_resolve(host: str, expected: tuple[str | None, str, int]) -> None:
    spec = parse_jobspec(f"nodes: [{{host: '{host}'}}]\n" + CMD)
    assert spec.nodes[0].resolved(spec.ssh) == expected
    assert spec.nodes[0].hostname == expected[1]


def test_local_nodes_may_repeat_and_mix_with_ssh() -> None:
    spec = parse_jobspec("nodes: [{host: local, address: 10.0.0.1}, {host: local, address: "
                         "10.0.0.1}, {host: a}]\nnnodes: 2\n" + CMD)
    assert spec.min_nodes == spec.max_nodes == 2 and len(spec.nodes) == 3
    spec = parse_jobspec("nodes: [{host: local}, {host: a}]\nrendezvous: {master_addr: b}\n" + CMD)
    assert spec.nodes[0].is_local


def test_aliases_and_merge_keys_still_work() -> None:
    spec = parse_jobspec("nodes:\n  - &n {host: a, user: bob, port: 2200}\n  - {<<: *n, host: b}\n"
                         + CMD)
    assert [n.resolved(spec.ssh) for n in spec.nodes] == [("bob", "a", 2200), ("bob", "b", 2200)]


def test_schema_file_is_in_sync() -> None:
    assert SCHEMA_PATH.read_text() == schema_text(), \
        "jobspecs/jobspec.schema.json is stale: run python -m orchestrator._schema"


@pytest.mark.parametrize("path", sorted(SCHEMA_PATH.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_reference_specs_load(path: Path) -> None:
    load_jobspec(path)


def test_set_and_env_overrides_are_validated_like_the_file():
    text = "nodes: [{host: local}, {host: local}]\ncommand: [x]\n"
    spec = parse_jobspec(text, overrides=["health.hang_timeout=30", "nodes[1].address=10.0.0.9",
                                          "max_duration=01:00:00", "command=[y, '--a=${rank}']"],
                         env={"EXTRA": "1"})
    assert spec.health.hang_timeout == 30 and spec.nodes[1].address == "10.0.0.9"
    assert spec.max_duration == 3600 and spec.command == ("y", "--a=${rank}")
    assert spec.env == {"EXTRA": "1"}
    for bad, field, words in [
        (["max_restarts=-1"], "max_restarts", "greater than or equal to 0"),
        (["nodes[5].host=a"], "nodes[5].host", "no such field to set"),
        (["helth.x=1"], "helth", "did you mean 'health'"),
        (["no-equals"], "", "field=value"),
        (["a..b=1"], "a..b", "not a field path"),
    ]:
        with pytest.raises(SpecError) as info:
            parse_jobspec(text, overrides=bad)
        assert info.value.field == field and words in str(info.value), (bad, str(info.value))
    with pytest.raises(SpecError) as info:
        parse_jobspec(text, env={"RANK": "3"})
    assert info.value.field == "env.RANK"


def test_placeholders_expand_per_worker_and_dollar_dollar_is_a_dollar():
    from orchestrator.placeholders import expand, names_in

    assert names_in("a ${rank} $$ ${job_id} $x") == {"rank", "job_id"}
    assert expand("r${rank} $$HOME $x", {"rank": 3}) == "r3 $HOME $x"
    spec = parse_jobspec("nodes: [{host: local}, {host: local}]\nnproc_per_node: 2\n"
                         "command: [p, '--local_rank=${local_rank}', '${node_rank}/${nnodes}']\n"
                         "env: {OUT: '/o/${rank}-${attempt}', FIXED: 'a$$b'}\n")
    from orchestrator.plan import plan_attempt

    plan = plan_attempt(spec, "j-1", attempt=2)
    w = plan.nodes[1].workers[1]
    assert w.argv == ("p", "--local_rank=1", "1/2") and w.env["OUT"] == "/o/3-2"
    assert plan.nodes[1].env["FIXED"] == "a$b" and "OUT" not in plan.nodes[1].env


def test_deprecated_nccl_variable_warns_with_the_new_name():
    spec = parse_jobspec("nodes: [{host: local}]\ncommand: [x]\n"
                         "env: {NCCL_ASYNC_ERROR_HANDLING: 1}\n")
    assert spec.env["NCCL_ASYNC_ERROR_HANDLING"] == "1"  # passed through unchanged
    assert any("TORCH_NCCL_ASYNC_ERROR_HANDLING" in w for w in spec.warnings)


def test_hostfile_with_different_slots_gives_each_node_its_own(tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text("n1 slots=4\nn2 slots=2\n")
    (tmp_path / "job.yaml").write_text("hostfile: hosts\ncommand: [x]\n")
    spec = load_jobspec(tmp_path / "job.yaml")
    assert [n.slots for n in spec.nodes] == [4, 2]
    from orchestrator.plan import plan_attempt

    plan = plan_attempt(spec, "j-1")
    assert plan.world_size == 6 and [len(n.workers) for n in plan.nodes] == [4, 2]
    assert [w.rank for w in plan.nodes[1].workers] == [4, 5]


def test_env_arguments_from_the_environment_a_file_or_written():
    from orchestrator import envargs

    env, written = envargs.parse(["A=1", "HOME_DIR"], [], {"HOME_DIR": "/h"})
    assert env == {"A": "1", "HOME_DIR": "/h"} and written == {"A"}
    with pytest.raises(SpecError, match=r"^--env: NOPE is not set in this environment"):
        envargs.parse(["NOPE"], [], {})
    with pytest.raises(SpecError, match=r"^--env: expects KEY or KEY=VALUE, got '1X'"):
        envargs.parse(["1X=2"], [], {})


def test_env_file_lines_and_the_line_that_is_wrong(tmp_path):
    from orchestrator import envargs

    good = tmp_path / "good.env"
    good.write_text("# c\n\nexport A_TOKEN='x y'\nB=\"q\"\nC=a=b\nD=\n")
    assert envargs.read_file(good) == {"A_TOKEN": "x y", "B": "q", "C": "a=b", "D": ""}
    bad = tmp_path / "bad.env"
    bad.write_text("A=1\nnot a pair\n")
    with pytest.raises(SpecError, match=rf"^--env-file: {bad} line 2: expected KEY=VALUE$"):
        envargs.read_file(bad)


def test_a_notify_url_is_checked_and_never_echoed():
    base = "nodes: [{host: local}]\ncommand: [x]\n"
    spec = parse_jobspec(base + "notify: [{url: 'https://hooks.example/T/abc', on: [failed]}]\n")
    assert spec.notify[0].on == ("failed",) and spec.notify[0].timeout == 5.0
    assert "hung" in parse_jobspec(base + "notify: [{url: 'http://127.0.0.1:9/x'}]\n").notify[0].on
    for bad in ("ftp://hooks.example/T0KEN", "https:///T0KEN", "T0KEN", "http://h/T0KEN x"):
        with pytest.raises(SpecError) as err:
            parse_jobspec(base + f"notify: [{{url: '{bad}'}}]\n")
        assert str(err.value).startswith("notify[0].url: must be an http:// or https:// URL")
        assert "T0KEN" not in str(err.value)
    with pytest.raises(SpecError, match=r"notify\[0\]\.on\[0\]"):
        parse_jobspec(base + "notify: [{url: 'http://h/x', on: [exploded]}]\n")


def test_the_network_check_is_off_by_default_and_true_means_its_defaults():
    assert parse_jobspec(BASE).health.network_check is None
    assert parse_jobspec(BASE + "health: {network_check: false}\n").health.network_check is None
    on = parse_jobspec(BASE + "health: {network_check: true}\n").health.network_check
    assert on is not None and (on.bytes, on.min_mb_per_s, on.timeout) == (8 * 2**20, None, 30.0)
    assert parse_jobspec(BASE).health.gpu_check is True
