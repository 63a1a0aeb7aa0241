"""``orchestrator run``: real torchrun command lines become the spec ``submit`` would take,
validated by the spec's own code; flags without meaning here are noted, those that would
change what the script sees are refused, each error naming the flag."""

from __future__ import annotations

import subprocess

import pytest

from orchestrator import runargs
from orchestrator.errors import SpecError
from orchestrator.plan import plan_attempt
from orchestrator.spec import load_jobspec
from tests.helpers import PYTHON, ROOT

EXE = "/opt/venv/bin/python3"


def translate(line: str, cwd: str = "/work/proj", **kwargs):
    """A command line as a shell would split it (no shell here: plain words)."""
    return runargs.spec_from_torchrun_args(line.split(), cwd=cwd, executable=EXE, **kwargs)


def refused(line: str, **kwargs) -> str:
    with pytest.raises(SpecError) as info:
        request = translate(line, **kwargs)
        runargs.load(request)
    return str(info.value)


def argv(spec, rank=0):
    plan = plan_attempt(spec, "j-000001", attempt=1, master_port=29500, spec_dir="/work/proj")
    return [w.argv for n in plan.nodes for w in n.workers][rank]


def test_single_node_standalone_as_torchrun_starts_it():
    request = translate("--standalone --nproc-per-node 4 train.py --lr 3e-4")
    assert request.spec == {
        "name": "train", "nodes": [{"host": "local"}], "nproc_per_node": 4,
        "command": [EXE, "-u", "train.py", "--lr", "3e-4"], "workdir": "/work/proj"}
    assert request.notes == ()
    spec = runargs.load(request)
    assert spec.nproc_per_node == 4 and [n.host for n in spec.nodes] == ["local"]
    assert spec.rendezvous.backend == "static" and spec.workdir == "/work/proj"
    assert argv(spec, 3) == (EXE, "-u", "train.py", "--lr", "3e-4")


def test_without_hosts_it_is_one_local_node_and_python_exec_is_honoured():
    request = translate("--nproc_per_node=2 train.py", environ={"PYTHON_EXEC": "/usr/bin/py"})
    assert request.spec["nodes"] == [{"host": "local"}]
    assert request.spec["command"] == ["/usr/bin/py", "-u", "train.py"]


def test_multi_node_c10d_with_an_endpoint_on_the_first_host():
    request = translate("--hosts gpu1,alice@gpu2:2222 --nnodes 2 --nproc-per-node 8 "
                        "--rdzv-backend c10d --rdzv-endpoint gpu1:29400 --rdzv-id job42 "
                        "--max-restarts 3 train.py --epochs 10")
    spec = runargs.load(request)
    assert [n.host for n in spec.nodes] == ["gpu1", "alice@gpu2:2222"]
    assert spec.rendezvous.backend == "c10d" and spec.rendezvous.port == 29400
    assert spec.rendezvous.master_addr is None  # node 0's own address: gpu1
    assert spec.max_restarts == 3 and spec.min_nodes == spec.max_nodes == 2
    # Remote nodes: the login's python3; torchrun (started by us under c10d) adds -u.
    assert spec.command == ("python3", "train.py", "--epochs", "10")
    assert request.notes == ("--rdzv-id ignored: the job id names the run "
                             "(TORCHELASTIC_RUN_ID)",)


def test_the_endpoints_host_becomes_node_0_and_an_unlisted_address_is_the_masters():
    spec = runargs.load(translate("--hosts a,b,c --rdzv_endpoint=b:29400 train.py"))
    assert [n.host for n in spec.nodes] == ["b", "a", "c"]
    spec = runargs.load(translate("--hosts a,b --master-addr 10.0.0.5 --master-port 29501 "
                                  "train.py"))
    assert spec.rendezvous.master_addr == "10.0.0.5" and spec.rendezvous.port == 29501
    request = translate("--hosts a,b --rdzv-endpoint a:29400 --master-addr x train.py")
    assert request.notes == ("--master-addr ignored: --rdzv-endpoint names the rendezvous "
                             "(as torchrun does)",)
    assert "loopback" in refused("--hosts a,b --rdzv-endpoint localhost:29400 train.py")
    local = runargs.load(translate("--rdzv-endpoint localhost:0 --nproc-per-node 2 t.py"))
    assert local.rendezvous.port == "auto" and local.rendezvous.master_addr is None


def test_a_module_and_its_arguments():
    request = translate("--nproc-per-node 2 -m pkg.train --config cfg.yaml")
    assert request.spec["command"] == [EXE, "-u", "-m", "pkg.train", "--config", "cfg.yaml"]
    assert request.spec["name"] == "pkg-train"
    assert runargs.load(request).command[2:4] == ("-m", "pkg.train")


def test_no_python_runs_the_program_itself_and_refuses_a_module_with_it():
    request = translate("--no-python --nproc-per-node 2 ./launch.sh fast")
    assert request.spec["command"] == ["./launch.sh", "fast"]
    assert request.spec["name"] == "launch-sh"
    assert "--module" in refused("--no_python -m pkg.mod")


def test_nnodes_min_max_over_hosts_and_more_than_there_are():
    spec = runargs.load(translate("--hosts a,b --nnodes 1:2 --nproc-per-node 2 train.py"))
    assert (spec.min_nodes, spec.max_nodes) == (1, 2)
    assert refused("--hosts a,b --nnodes 1:3 train.py").startswith("--nnodes: 3 node(s)")
    assert "this machine alone" in refused("--nnodes 2 train.py")
    assert refused("--nnodes 2:1 --hosts a,b t.py").startswith("--nnodes: MIN is larger")
    assert refused("--nnodes two t.py").startswith("--nnodes:")


def test_a_hostfile_with_slots(tmp_path):
    (tmp_path / "hosts").write_text("# the cluster\ngpu1 slots=4\ngpu2 slots=4  # spare\n")
    request = translate("--hostfile hosts --nnodes 1:2 train.py", cwd=str(tmp_path))
    spec = runargs.load(request)
    assert [n.host for n in spec.nodes] == ["gpu1", "gpu2"] and spec.nproc_per_node == 4
    (tmp_path / "mixed").write_text("gpu1 slots=8\ngpu2 slots=2\n")
    spec = runargs.load(translate("--hostfile mixed train.py", cwd=str(tmp_path)))
    assert [n.slots for n in spec.nodes] == [8, 2]
    wrong = translate("--hostfile hosts --nproc-per-node 2 train.py", cwd=str(tmp_path))
    with pytest.raises(SpecError, match="^--nproc-per-node: contradicts slots=4"):
        runargs.load(wrong)
    second = translate("--hostfile hosts --rdzv-endpoint gpu2:29400 t.py", cwd=str(tmp_path))
    with pytest.raises(SpecError, match="^--rdzv-endpoint: gpu2 is host 2 of the hostfile"):
        runargs.load(second)
    with pytest.raises(SpecError, match="^--hostfile: cannot read hostfile"):
        runargs.load(translate("--hostfile nope t.py", cwd=str(tmp_path)))


def test_slurm_nodes():
    spec = runargs.load(translate("--slurm-nodes 4 --nnodes 3:4 --nproc-per-node gpu t.py"))
    assert spec.slurm is not None and spec.slurm.nodes == 4 and spec.nproc_per_node == "gpu"
    assert spec.command[0] == "python3"
    assert refused("--slurm-nodes 2 --nnodes 3 t.py").startswith("--nnodes: MAX 3")
    assert refused("--slurm-nodes 0 t.py").startswith("--slurm-nodes:")
    assert refused("--hosts a --slurm-nodes 2 t.py").startswith("--slurm-nodes: give one of")


def test_everything_after_the_script_is_the_scripts_untouched():
    request = translate("--nproc-per-node 2 train.py --hosts x --node-rank 3 -- $HOME ${rank}")
    spec = runargs.load(request)
    assert [n.host for n in spec.nodes] == ["local"]
    assert argv(spec, 1)[2:] == ("train.py", "--hosts", "x", "--node-rank", "3", "--",
                                 "$HOME", "${rank}")
    request = translate("--nproc-per-node 2 -- -weird.py --x")
    assert request.spec["command"] == [EXE, "-u", "-weird.py", "--x"]


def test_flags_without_meaning_here_are_noted_one_each():
    request = translate("--standalone -t 3 -r3 --log-dir /tmp/l --rdzv-conf join_timeout=900 "
                        "--monitor-interval 1 --start-method fork --role default "
                        "--local_addr 10.0.0.1 --rdzv-endpoint x:1 train.py")
    flags = [note.split()[0] for note in request.notes]
    assert flags == ["--tee", "--redirects", "--log-dir", "--rdzv-conf", "--monitor-interval",
                     "--start-method", "--local-addr", "--rdzv-endpoint"]
    assert "--rdzv-endpoint ignored with --standalone" in request.notes[-1]
    runargs.load(request)
    assert translate("--role trainer t.py").notes[0].startswith("--role ignored")
    assert "--start-method: must be one of" in refused("--start-method thread t.py")


def test_refusals_name_the_flag_and_say_why():
    assert refused("--node-rank 0 train.py").startswith(
        "--node-rank: not needed: the orchestrator gives each node its rank")
    assert refused("--node_rank=1 train.py").startswith("--node-rank: not needed")
    assert refused("--virtual-local-rank t.py").startswith("--virtual-local-rank:")
    assert refused("--rdzv-backend etcd-v2 --rdzv-endpoint e:2379 t.py").startswith(
        "--rdzv-backend: must be static or c10d")
    assert refused("--nproc-per-node xpu t.py").startswith("--nproc-per-node: must be")
    assert refused("--hosts a --nproc-per-node cpu t.py").startswith("--nproc-per-node: cpu")
    assert refused("--nproc-per-node 0 t.py").startswith("--nproc-per-node: must be")
    assert refused("--max-restarts -1 t.py").startswith("--max-restarts:")
    assert refused("--max-restarts many t.py").startswith("--max-restarts: must be a whole")
    assert refused("--shutdown-timeout 0 t.py").startswith("--shutdown-timeout:")
    assert refused("--hosts a,a t.py").startswith("--hosts: a: duplicate host")
    assert refused("--hosts a;rm t.py").startswith("--hosts: 'a;rm'")
    assert refused("--hosts a,,b t.py").startswith("--hosts: an empty host")
    assert refused("--name Bad_Name t.py").startswith("--name:")
    assert refused("--standalone --hosts a t.py").startswith("--standalone: runs one node")
    assert refused("--nproc-per-node").startswith("--nproc-per-node: expects a value")
    assert refused("--standalone=1 t.py").startswith("--standalone: takes no value")
    assert refused("--nprc-per-node 2 t.py").startswith(
        "--nprc-per-node: unknown option (not one of torchrun's or ours; did you mean "
        "--nproc-per-node?)")
    assert refused("--host a t.py").startswith("--host: ambiguous option")
    assert refused("-x t.py").startswith("-x: unknown option")
    assert refused("--nproc-per-node 2").startswith("run: the script to run is missing")


def test_prefixes_underscores_and_attached_values_as_torchruns_parser():
    request = translate("--nproc 3 --max_restarts=2 --master_port=29600 -r=3 t.py")
    assert request.spec["nproc_per_node"] == 3 and request.spec["max_restarts"] == 2
    assert request.spec["rendezvous"] == {"port": 29600}
    assert translate("-h").help and translate("--help t.py").help
    assert not translate("t.py --help").help
    assert translate("--nproc-per-node cpu t.py", cpus=6).spec["nproc_per_node"] == 6
    assert "one per CPU" in translate("--nproc-per-node auto t.py").notes[0]


def test_env_from_the_command_line_reaches_the_spec_and_reserved_names_are_refused():
    request = translate("--env WANDB_PROJECT --env-file .env t.py")
    assert request.env == ("WANDB_PROJECT",) and request.env_files == (".env",)
    assert runargs.load(request, {"WANDB_PROJECT": "p"}).env == {"WANDB_PROJECT": "p"}
    with pytest.raises(SpecError, match="^--env: RANK: is set by the orchestrator"):
        runargs.load(request, {"RANK": "1"})


def test_the_saved_spec_validates_as_submit_reads_it_and_is_the_same_job(tmp_path):
    (tmp_path / "hosts").write_text("gpu1 slots=2\ngpu2 slots=2\n")
    line = ("--hostfile hosts --nnodes 1:2 --max-restarts 2 --rdzv-id 9 --env HOME "
            "train.py --tag a$b --name x é")
    request = runargs.spec_from_torchrun_args(line.split(), cwd=str(tmp_path), executable=EXE)
    saved = runargs.save(request, "job.yaml")
    text = saved.read_text()
    assert text.startswith("# Written by `orchestrator run`; run it again with:\n"
                           "#   orchestrator submit job.yaml --follow --env HOME\n")
    assert "# note: --rdzv-id ignored" in text
    again = load_jobspec(saved)
    assert again == runargs.load(request)
    assert argv(again)[-5:] == ("--tag", "a$b", "--name", "x", "é")


def test_a_refusal_from_the_command_is_one_error_line_and_exit_2(tmp_path):
    done = subprocess.run([PYTHON, "-m", "orchestrator", "run", "--node_rank=1",
                           "--nproc-per-node", "2", "train.py"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2, done
    assert done.stderr.splitlines() == [
        "error: --node-rank: not needed: the orchestrator gives each node its rank (the "
        "first host is node 0 and hosts the master); remove it and list every node once, "
        "with --hosts or --hostfile"]
    assert done.stdout == ""
