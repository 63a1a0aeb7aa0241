"""``sync:``: the local project directory, shipped to every SSH node by content.

A *manifest* lists every file to ship (relative path, sha256, size, executable bit); its own
hash names the tree. On a node, files live once in a blob cache by content, and each tree is
built from them under ``~/.cache/orchestrator/sync/<tree>`` (the agent does that, see
``agents/node_agent.py``): a node receives only the blobs it does not have, so an unchanged
tree costs one manifest and no file contents. ``.gitignore`` at the root, the spec's
``exclude`` globs and ``.git/`` are left out. A symlink is shipped as the file it points to
when that is inside the tree, and refused when it points outside; an unreadable file is
refused too, both before anything starts.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import LaunchError

CHUNK = 1024 * 1024  # bytes of a blob per message
CACHE = "~/.cache/orchestrator"  # on the node, expanded by the agent


@dataclass(frozen=True)
class Entry:
    path: str  # relative, with "/"
    sha256: str
    size: int
    executable: bool


@dataclass
class Manifest:
    root: Path
    entries: list[Entry] = field(default_factory=list)

    @property
    def tree(self) -> str:
        """The content hash of the whole tree: paths, contents and modes."""
        text = json.dumps([[e.path, e.sha256, e.executable] for e in self.entries])
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def to_message(self) -> list[list[object]]:
        return [[e.path, e.sha256, e.executable] for e in self.entries]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps([[e.path, e.sha256, e.size, e.executable]
                                    for e in self.entries]))

    @classmethod
    def load(cls, path: Path, root: str | os.PathLike[str]) -> Manifest:
        entries = [Entry(p, sha, int(size), bool(x))
                   for p, sha, size, x in json.loads(path.read_text())]
        return cls(Path(root).resolve(), entries)


class _Ignore:
    """The common subset of .gitignore: globs, ``**``, a leading ``/`` anchoring to the
    root, a trailing ``/`` for directories only, ``!`` to take a pattern back."""

    def __init__(self, patterns: list[str]):
        self.rules: list[tuple[bool, bool, bool, str]] = []
        for raw in patterns:
            line = raw.rstrip("\n").rstrip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            line = line[1:] if negate else line
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = "/" in line
            self.rules.append((negate, dir_only, anchored, line.lstrip("/")))

    def ignored(self, rel: str, is_dir: bool) -> bool:
        result = False
        name = rel.rsplit("/", 1)[-1]
        for negate, dir_only, anchored, pattern in self.rules:
            if dir_only and not is_dir:
                continue
            target = rel if anchored else name
            if fnmatch.fnmatchcase(target, pattern) or (
                    "**" in pattern and fnmatch.fnmatchcase(rel, pattern.replace("**/", "*"))):
                result = not negate
        return result


def build_manifest(root: str | os.PathLike[str], exclude: tuple[str, ...] = ()) -> Manifest:
    """Walk ``root`` and hash what would be shipped; LaunchError names a symlink that leaves
    the tree or a file that cannot be read."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise LaunchError(f"sync: {root} is not a directory")
    patterns = [".git/"]
    gitignore = root / ".gitignore"
    if gitignore.is_file():
        patterns += gitignore.read_text(errors="replace").splitlines()
    patterns += list(exclude)
    ignore = _Ignore(patterns)
    manifest = Manifest(root)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        rel_dir = here.relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        kept = []
        for d in sorted(dirnames):
            full = here / d
            if ignore.ignored(rel_dir + d, True):
                continue
            if full.is_symlink():
                _inside(root, full)
                raise LaunchError(f"sync: {full} is a symlink to a directory; ship the "
                                  "directory itself or exclude it")
            kept.append(d)
        dirnames[:] = kept
        for f in sorted(filenames):
            rel = rel_dir + f
            if ignore.ignored(rel, False):
                continue
            full = here / f
            target = _inside(root, full) if full.is_symlink() else full
            try:
                st = target.stat()
                if not stat.S_ISREG(st.st_mode):
                    continue  # sockets, fifos: nothing to ship
                digest = hashlib.sha256()
                with open(target, "rb") as fh:
                    for block in iter(lambda: fh.read(CHUNK), b""):
                        digest.update(block)
            except OSError as exc:
                raise LaunchError(f"sync: cannot read {full}: {exc.strerror or exc}") from None
            manifest.entries.append(Entry(rel, digest.hexdigest(), st.st_size,
                                          bool(st.st_mode & 0o111)))
    return manifest


def _inside(root: Path, link: Path) -> Path:
    target = link.resolve()
    if target != root and root not in target.parents:
        raise LaunchError(f"sync: {link} points outside the synced tree ({target})")
    return target


def remote_tree_dir(tree: str) -> str:
    """Where the agent builds a tree on its node (``~`` expanded there)."""
    return f"{CACHE}/sync/{tree}"
