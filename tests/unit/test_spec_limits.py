"""Spec values at the edges (issue 30): a secret written into env by any ``--set``, integers
too long for Python to convert, seconds too short to wait, more local ranks than the agent
protocol carries. Each is one SpecError naming the field, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agents import protocol as P
from orchestrator import envargs
from orchestrator.errors import SpecError
from orchestrator.spec import parse_jobspec, validate_jobspec

ROOT = Path(__file__).resolve().parents[2]
BASE = "nodes: [{host: local}]\ncommand: [python, train.py]\n"
HUGE = "1" * 5000  # past Python's 4,300-digit limit on int <-> str conversion


def run_submit(tmp_path: Path, spec_text: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``orchestrator submit --dry-run`` in a process of its own: it starts nothing."""
    path = tmp_path / "job.yaml"
    path.write_text(spec_text)
    env = {**os.environ, "ORCHESTRATOR_HOME": str(tmp_path / "home")}
    return subprocess.run([sys.executable, "-m", "orchestrator", "submit", str(path),
                           "--dry-run", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=env)


def assert_one_error_line(result: subprocess.CompletedProcess[str], start: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), result.stderr[-2000:]


# --- 1. a secret put into env by any --set --------------------------------------------------

SECRET_SETS = [
    ("whole env, flow mapping", "env={API_TOKEN: x}", "API_TOKEN"),
    ("whole env, among others", "env={A: '1', hf_token: y}", "hf_token"),
    ("whole env, block mapping", "env=\n  DB_PASSWORD: x", "DB_PASSWORD"),
    ("whole env, merge key", "env={<<: {AWS_SECRET_ACCESS_KEY: x}}", "AWS_SECRET_ACCESS_KEY"),
    ("whole env, alias", "env={A: &v x, MY_CREDENTIALS: *v}", "MY_CREDENTIALS"),
    ("one key", "env.API_TOKEN=x", "API_TOKEN"),
    ("listed in secret_env", "env={PLAIN_NAME: x}", "PLAIN_NAME"),
]


@pytest.mark.parametrize("item,name", [c[1:] for c in SECRET_SETS], ids=[c[0] for c in SECRET_SETS])
def test_a_set_that_writes_a_secret_into_env_is_refused(item: str, name: str) -> None:
    spec = parse_jobspec(BASE + "secret_env: [PLAIN_NAME]\n", overrides=[item])
    with pytest.raises(SpecError) as info:
        envargs.refuse_written_secrets(spec, set(), [item])
    assert str(info.value) == (
        f"--env: {name}'s value is on the command line, where every local user can read it "
        f"(ps): pass --env {name} to take it from your environment, or --env-file FILE")


def test_a_set_env_without_a_secret_still_passes() -> None:
    sets = ["env={A: '1', B: 2}", "env.C=3", "health.hang_timeout=30", "env={}"]
    spec = parse_jobspec(BASE + "env: {API_TOKEN: from-the-file}\n", overrides=sets)
    envargs.refuse_written_secrets(spec, set(), sets)  # the file's secret is not written here


def test_a_secret_in_a_whole_env_set_is_refused_by_submit(tmp_path: Path) -> None:
    result = run_submit(tmp_path, BASE, "--set", "env={API_TOKEN: hunter2}")
    assert_one_error_line(result, "error: --env: API_TOKEN's value is on the command line")
    assert not (tmp_path / "home" / "state.db").exists()


# --- 2. integers past Python's conversion limit ---------------------------------------------

HUGE_INTS = [
    ("top level", BASE + f"max_restarts: {HUGE}\n", "max_restarts"),
    ("negative", BASE + f"max_restarts: -{HUGE}\n", "max_restarts"),
    ("hexadecimal", BASE + f"nproc_per_node: 0x{'f' * 5000}\n", "nproc_per_node"),
    ("sexagesimal", BASE + "max_restarts: 1" + ":59" * 3000 + "\n", "max_restarts"),
    ("nested", BASE + f"health: {{flight_recorder: {HUGE}}}\n", "health.flight_recorder"),
    ("in a list", BASE + f"fail_on_exit_codes: [1, {HUGE}]\n", "fail_on_exit_codes[1]"),
    ("explicit tag", BASE + f"max_restarts: !!int '{HUGE}'\n", "max_restarts"),
    # 20 digits: past SQLite's INTEGER (the store's max_restarts) and the protocol's counts.
    ("past 2**62", BASE + "max_restarts: 99999999999999999999\n", "max_restarts"),
    ("past 2**62 in hexadecimal", BASE + "spool_max_bytes: 0x4000000000000001\n",
     "spool_max_bytes"),
]


@pytest.mark.parametrize("text,field", [c[1:] for c in HUGE_INTS], ids=[c[0] for c in HUGE_INTS])
def test_an_integer_too_long_is_a_field_error(text: str, field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_jobspec(text)
    assert info.value.field == field, str(info.value)[:300]
    assert str(info.value).startswith(f"{field}: ") and len(str(info.value)) < 300


def test_the_largest_whole_number_still_loads() -> None:
    assert parse_jobspec(BASE + f"spool_max_bytes: {1 << 62}\n").spool_max_bytes == 1 << 62


BAD_SCALARS = [
    # (case id, the value, the field path, what it should have been)
    ("int tag on text", "max_restarts: !!int abc", "max_restarts", "whole number"),
    ("empty int tag", "max_restarts: !!int ''", "max_restarts", "whole number"),
    ("binary without digits", "max_restarts: !!int 0b", "max_restarts", "whole number"),
    ("float tag on text", "launch_timeout: !!float abc", "launch_timeout", "number"),
    ("bool tag on text", "health: {gpu_check: !!bool maybe}", "health.gpu_check", "boolean"),
    ("a thirteenth month", "name: 2001-13-45", "name", "date"),
    ("in env", "env: {DAY: 2001-13-45}", "env.DAY", "date"),
]


@pytest.mark.parametrize("line,field,what", [c[1:] for c in BAD_SCALARS],
                         ids=[c[0] for c in BAD_SCALARS])
def test_a_scalar_that_does_not_construct_is_a_field_error(line: str, field: str,
                                                           what: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_jobspec(BASE + line + "\n")
    assert str(info.value) == f"{field}: not a valid {what} (line 3)"


def test_an_integer_too_long_in_a_set_names_its_field() -> None:
    with pytest.raises(SpecError) as info:
        parse_jobspec(BASE, overrides=[f"max_restarts={HUGE}"])
    assert info.value.field == "max_restarts" and len(str(info.value)) < 300


def test_long_digits_as_text_are_still_text() -> None:
    spec = parse_jobspec(f"nodes: [{{host: local}}]\nenv: {{SEED: {HUGE}}}\n"
                         f"command: [x, '{HUGE}']\n")
    assert spec.env["SEED"] == HUGE and spec.command[1] == HUGE


def test_a_size_too_large_is_a_field_error() -> None:
    for size in ("9" * 400, "9" * 30 + "TiB"):
        with pytest.raises(SpecError) as info:
            parse_jobspec(BASE + f"checkpoint: {{memory: '{size}'}}\n")
        assert info.value.field == "checkpoint.memory" and "at most" in str(info.value)


def test_hostfile_slots_too_long_is_a_hostfile_error(tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text(f"n1 slots={HUGE}\n")
    with pytest.raises(SpecError) as info:
        parse_jobspec("hostfile: hosts\ncommand: [x]\n", base_dir=tmp_path)
    assert info.value.field == "hostfile" and "line 1" in str(info.value)
    assert len(str(info.value)) < 300


def test_an_integer_too_long_is_one_error_line_from_submit(tmp_path: Path) -> None:
    result = run_submit(tmp_path, BASE + f"max_restarts: {HUGE}\n")
    assert_one_error_line(result, "error: max_restarts: ")


# --- 3. seconds too short to wait for ---------------------------------------------------------

SECONDS_FIELDS = [
    ("health.heartbeat_interval", "health: {heartbeat_interval: %s}"),
    ("health.node_timeout", "health: {node_timeout: %s}"),
    ("health.hang_timeout", "health: {hang_timeout: %s}"),
    ("health.controller_grace", "health: {controller_grace: %s}"),
    ("health.node_check_timeout", "health: {node_check_timeout: %s}"),
    ("health.network_check.timeout", "health: {network_check: {timeout: %s}}"),
    ("stop_grace_period", "stop_grace_period: %s"),
    ("launch_timeout", "launch_timeout: %s"),
    ("setup_timeout", "setup_timeout: %s"),
    ("max_duration", "max_duration: %s"),
    ("ssh.connect_timeout", "ssh: {connect_timeout: %s}"),
    ("restart_backoff.initial", "restart_backoff: {initial: %s, max: %s}"),
    ("restart_backoff.max", "restart_backoff: {initial: 1.0e-300, max: %s}"),
    ("notify[0].timeout", "notify: [{url: 'http://h/x', timeout: %s}]"),
]


@pytest.mark.parametrize("field,line", SECONDS_FIELDS, ids=[c[0] for c in SECONDS_FIELDS])
def test_seconds_too_short_are_refused_naming_field_and_value(field: str, line: str) -> None:
    tiny = line.replace("%s", "1.0e-300")
    if field == "restart_backoff.max":  # initial must pass for max to be the one named
        tiny = "restart_backoff: {initial: 0.01, max: 1.0e-300}"
    with pytest.raises(SpecError) as info:
        parse_jobspec(BASE + tiny + "\n")
    assert info.value.field == field, str(info.value)
    assert str(info.value).endswith("must be greater than or equal to 0.01 (got 1e-300)")
    floor = FLOORS.get(field, line.replace("%s", "0.01"))
    parse_jobspec(BASE + floor + "\n")  # the floor itself is allowed


FLOORS = {  # where another field must agree for the floor to pass
    "restart_backoff.max": "restart_backoff: {initial: 0.01, max: 0.01}",
    "health.node_timeout": "health: {heartbeat_interval: 0.01, node_timeout: 0.02}",
}


def test_heartbeat_interval_from_python_data_is_bounded_too() -> None:
    data = {"nodes": [{"host": "local"}], "command": ["x"],
            "health": {"heartbeat_interval": 1e-300}}
    with pytest.raises(SpecError, match=r"^health\.heartbeat_interval: .*\(got 1e-300\)$"):
        validate_jobspec(data)


# --- 4. no more local ranks than the agent protocol carries ---------------------------------

def test_nproc_per_node_above_the_protocol_limit_is_refused() -> None:
    assert parse_jobspec(BASE + f"nproc_per_node: {P.MAX_LOCAL}\n").nproc_per_node == P.MAX_LOCAL
    for text, field in [(BASE + "nproc_per_node: 1000000\n", "nproc_per_node"),
                        (BASE + f"nproc_per_node: {P.MAX_LOCAL + 1}\n", "nproc_per_node"),
                        ("nodes: [{host: a, slots: 1000000}]\ncommand: [x]\n", "nodes[0].slots")]:
        with pytest.raises(SpecError) as info:
            parse_jobspec(text)
        assert info.value.field == field and str(P.MAX_LOCAL) in str(info.value), str(info.value)


def test_hostfile_slots_above_the_protocol_limit_are_refused(tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text("n1 slots=1000000\n")
    with pytest.raises(SpecError) as info:
        parse_jobspec("hostfile: hosts\ncommand: [x]\n", base_dir=tmp_path)
    assert str(P.MAX_LOCAL) in str(info.value), str(info.value)
