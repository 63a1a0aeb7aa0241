"""``sync:``: the local project directory, shipped to every SSH node by content.

A *manifest* lists every file to ship (relative path, sha256, size, executable bit); its own
hash names the tree. On a node, files live once in a blob cache by content, and each tree is
built from them under ``~/.cache/orchestrator/sync/<tree>`` (the agent does that, see
``agents/cache.py``): a node receives only the blobs it does not have, so an unchanged
tree costs one manifest and no file contents. What is shipped is what git tracks or would
track (``shipped_files``: git itself in a work tree, every .gitignore on the way otherwise),
less the spec's ``exclude`` globs. A symlink is shipped as the file it points to when that
is inside the tree, and refused when it points outside or to a directory (in a git work
tree or not); a symlink loop, an unreadable file, directory or .gitignore, and a tree over
``sync.max_bytes`` are refused too, each in one line naming the path, all before anything
starts.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import subprocess
import typing
from dataclasses import dataclass, field
from pathlib import Path

from pathspec import GitIgnoreSpec

from orchestrator.errors import LaunchError

CHUNK = 1024 * 1024  # bytes of a blob per message
CACHE = "~/.cache/orchestrator"  # on the node, expanded by the agent
MANIFEST_FILE = "sync-manifest.json"  # kept in the job's directory: the tree is hashed once


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

    def to_command(self) -> tuple[tuple[str, str, bool], ...]:
        """The ``files`` of a ``sync_build`` (agents/commands.py)."""
        return tuple((e.path, e.sha256, e.executable) for e in self.entries)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps([[e.path, e.sha256, e.size, e.executable]
                                    for e in self.entries]))

    @classmethod
    def load(cls, path: Path, root: str | os.PathLike[str]) -> Manifest:
        entries = [Entry(p, sha, int(size), bool(x))
                   for p, sha, size, x in json.loads(path.read_text())]
        return cls(Path(root).resolve(), entries)


def build_manifest(root: str | os.PathLike[str], exclude: tuple[str, ...] = (),
                   max_bytes: int | None = None) -> Manifest:
    """Hash what would be shipped from ``root``: what git tracks or would track there (see
    ``shipped_files``), less ``exclude``. LaunchError names a symlink that leaves the tree or
    points to a directory, a file that cannot be read, or a tree over ``max_bytes`` (with
    its largest directories), the last before a single file is hashed."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise LaunchError(f"sync: {root} is not a directory")
    excluded = GitIgnoreSpec.from_lines([".git/", *exclude])
    found: list[tuple[str, Path, os.stat_result]] = []
    for rel in shipped_files(root):
        if excluded.match_file(rel):
            continue
        full = root / rel
        if full.is_symlink():
            target = _inside(root, full)
            if target.is_dir():
                raise LaunchError(f"sync: {full} is a symlink to a directory; ship the "
                                  "directory itself or exclude it")
        else:
            target = full
        try:
            st = target.stat()
        except OSError as exc:
            raise LaunchError(f"sync: cannot read {full}: {exc.strerror or exc}") from None
        if stat.S_ISREG(st.st_mode):  # sockets, fifos: nothing to ship
            found.append((rel, target, st))
    total = sum(st.st_size for _, _, st in found)
    if max_bytes is not None and total > max_bytes:
        raise LaunchError(f"sync: {root} holds {_size(total)} to ship, more than "
                          f"sync.max_bytes ({_size(max_bytes)}); largest: "
                          f"{_largest(found)}. Exclude what the job does not need "
                          "(.gitignore, sync.exclude) or raise sync.max_bytes")
    manifest = Manifest(root)
    for rel, target, st in found:
        digest = hashlib.sha256()
        try:
            with open(target, "rb") as fh:
                for block in iter(lambda: fh.read(CHUNK), b""):
                    digest.update(block)
        except OSError as exc:
            raise LaunchError(f"sync: cannot read {root / rel}: {exc.strerror or exc}") from None
        manifest.entries.append(Entry(rel, digest.hexdigest(), st.st_size,
                                      bool(st.st_mode & 0o111)))
    return manifest


def shipped_files(root: Path) -> list[str]:
    """Every file under ``root`` that git tracks or would track, relative, sorted: ``git
    ls-files --cached --others --exclude-standard`` where ``root`` is in a git work tree
    (nested .gitignore files, negations, .git/info/exclude, the user's global excludes;
    a submodule or a nested repository is listed the same way inside), else a walk that
    reads every .gitignore on the way with pathspec's implementation of git's rules."""
    listed = _git_files(root)
    if listed is None:
        return _walk(root)
    out = []
    for rel in listed:
        full = root / rel
        if full.is_dir() and not full.is_symlink():  # a submodule or a nested repository
            out += [f"{rel}/{inner}" for inner in shipped_files(full)]
        elif os.path.lexists(full):  # not a tracked file deleted since
            out.append(rel)
    return sorted(out)


def _git_files(root: Path) -> list[str] | None:
    """What git lists under ``root``, or None when it is not in a work tree (or no git)."""
    try:
        inside = subprocess.run(["git", "-C", str(root), "rev-parse", "--is-inside-work-tree"],
                                capture_output=True, text=True, timeout=30)
        if inside.returncode != 0 or inside.stdout.strip() != "true":
            return None
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached",
                                 "--others", "--exclude-standard"],
                                capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listed.returncode != 0:
        return None
    # git lists around a directory it cannot open, with a warning: that is a file not shipped
    unreadable = re.search(r"could not open directory '(.*)': (.*)",
                           listed.stderr.decode("utf-8", "replace"))
    if unreadable:
        raise LaunchError(f"sync: cannot read {root / unreadable[1].rstrip('/')}: "
                          f"{unreadable[2]}")
    names = listed.stdout.decode("utf-8", "surrogateescape").split("\0")
    return sorted({n.rstrip("/") for n in names if n})


def _walk(root: Path) -> list[str]:
    """Files under ``root`` that the .gitignore files on the way leave in."""
    rules: list[str] = []
    spec = GitIgnoreSpec.from_lines([".git/"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_unreadable):
        here = Path(dirpath)
        rel_dir = here.relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        gitignore = here / ".gitignore"
        if gitignore.is_file():
            try:
                text = gitignore.read_text(errors="replace")
            except OSError as exc:
                _unreadable(exc)
            rules += _rebase(text.splitlines(), rel_dir)
            spec = GitIgnoreSpec.from_lines([".git/", *rules])
        prefix = f"{rel_dir}/" if rel_dir else ""
        # A symlink to a directory is a file to git (its rules match it as one), listed so
        # that build_manifest refuses it as it does in a work tree; os.walk never enters it.
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        # An ignored directory is not entered: nothing below it can be taken back (git).
        dirnames[:] = sorted(d for d in dirnames
                             if d not in links and not spec.match_file(f"{prefix}{d}/"))
        out += [prefix + f for f in filenames + links if not spec.match_file(prefix + f)]
    return sorted(out)


def _unreadable(exc: OSError) -> typing.NoReturn:
    raise LaunchError(f"sync: cannot read {exc.filename}: {exc.strerror or exc}") from None


def _rebase(lines: list[str], directory: str) -> list[str]:
    """A .gitignore's patterns from ``directory``, as patterns relative to the tree's root:
    one with a slash (not at its end) is anchored to its directory, one without matches at
    any depth below it."""
    if not directory:
        return lines
    out = []
    for raw in lines:
        line = raw.rstrip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        anchored = "/" in pattern.rstrip("/")
        rebased = f"{directory}/{pattern.lstrip('/')}" if anchored else \
            f"{directory}/**/{pattern}"
        out.append(("!" if negate else "") + rebased)
    return out


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _largest(found: list[tuple[str, Path, os.stat_result]], count: int = 3) -> str:
    """The largest directories (the first two levels) and files at the top, by size."""
    sizes: dict[str, int] = {}
    for rel, _, st in found:
        parts = rel.split("/")
        for depth in (1, 2):
            if len(parts) > depth:
                key = "/".join(parts[:depth]) + "/"
                sizes[key] = sizes.get(key, 0) + st.st_size
        if len(parts) == 1:
            sizes[rel] = st.st_size
    # Of a directory and the one inside it that holds all of it, the deeper says more.
    shown = sorted(sizes.items(), key=lambda kv: (-kv[1], -kv[0].count("/")))
    picked: list[tuple[str, int]] = []
    for name, size in shown:
        if any(name.startswith(p) or p.startswith(name) for p, _ in picked):
            continue
        picked.append((name, size))
        if len(picked) == count:
            break
    return ", ".join(f"{name} {_size(size)}" for name, size in picked)


def _inside(root: Path, link: Path) -> Path:
    try:
        target = link.resolve(strict=True)
    except RuntimeError:  # Python before 3.13
        raise LaunchError(f"sync: {link} is a symlink loop") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LaunchError(f"sync: {link} is a symlink loop") from None
        raise LaunchError(f"sync: cannot read {link}: {exc.strerror or exc}") from None
    if target != root and root not in target.parents:
        raise LaunchError(f"sync: {link} points outside the synced tree ({target})")
    return target


def remote_tree_dir(tree: str) -> str:
    """Where the agent builds a tree on its node (``~`` expanded there)."""
    return f"{CACHE}/sync/{tree}"
