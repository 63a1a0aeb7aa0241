"""The sync manifest: what is shipped, how the tree is named, what is refused."""

from __future__ import annotations

import os

import pytest

from orchestrator.errors import LaunchError
from orchestrator.sync import build_manifest


def tree(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_gitignore_exclude_and_git_dir_are_left_out(tmp_path):
    root = tree(tmp_path, {
        "train.py": "x", "data/a.txt": "a", "data/b.log": "b", "build/out.o": "o",
        ".git/HEAD": "ref", "keep.log": "k", "sub/deep/c.log": "c", "notes.md": "n",
        ".gitignore": "*.log\n!keep.log\nbuild/\n/notes.md\n"})
    paths = [e.path for e in build_manifest(root, ("data/a.txt",)).entries]
    assert paths == [".gitignore", "keep.log", "train.py"]


def test_tree_name_follows_content_and_modes_only(tmp_path):
    root = tree(tmp_path, {"a.py": "1", "b/c.py": "2"})
    first = build_manifest(root).tree
    assert build_manifest(root).tree == first  # nothing changed
    (root / "a.py").write_text("1")
    os.utime(root / "a.py", (1, 1))
    assert build_manifest(root).tree == first  # times do not count
    (root / "a.py").chmod(0o755)
    assert build_manifest(root).tree != first  # the executable bit does
    (root / "a.py").chmod(0o644)
    (root / "b/c.py").write_text("3")
    assert build_manifest(root).tree != first


def test_symlinks_inside_are_shipped_as_files_and_outside_refused(tmp_path):
    root = tree(tmp_path / "proj", {"real.txt": "r"})
    (root / "link.txt").symlink_to(root / "real.txt")
    entries = {e.path: e for e in build_manifest(root).entries}
    assert entries["link.txt"].sha256 == entries["real.txt"].sha256
    outside = tmp_path / "secret"
    outside.write_text("s")
    (root / "escape").symlink_to(outside)
    with pytest.raises(LaunchError, match="points outside the synced tree"):
        build_manifest(root)


def test_an_unreadable_file_is_refused_naming_it(tmp_path):
    root = tree(tmp_path, {"ok.py": "1"})
    fifo_or_dir = root / "locked"
    fifo_or_dir.mkdir()
    (fifo_or_dir / "f").write_text("x")
    (fifo_or_dir / "f").chmod(0)
    if os.geteuid() == 0:  # root reads anything: use a path that cannot be read at all
        (fifo_or_dir / "f").unlink()
        (fifo_or_dir / "f").symlink_to(root / "missing")
        with pytest.raises(LaunchError, match="points outside|cannot read"):
            build_manifest(root)
    else:
        with pytest.raises(LaunchError, match="cannot read .*locked/f"):
            build_manifest(root)


def test_pruning_keeps_recent_trees_and_anything_used_within_the_hour(tmp_path, monkeypatch):
    import json
    import time

    import agents.cache as agent

    monkeypatch.setenv("HOME", str(tmp_path))
    base = tmp_path / ".cache" / "orchestrator" / "sync"
    blobs = tmp_path / ".cache" / "orchestrator" / "blobs" / "aa"
    blobs.mkdir(parents=True)
    now = time.time()
    trees = []
    for i in range(8):
        tree = base / f"{i:024x}"
        tree.mkdir(parents=True)
        sha = f"aa{i:062x}"
        (blobs / sha).write_text("x")
        (tree / ".orchestrator-manifest.json").write_text(json.dumps([["f", sha, False]]))
        age = 7200 if i < 6 else 60  # trees 6 and 7 were used a minute ago
        os.utime(tree, (now - age - i, now - age - i))
        os.utime(blobs / sha, (now - 7200, now - 7200))
        trees.append(tree)
    fresh = blobs / ("aa" + "f" * 62)  # uploaded a moment ago, no tree built from it yet
    fresh.write_text("y")
    agent.prune_trees(str(base), 2, str(trees[0]))
    left = sorted(p.name for p in base.iterdir() if not p.name.startswith("."))
    # kept: the 2 most recent (7, 6, both recent anyway) and the current one (0)
    assert left == sorted([trees[0].name, trees[6].name, trees[7].name])
    assert fresh.exists()  # too young to go
    assert sorted(p.name[-1] for p in blobs.iterdir() if p != fresh) == ["0", "6", "7"]


NESTED = {
    "train.py": "x", ".gitignore": "*.log\n!keep.log\n/out/\n",
    "keep.log": "k", "run.log": "r", "out/model.pt": "m", "src/out/gen.py": "g",
    "data/.gitignore": "big/\nraw-*\n!raw-keep.txt\n", "data/small.csv": "s",
    "data/big/shard0.bin": "b", "data/raw-a.txt": "a", "data/raw-keep.txt": "k",
    "data/nested/big/inside.txt": "i", "data/nested/deeper/raw-b.txt": "b",
    "pkg/.gitignore": "/generated.py\nsub/cache.txt\n", "pkg/generated.py": "g",
    "pkg/x/generated.py": "kept: the pattern is anchored to pkg/",
    "pkg/sub/cache.txt": "c", "pkg/sub/code.py": "c",
}
# What git itself ships from NESTED (checked against `git ls-files` below).
SHIPPED = [".gitignore", "data/.gitignore", "data/raw-keep.txt", "data/small.csv",
           "keep.log", "pkg/.gitignore", "pkg/sub/code.py", "pkg/x/generated.py",
           "src/out/gen.py", "train.py"]


def test_nested_gitignores_and_negations_as_git_reads_them(tmp_path):
    root = tree(tmp_path / "plain", NESTED)
    assert [e.path for e in build_manifest(root).entries] == SHIPPED


def test_a_git_work_tree_ships_what_git_tracks_or_would_track(tmp_path):
    import subprocess

    root = tree(tmp_path / "repo", NESTED)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (root / ".git" / "info" / "exclude").write_text("train.py\n")  # git's own exclude file
    subprocess.run([*git, "add", "-f", "run.log"], check=True)  # tracked though ignored
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    expected = sorted({*SHIPPED, "run.log"} - {"train.py"})
    assert [e.path for e in build_manifest(root).entries] == expected
    (root / "pkg" / "sub" / "code.py").unlink()  # tracked? no: deleted untracked files go
    assert "pkg/sub/code.py" not in [e.path for e in build_manifest(root).entries]


def test_a_large_ignored_directory_is_never_read_and_max_bytes_refuses_naming_the_largest(
        tmp_path):
    import time

    root = tree(tmp_path / "proj", {"train.py": "x", "data/.gitignore": "huge/\n"})
    (root / "data" / "huge").mkdir()
    with open(root / "data" / "huge" / "all.bin", "wb") as f:
        f.truncate(4 * 1024 ** 3)  # sparse: 4 GiB that cost nothing, unless read
    started = time.monotonic()
    assert [e.path for e in build_manifest(root, max_bytes=1024).entries] == [
        "data/.gitignore", "train.py"]
    (root / "data" / ".gitignore").unlink()
    (root / "ckpt").mkdir()
    (root / "ckpt" / "last.pt").write_bytes(b"w" * 5000)
    with pytest.raises(LaunchError) as refused:
        build_manifest(root, max_bytes=1024 ** 3)
    message = str(refused.value)
    assert "4.0 GiB to ship, more than sync.max_bytes (1.0 GiB)" in message, message
    assert "largest: data/huge/ 4.0 GiB, ckpt/ 4.9 KiB, train.py 1 B" in message, message
    assert time.monotonic() - started < 3  # refused before hashing a byte of it


def test_submit_refuses_a_tree_over_max_bytes_before_recording_anything(home, tmp_path):
    import orchestrator
    from tests.helpers import write_spec

    root = tree(tmp_path / "proj", {"train.py": "x", "data/blob.bin": "y" * 4096})
    spec = write_spec(tmp_path, {"nodes": [{"host": "local"}], "command": ["true"],
                                 "sync": {"path": str(root), "max_bytes": 1024}})
    with pytest.raises(LaunchError, match=r"more than sync.max_bytes .*largest: data/ 4.0 KiB"):
        orchestrator.submit(spec)
    assert orchestrator.list_jobs() == []


# --- edge cases: refused in one line naming the path, before anything starts -------------------

def git_init(root):
    import subprocess

    subprocess.run(["git", "-C", str(root), "init", "-q"], check=True)
    return root


@pytest.mark.parametrize("in_git", [False, True])
def test_a_symlink_loop_is_refused_naming_it(tmp_path, in_git):
    root = tree(tmp_path / "proj", {"train.py": "x"})
    (root / "a").symlink_to("b")
    (root / "b").symlink_to("a")
    if in_git:
        git_init(root)
    with pytest.raises(LaunchError) as refused:
        build_manifest(root)
    assert str(refused.value) == f"sync: {root / 'a'} is a symlink loop"


@pytest.mark.parametrize("in_git", [False, True])
def test_a_symlink_to_a_directory_is_refused_naming_it(tmp_path, in_git):
    root = tree(tmp_path / "proj", {"train.py": "x", "data/a.txt": "a"})
    (root / "alias").symlink_to("data")
    if in_git:
        git_init(root)
    with pytest.raises(LaunchError) as refused:
        build_manifest(root)
    assert str(refused.value) == (f"sync: {root / 'alias'} is a symlink to a directory; "
                                  "ship the directory itself or exclude it")
    # Left out (exclude, or a .gitignore rule that matches it as git does: as a file), it
    # is not refused, and what it points to is shipped once, as itself.
    assert [e.path for e in build_manifest(root, ("alias",)).entries] == \
        ["data/a.txt", "train.py"]
    (root / ".gitignore").write_text("alias/\n")  # git: a symlink is not a directory
    with pytest.raises(LaunchError, match="alias is a symlink to a directory"):
        build_manifest(root)
    (root / ".gitignore").write_text("alias\n")
    assert [e.path for e in build_manifest(root).entries] == \
        [".gitignore", "data/a.txt", "train.py"]


UNREADABLE = """
import sys
from orchestrator.errors import LaunchError
from orchestrator.sync import build_manifest
try:
    build_manifest(sys.argv[1])
except LaunchError as exc:
    print(exc)
    sys.exit(3)
"""


def refused_without_privileges(root) -> str:
    """build_manifest(root) run as a process that cannot read what its mode forbids (root
    reads anything: it runs without its DAC capabilities): its one-line refusal."""
    import subprocess

    from tests.helpers import PYTHON, ROOT

    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] \
        if os.geteuid() == 0 else []
    done = subprocess.run([*drop, PYTHON, "-c", UNREADABLE, str(root)], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert done.stdout.count("\n") == 1
    return done.stdout.strip()


@pytest.mark.parametrize("in_git", [False, True])
def test_an_unreadable_directory_or_gitignore_is_refused_naming_it(tmp_path, in_git):
    root = tree(tmp_path / "proj", {"train.py": "x", "locked/secret.py": "s",
                                    "sub/.gitignore": "*.log\n"})
    if in_git:
        git_init(root)
    (root / "locked").chmod(0)
    try:
        assert refused_without_privileges(root) == \
            f"sync: cannot read {root / 'locked'}: Permission denied"
    finally:
        (root / "locked").chmod(0o755)
    if not in_git:  # git reads .gitignore files its own way
        (root / "sub" / ".gitignore").chmod(0)
        assert refused_without_privileges(root) == \
            f"sync: cannot read {root / 'sub' / '.gitignore'}: Permission denied"


@pytest.fixture
def node_cache(tmp_path, monkeypatch):
    """A node's cache under a home of its own; this process plays its agent (its lease is
    given back at the end)."""
    from agents import leases

    monkeypatch.setenv("HOME", str(tmp_path / "node-home"))
    yield tmp_path / "node-home" / ".cache" / "orchestrator"
    leases.release()


def _put_blob(content: bytes) -> str:
    import base64
    import hashlib

    import agents.cache as node

    sha = hashlib.sha256(content).hexdigest()
    assert node.put_chunk(sha, 0, base64.b64encode(content).decode(), True, 1) is None
    return sha


def test_a_users_file_named_like_our_manifest_is_shipped_as_it_is(node_cache):
    import agents.cache as node

    mine = _put_blob(b"the user's own json\n")
    code = _put_blob(b"print(1)\n")
    files = [[".orchestrator-manifest.json", mine, False], ["train.py", code, False]]
    built = node.build_tree("ab" * 12, files, 5)
    assert open(os.path.join(built, ".orchestrator-manifest.json"), "rb").read() == \
        b"the user's own json\n"
    assert sorted(os.listdir(built)) == [".orchestrator-manifest.json", "train.py"]


def test_a_failed_build_leaves_nothing_half_built(node_cache):
    import agents.cache as node

    cache = node_cache
    code = _put_blob(b"print(1)\n")
    files = [["train.py", code, False], ["lost.py", "cd" * 32, False]]  # a blob not there
    with pytest.raises(FileNotFoundError):
        node.build_tree("ef" * 12, files, 5)
    assert sorted(os.listdir(cache / "sync")) == [".prune.lock"]
    assert sorted(os.listdir(cache / "leases")) != []  # its agent still holds it


LEASE_HOLDER = """
import sys, time
from agents import leases
leases.held().hold(trees=(sys.argv[1],), blobs=(sys.argv[2],))
print("held", flush=True)
time.sleep(120)
"""


def test_what_a_live_agent_leases_is_never_pruned_however_old(node_cache):
    """A tree and a blob unused for two hours (a long setup, a slow upload) stay while the
    agent that leases them lives, and go once it is gone, however it died."""
    import subprocess
    import time

    import agents.cache as node
    from agents import leases
    from tests.helpers import PYTHON, ROOT

    cache = node_cache
    old_code, other = _put_blob(b"old\n"), _put_blob(b"other\n")
    uploading = _put_blob(b"half of a slow upload\n")
    old_tree = node.build_tree("01" * 12, [["a.py", old_code, False]], 5)
    node.build_tree("02" * 12, [["b.py", other, False]], 5)
    assert len(os.listdir(cache / "leases")) == 1
    leases.release()  # the agent that built them is gone: only the holder below uses 01
    long_ago = time.time() - 7200
    for path in [old_tree, *(cache / "blobs").rglob("*")]:
        os.utime(path, (long_ago, long_ago))
    holder = subprocess.Popen([PYTHON, "-c", LEASE_HOLDER, "01" * 12, uploading],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline() == "held\n"
        node.prune_trees(str(cache / "sync"), 0, str(cache / "sync" / ("02" * 12)))
        assert (cache / "sync" / ("01" * 12)).is_dir()
        assert (cache / "blobs" / uploading[:2] / uploading).exists()
        assert (cache / "blobs" / old_code[:2] / old_code).exists()  # its tree's
    finally:
        holder.kill()  # no goodbye: the kernel drops its lock
        holder.wait()
    node.prune_trees(str(cache / "sync"), 0, str(cache / "sync" / ("02" * 12)))
    assert not (cache / "sync" / ("01" * 12)).exists()
    assert not (cache / "sync" / f"{'01' * 12}.manifest.json").exists()
    assert not (cache / "blobs" / uploading[:2] / uploading).exists()
    assert not (cache / "blobs" / old_code[:2] / old_code).exists()
    assert (cache / "blobs" / other[:2] / other).exists()  # the current tree's
    assert os.listdir(cache / "leases") == []  # the dead lease went with it
