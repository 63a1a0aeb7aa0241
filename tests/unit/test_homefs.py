"""Where the store is: the filesystem under $ORCHESTRATOR_HOME, found in mountinfo, and the
journal that is safe there (WAL locally, the rollback journal on a network filesystem)."""

from __future__ import annotations

import sqlite3
import threading

from orchestrator import homefs
from orchestrator.store import Store

MOUNTINFO = r"""22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:1 / / rw,relatime - ext4 /dev/vda1 rw
40 27 0:50 / /home rw,relatime - nfs4 fs1:/export/home rw,vers=4.2
41 40 0:51 / /home/alice/scratch rw - lustre 10.0.0.1@tcp:/scratch rw,flock
42 27 0:52 / /mnt/my\040disk rw - fuse.sshfs bob@gpu1:/data rw
43 27 0:53 / /run/user/1000 rw - tmpfs tmpfs rw
"""


def test_the_filesystem_of_a_path_is_its_deepest_mount():
    assert homefs.filesystem("/home/alice/.orchestrator", MOUNTINFO) == "nfs4"
    assert homefs.filesystem("/home/alice/scratch/x", MOUNTINFO) == "lustre"
    assert homefs.filesystem("/home/alicex", MOUNTINFO) == "nfs4"
    assert homefs.filesystem("/homes", MOUNTINFO) == "ext4"
    assert homefs.filesystem("/mnt/my disk/h", MOUNTINFO) == "fuse.sshfs"
    assert homefs.filesystem("/run/user/1000/orchestrator", MOUNTINFO) == "tmpfs"


def test_which_filesystems_are_network_ones():
    for kind in ("nfs", "nfs4", "cifs", "lustre", "gpfs", "beegfs", "ceph", "fuse.sshfs",
                 "fuse.glusterfs", "9p"):
        assert homefs.is_network(kind), kind
    for kind in ("ext4", "xfs", "btrfs", "tmpfs", "overlay", "fuse.portal", None):
        assert not homefs.is_network(kind), kind


def test_the_journal_is_wal_locally_and_the_rollback_journal_on_nfs(monkeypatch):
    assert homefs.journal_mode("/home/alice/.orchestrator", MOUNTINFO)[0] == "delete"
    assert homefs.journal_mode("/var/lib/x", MOUNTINFO)[0] == "wal"
    monkeypatch.setenv("ORCHESTRATOR_STORE_JOURNAL", "wal")
    assert homefs.journal_mode("/home/alice/.orchestrator", MOUNTINFO) == \
        ("wal", "ORCHESTRATOR_STORE_JOURNAL")


def test_a_store_on_a_network_filesystem_uses_the_rollback_journal(tmp_path, monkeypatch):
    monkeypatch.setattr(homefs, "filesystem", lambda path, mountinfo=None: "nfs4")
    writer = Store(tmp_path / "home", durable=True)
    assert writer.journal == "delete" and "network" in writer.journal_why
    assert writer._db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    writer.create_job("nfs-000001", "nfs", "{}", str(tmp_path), 0, ["a"])
    assert not (tmp_path / "home" / "state.db-wal").exists()
    errors: list[BaseException] = []

    def read() -> None:  # a reader, as `status` on the same or another host
        reader = Store(tmp_path / "home")
        try:
            for _ in range(50):
                reader.get_job("nfs-000001")
        except (sqlite3.Error, OSError) as exc:
            errors.append(exc)
        finally:
            reader.close()

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for i in range(50):
        writer.update_job("nfs-000001", attempt=i)
    for t in threads:
        t.join()
    assert not errors and writer.get_job("nfs-000001").attempt == 49
    writer.close()
