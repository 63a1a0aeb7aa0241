"""What filesystem ``$ORCHESTRATOR_HOME`` is on, and the SQLite journal that is safe there.

SQLite's WAL mode keeps a shared-memory index beside the database (``-shm``, mapped by every
process that opens it); SQLite documents that it does not work when the database is on a
network filesystem, where processes on two hosts do not share that memory. Homes on
clusters usually are on one (NFS, Lustre, GPFS, BeeGFS, CephFS, ...), and ``status`` may be
run on another login node than the one the controller runs on. So on a network filesystem
the store uses the rollback journal (``journal_mode=DELETE``): every reader, on any host that
mounts the home, sees a consistent database, given working POSIX locks there (NFSv4, or NFSv3
with lockd; Lustre mounted with ``flock``; GPFS; BeeGFS with global file locks). Elsewhere,
WAL (readers never wait for the controller's writes). ``ORCHESTRATOR_STORE_JOURNAL=wal`` or
``delete`` overrides the choice (e.g. a home on NFS that only one host ever uses).

The filesystem is found in ``/proc/self/mountinfo``: the mount whose mount point is the
longest prefix of the home's real path, and its type (``nfs4``, ``fuse.sshfs``, ...).
"""

from __future__ import annotations

import os
from pathlib import Path

# Filesystem types (as mountinfo names them) that other hosts may mount too.
NETWORK = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "lustre", "gpfs", "beegfs",
    "ceph", "glusterfs", "ocfs2", "gfs2", "9p", "davfs", "orangefs", "pvfs2", "quobyte",
    "wekafs", "panfs", "virtiofs",
})
NETWORK_FUSE = frozenset({"sshfs", "glusterfs", "ceph", "cephfs", "s3fs", "gcsfuse",
                          "rclone", "juicefs", "beegfs", "lustre", "moosefs", "mfs"})


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def filesystem(path: str | os.PathLike[str], mountinfo: str | None = None) -> str | None:
    """The type of the filesystem ``path`` is on (e.g. ``ext4``, ``nfs4``, ``fuse.sshfs``),
    or None when it cannot be told."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, kind = -1, None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        point = _unescape(fields[4])
        fstype = fields[fields.index("-") + 1]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # the last mount over a point wins
            best, kind = len(point), fstype
    return kind


def is_network(fstype: str | None) -> bool:
    if fstype is None:
        return False
    base, _, sub = fstype.partition(".")
    return fstype in NETWORK or (base in ("fuse", "fuseblk") and sub in NETWORK_FUSE)


def journal_mode(home: str | os.PathLike[str], mountinfo: str | None = None) -> tuple[str, str]:
    """The journal mode for a store in ``home`` and why: ``("wal" | "delete", reason)``."""
    forced = os.environ.get("ORCHESTRATOR_STORE_JOURNAL", "").lower()
    if forced in ("wal", "delete"):
        return forced, "ORCHESTRATOR_STORE_JOURNAL"
    kind = filesystem(home, mountinfo)
    if is_network(kind):
        return "delete", f"{kind}: a network filesystem (WAL needs memory shared by readers)"
    return "wal", kind or "unknown filesystem"
