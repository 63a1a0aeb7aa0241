"""submit's quick check reads known_hosts without paramiko (orchestrator/transport/hosts.py):
it must find exactly the names paramiko's own lookup finds, plain, hashed, with a port, in a
comma-separated list."""

from __future__ import annotations

import paramiko

from orchestrator.spec import parse_jobspec
from orchestrator.transport.hosts import known_host_names


def test_the_quick_check_knows_a_host_exactly_when_paramiko_does(tmp_path):
    blob, kind = paramiko.RSAKey.generate(1024).get_base64(), "ssh-rsa"
    hashed = paramiko.HostKeys.hash_host("hashed.example")
    hashed_port = paramiko.HostKeys.hash_host("[hp.example]:2222")
    lines = [f"plain.example {kind} {blob}", f"a.example,b.example {kind} {blob}",
             f"[port.example]:2222 {kind} {blob}", f"{hashed} {kind} {blob}",
             f"{hashed_port} {kind} {blob}", "# comment.example ssh-rsa AAAA", "short.example",
             ""]
    known = tmp_path / "known_hosts"
    known.write_text("\n".join(lines))
    spec = parse_jobspec(f"nodes: [{{host: x}}]\ncommand: [t]\nssh: {{known_hosts: {known}}}\n")
    theirs = paramiko.HostKeys(str(known))
    for host, port in [("plain.example", 22), ("a.example", 22), ("b.example", 22),
                       ("port.example", 2222), ("port.example", 22), ("plain.example", 2222),
                       ("hashed.example", 22), ("hp.example", 2222), ("hp.example", 22),
                       ("comment.example", 22), ("short.example", 22), ("nowhere", 22)]:
        name = host if port == 22 else f"[{host}]:{port}"
        assert known_host_names(spec, host, port) == (theirs.lookup(name) is not None), name
    assert known_host_names(spec, "plain.example", 22)
    missing = parse_jobspec("nodes: [{host: x}]\ncommand: [t]\n"
                            f"ssh: {{known_hosts: {tmp_path / 'none'}}}\n")
    assert not known_host_names(missing, "plain.example", 22)
