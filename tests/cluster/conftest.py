"""The namespace cluster: N hosts with real sshd, for tests that cross a real network.

Needs root, iproute2 (``ip netns``) and openssh-server. Outside CI a missing capability skips
these tests; in CI (CI=true) it fails them: a skipped cluster test there would hide a broken
product.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _load_cluster_module() -> ModuleType:
    # examples/local-cluster is not a package (its name has a dash): load the file itself.
    name = "local_cluster"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "examples" / "local-cluster" / "cluster.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


local_cluster = _load_cluster_module()


def _missing() -> str | None:
    """Why a namespace cluster cannot be built here, or None if it can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if not shutil.which("ip"):
        return "needs iproute2 (ip)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    if not os.access(local_cluster.SSHD, os.X_OK):
        return f"needs openssh-server ({local_cluster.SSHD})"
    if not shutil.which("ssh-keygen") or not shutil.which("ssh"):
        return "needs openssh-client (ssh, ssh-keygen)"
    return None


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (our sshds name files in the cluster dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items; mark only ours.
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Three SSH hosts in network namespaces; leftovers of crashed runs are removed first,
    and the cluster is torn down at the end of the session (also after failures)."""
    reason = _missing()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cluster tests cannot run in CI: {reason}")
        pytest.skip(reason)
    local_cluster.cleanup_stale()
    c = local_cluster.Cluster(3, tmp_path_factory.mktemp("cluster")).up()
    try:
        yield c
    finally:
        c.down()
        # A teardown that leaves namespaces, links or sshd behind is a bug worth an error.
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True,
                                    text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        left = [h.netns for h in c.hosts if h.netns in namespaces]
        left += [name for name in [c.bridge, *(h.host_side_veth for h in c.hosts)]
                 if f" {name}:" in links or f" {name}@" in links]
        left += [f"process {pid}" for pid in _processes_mentioning(str(c.dir))]
        assert not left, f"cluster teardown left {left}"
