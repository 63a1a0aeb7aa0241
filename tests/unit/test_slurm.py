"""The Slurm backend's pure parts: the spec's ``slurm:`` block, and reading what Slurm's
commands print (the real commands run in tests/cluster/test_slurm_jobs.py)."""

from __future__ import annotations

import pytest

from orchestrator import slurm
from orchestrator.errors import AllocationRefused, LaunchError, SpecError
from orchestrator.spec import parse_jobspec
from orchestrator.transport.base import BOOTSTRAP
from orchestrator.transport.slurm import srun_argv

CMD = "command: [python, train.py]\n"
SLURM = "slurm: {nodes: 3}\n" + CMD


def test_a_slurm_spec_needs_no_nodes():
    spec = parse_jobspec("slurm: {nodes: 3, partition: gpu, time: '1-02:00:00', account: ml,"
                         " gres: 'gpu:4', extra: ['--constraint=a100', --exclusive]}\n"
                         "nnodes: '2:3'\n" + CMD)
    assert spec.slurm is not None and spec.slurm.nodes == 3 and spec.nodes == ()
    assert (spec.min_nodes, spec.max_nodes, spec.node_count) == (2, 3, 3)
    assert slurm.salloc_argv(spec.slurm, "orchestrator-x") == [
        "salloc", "--no-shell", "--nodes=3", "--job-name=orchestrator-x", "--partition=gpu",
        "--time=1-02:00:00", "--account=ml", "--gres=gpu:4", "--constraint=a100",
        "--exclusive"]
    # Quarantined nodes are excluded, with the spec's own --exclude (-x) if it has one.
    assert slurm.salloc_argv(spec.slurm, "o", ["n7", "n9"])[-3:] == [
        "--exclude=n7,n9", "--constraint=a100", "--exclusive"]
    own = parse_jobspec("slurm: {nodes: 2, extra: [-xn1, --exclusive]}\n" + CMD).slurm
    assert slurm.salloc_argv(own, "o", ["n7"])[-2:] == ["--exclude=n1,n7", "--exclusive"]
    assert slurm.salloc_argv(own, "o")[-2:] == ["-xn1", "--exclusive"]
    # Minutes as a number are Slurm's own reading of --time.
    assert parse_jobspec("slurm: {nodes: 1, time: 90}\n" + CMD).slurm.time == "90"  # type: ignore[union-attr]


BAD = [
    ("slurm and nodes", "nodes: [{host: local}]\n" + SLURM, "slurm", "not both"),
    ("slurm and hostfile", "hostfile: hosts\n" + SLURM, "hostfile", "give slurm or hostfile"),
    ("nodes missing", "slurm: {partition: gpu}\n" + CMD, "slurm.nodes", "required"),
    ("nodes zero", "slurm: {nodes: 0}\n" + CMD, "slurm.nodes", "greater than or equal to 1"),
    ("nodes string", "slurm: {nodes: three}\n" + CMD, "slurm.nodes", "whole number"),
    ("nodes bool", "slurm: {nodes: true}\n" + CMD, "slurm.nodes", "whole number"),
    ("unknown key", "slurm: {nodes: 1, partiton: gpu}\n" + CMD, "slurm.partiton",
     "did you mean 'partition'"),
    ("not a mapping", "slurm: 3\n" + CMD, "slurm", "must be a mapping"),
    ("partition with a space", "slurm: {nodes: 1, partition: 'a b'}\n" + CMD,
     "slurm.partition", "not a valid Slurm partition"),
    ("partition shell", "slurm: {nodes: 1, partition: 'a;rm'}\n" + CMD, "slurm.partition",
     "not a valid Slurm partition"),
    ("time garbage", "slurm: {nodes: 1, time: soon}\n" + CMD, "slurm.time", "time limit"),
    ("account newline", 'slurm: {nodes: 1, account: "a\\nb"}\n' + CMD, "slurm.account",
     "not a valid Slurm account"),
    ("gres shell", "slurm: {nodes: 1, gres: 'gpu:$(x)'}\n" + CMD, "slurm.gres", "gres"),
    ("extra not an option", "slurm: {nodes: 1, extra: [exclusive]}\n" + CMD,
     "slurm.extra[0]", "starting with -"),
    ("extra sets nodes", "slurm: {nodes: 1, extra: ['-N4']}\n" + CMD, "slurm.extra[0]",
     "use slurm.nodes"),
    ("extra sets partition", "slurm: {nodes: 1, extra: ['--partition=x']}\n" + CMD,
     "slurm.extra[0]", "use slurm.partition"),
    ("extra no-shell", "slurm: {nodes: 1, extra: ['--no-shell']}\n" + CMD, "slurm.extra[0]",
     "the orchestrator sets it"),
    ("extra not a list", "slurm: {nodes: 1, extra: '--exclusive'}\n" + CMD, "slurm.extra",
     "must be a list"),
    ("nnodes above slurm.nodes", "nnodes: '1:4'\n" + SLURM, "nnodes",
     "MAX 4 is more than the 3 slurm.nodes"),
]


@pytest.mark.parametrize("text,field,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_slurm_specs_name_the_field(text, field, fragment, tmp_path):
    (tmp_path / "hosts").write_text("a\n")
    with pytest.raises(SpecError) as info:
        parse_jobspec(text, base_dir=tmp_path)
    assert info.value.field == field, str(info.value)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_override_adds_a_slurm_setting():
    spec = parse_jobspec(SLURM, overrides=["slurm.partition=debug"])
    assert spec.slurm is not None and spec.slurm.partition == "debug"


def test_salloc_lines():
    assert slurm.parse_salloc_line("salloc: Granted job allocation 42\n") == "42"
    assert slurm.parse_salloc_line("salloc: Pending job allocation 7") == "7"
    assert slurm.parse_salloc_line("salloc: job 7 queued and waiting for resources") is None
    assert slurm.parse_salloc_line("salloc: error: invalid partition specified: x") is None


def test_salloc_errors_name_the_setting():
    spec = parse_jobspec("slurm: {nodes: 1, partition: nope, gres: 'gpu:9'}\n" + CMD).slurm
    assert spec is not None
    err = slurm.salloc_error(spec, "salloc: error: invalid partition specified: nope\n"
                             "salloc: error: Job submit/allocate failed: Invalid partition "
                             "name specified\n")
    assert isinstance(err, SpecError) and err.field == "slurm.partition"
    assert str(err).startswith("slurm.partition: refused by Slurm: Job submit/allocate failed")
    err = slurm.salloc_error(spec, "salloc: error: Invalid generic resource (gres) "
                             "specification\n")
    assert isinstance(err, SpecError) and err.field == "slurm.gres"
    err = slurm.salloc_error(spec, "salloc: error: Something else went wrong\n")
    assert isinstance(err, AllocationRefused) and isinstance(err, LaunchError)
    assert str(err) == "slurm: salloc failed: Something else went wrong"


def _requests(monkeypatch, outcome):
    """slurm.request with salloc replaced: ``outcome(exclude)`` raises or returns; the
    excludes asked for are returned."""
    asked: list[list[str]] = []

    def fake(spec, name, timeout, record, stop, exclude):
        asked.append(list(exclude))
        return outcome(exclude)

    monkeypatch.setattr(slurm, "require", lambda *commands: None)
    monkeypatch.setattr(slurm, "slurm_nodes", lambda: {"n1", "n7"})
    monkeypatch.setattr(slurm, "_request", fake)
    return asked


def test_a_refused_allocation_without_the_quarantined_nodes_is_asked_again_with_them(
        monkeypatch):
    spec = parse_jobspec(SLURM).slurm
    assert spec is not None
    granted = slurm.Allocation("42", owned=True, nodes=["n1", "n7", "n8"])

    def refuse_with_exclude(exclude):
        if exclude:
            raise slurm.salloc_error(spec, "salloc: error: Requested node configuration is "
                                     "not available\n")
        return granted

    asked = _requests(monkeypatch, refuse_with_exclude)
    assert slurm.request(spec, "o", 5, record=lambda a: None, exclude=["n7"]) is granted
    assert asked == [["n7"], []]


def test_other_launch_errors_are_not_asked_again_whatever_their_text(monkeypatch):
    spec = parse_jobspec(SLURM).slurm
    assert spec is not None

    def fail(exclude):  # not a refusal, though its text says "salloc failed"
        raise LaunchError("slurm: allocation 42 is not running (salloc failed to start it)")

    asked = _requests(monkeypatch, fail)
    with pytest.raises(LaunchError, match="is not running"):
        slurm.request(spec, "o", 5, record=lambda a: None, exclude=["n7"])
    assert asked == [["n7"]]

    def stopped(exclude):
        raise slurm.AllocationWaitStopped()

    asked = _requests(monkeypatch, stopped)
    with pytest.raises(slurm.AllocationWaitStopped):
        slurm.request(spec, "o", 5, record=lambda a: None, exclude=["n7"])
    assert asked == [["n7"]]


def test_scontrol_output():
    assert slurm.parse_hostnames("n0\nn1\n\ngpu-12\n") == ["n0", "n1", "gpu-12"]
    with pytest.raises(LaunchError, match="unexpected node name"):
        slurm.parse_hostnames("n0\n-oops\n")
    job = ("JobId=5 JobName=x UserId=root(0) JobState=RUNNING Reason=None Partition=debug "
           "ReqNodeList=(null) ExcNodeList=(null) NodeList=n[0-2] NumNodes=3 "
           "WorkDir=/a dir/with space")
    assert slurm.parse_job(job) == {"JobState": "RUNNING", "NodeList": "n[0-2]",
                                    "Partition": "debug", "NumNodes": "3"}
    assert slurm.parse_job("JobId=5 JobState=PENDING ReqNodeList=(null) NodeList=(null)")[
        "NodeList"] == "(null)"
    nodes = ("NodeName=n0 Arch=x86_64 NodeAddr=10.0.0.10 NodeHostName=n0\n"
             "NodeName=n1 Arch=x86_64 NodeAddr=n1.cluster NodeHostName=n1\n")
    assert slurm.parse_node_addresses(nodes) == {"n0": "10.0.0.10", "n1": "n1.cluster"}


def test_nodes_come_from_the_allocation():
    spec = parse_jobspec("slurm: {nodes: 2}\n" + CMD)
    placeholders = slurm.spec_with_nodes(spec, None)
    assert [n.host for n in placeholders.nodes] == ["slurm-node-0", "slurm-node-1"]
    alloc = slurm.Allocation("9", owned=True, nodes=["n0", "n1"],
                             addresses=["10.0.0.10", "not an address!"])
    nodes = slurm.spec_with_nodes(spec, alloc).nodes
    assert [(n.host, n.address) for n in nodes] == [("n0", "10.0.0.10"), ("n1", None)]
    assert all(not n.is_local for n in nodes)
    assert slurm.Allocation.from_dict(alloc.to_dict()) == alloc


def test_slurm_env_keeps_only_slurm_conf():
    env = slurm.slurm_env({"PATH": "/bin", "SLURM_CONF": "/etc/s.conf", "SLURM_JOB_ID": "4",
                           "SLURM_NTASKS": "8"})
    assert env == {"PATH": "/bin", "SLURM_CONF": "/etc/s.conf"}


def test_the_agent_step_is_an_argv_without_secrets():
    argv = srun_argv("12", "n3", "/opt/py/bin/python3")
    assert argv[:7] == ["srun", "--jobid=12", "--overlap", "--nodes=1", "--ntasks=1", "-w",
                        "n3"]
    # -I: the agent's interpreter isolated (none of the user's PYTHON* settings, no cwd on
    # sys.path); the step's environment, which workers start from, is left as it is.
    assert argv[-5:] == ["/opt/py/bin/python3", "-I", "-u", "-c", BOOTSTRAP]


def test_an_allocation_we_run_inside_of_must_be_large_enough(monkeypatch):
    spec = parse_jobspec("slurm: {nodes: 3}\n" + CMD)
    assert slurm.existing_allocation(spec, {}) is None
    with pytest.raises(LaunchError, match="not a Slurm job id"):
        slurm.existing_allocation(spec, {"SLURM_JOB_ID": "12; rm -rf"})

    def two(allocation):
        allocation.nodes, allocation.addresses = ["a", "b"], [None, None]

    monkeypatch.setattr(slurm, "read_nodes", two)
    with pytest.raises(SpecError, match="slurm.nodes: the allocation 12 .* has only 2 node"):
        slurm.existing_allocation(spec, {"SLURM_JOB_ID": "12"})


def test_missing_commands_are_named(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    spec = parse_jobspec(SLURM)
    with pytest.raises(LaunchError, match=r"^slurm: `salloc` is not on PATH"):
        slurm.quick_check(spec, {})
    with pytest.raises(LaunchError, match=r"^slurm: `srun` is not on PATH"):
        slurm.quick_check(spec, {"SLURM_JOB_ID": "3"})
