#!/usr/bin/env python3
"""What replicating one save costs on this machine: the floor under "at most one step
redone" after a cut node.

    python benchmarks/bench_push.py [--senders 2] [--ranks 2] [--mib 512] [--reps 5]

A cut node's ranks resume the newest step whose copies reached another node before the cut,
so a save's copies must be elsewhere within a step for at most one step to be redone. Here
``--senders`` processes (the nodes of a job) each send their ``--ranks`` ranks' copies of one
save (``--mib`` each, one rank after the other, as an agent does) to one replica server (a
hot spare's) at once, over loopback:

- wire: the agents' own replica protocol (agents/replicas.py: the job's secret proven, every
  chunk checked against the manifest, written into the server's checkpoint memory, into the
  pages of the copy it let go, as in a long job);
- floor: the same bytes and the same processes, a file sent with ``sendfile`` and received
  with ``recv_into`` a mapping of existing pages: moving the bytes and nothing else.

Each rep is a new save (other bytes: the server keeps nothing it already holds). The first
saves write new pages (1.3 s per 512 MiB on this VM): the floor's first and the wire's first
four (until its server's memory, two copies a rank, is full and each copy takes a let-go
one's pages) are reported apart; medians of the rest. Writes push.md and
push.json to --out.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from agents import replicas  # noqa: E402
from agents.holds import mapped  # noqa: E402
from agents.shims import orchestrator_checkpoint_format as F  # noqa: E402

SECRET = "bench-push"


def _write_copy(path: str, size: int, rep: int) -> tuple[bytes, bytes]:
    """A rank's save of ``size`` bytes (other bytes each rep); its meta and manifest."""
    with open(path, "r+b" if os.path.exists(path) else "w+b") as f:
        f.truncate(size)
        with mmap.mmap(f.fileno(), size) as view:
            if rep == 0:
                view[:] = os.urandom(1 << 20) * (size >> 20)
            view[:8] = rep.to_bytes(8, "little")
            meta = json.dumps({"rep": rep}).encode()
            crcs = F.checksums(memoryview(view), size)
    return meta, json.dumps(F.manifest(meta, crcs, size)).encode()


def _sender(mode: str, port: int, paths: list[str], rep: int, start: Any, done: Any) -> None:
    copies = []
    for rank, path in enumerate(paths):
        size = os.path.getsize(path)
        meta, manifest = _write_copy(path, size, rep) if mode == "wire" else (b"", b"")
        copies.append((rank, path, size, meta, manifest))
    start.wait()
    for rank, path, size, meta, manifest in copies:
        if mode == "wire":
            fd = os.open(path, os.O_RDONLY)
            try:  # as the agent sends it (agents/checkpoints.py)
                with mapped(fd, size) as view:
                    replicas.push("127.0.0.1", port, SECRET, rank, rep, meta, manifest, view)
            finally:
                os.close(fd)
        else:
            with socket.create_connection(("127.0.0.1", port)) as conn, open(path, "rb") as f:
                conn.sendfile(f)
                conn.shutdown(socket.SHUT_WR)
                conn.recv(1)
    done.put(time.monotonic())


def _floor_server(port_q: Any, root: str, size: int, streams: int) -> None:
    """Takes ``streams`` copies at a time, each into a mapping of a file of its own whose
    pages exist (as the wire's blanks do)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port_q.put(listener.getsockname()[1])
    files = []
    for i in range(streams):
        path = os.path.join(root, f"floor-{i}")
        with open(path, "w+b") as f:
            f.truncate(size)
            with mmap.mmap(f.fileno(), size) as view:
                view[:] = bytes(size)
        files.append(path)
    def take(conn: socket.socket, path: str) -> None:
        with conn, open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as view:
            got, mv = 0, memoryview(view)
            while got < size:
                n = conn.recv_into(mv[got:], min(size - got, 1 << 20))
                if not n:
                    break
                got += n
            del mv
            conn.sendall(b"k")

    n = 0
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=take, args=(conn, files[n % streams]), daemon=True).start()
        n += 1


def _wire_server(port_q: Any, root: str, size: int, streams: int) -> None:
    """A spare's replica server whose memory holds two copies of each rank: from the third
    save on, each copy goes into the pages of one it let go (a long job's steady state)."""
    limit = 2 * streams * size
    server = replicas.Server(root, SECRET, room=lambda: limit - server.holdings()[1],
                             problem=print)
    port_q.put(server.port)
    while True:
        time.sleep(3600)


def _run(mode: str, args: argparse.Namespace, tmp: str) -> list[float]:
    size = int(args.mib * (1 << 20))
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    server_root = tempfile.mkdtemp(prefix=f"{mode}-server-", dir=tmp)
    streams = args.senders * args.ranks
    server = ctx.Process(target=_floor_server if mode == "floor" else _wire_server,
                         args=(port_q, server_root, size, streams), daemon=True)
    server.start()
    port = port_q.get(timeout=120)
    paths = [[os.path.join(tmp, f"copy-{s}-{r}") for r in range(args.ranks)]
             for s in range(args.senders)]
    for rep_paths in paths:
        for path in rep_paths:
            if not os.path.exists(path):
                _write_copy(path, size, 0)
    took = []
    try:
        for rep in range(1, args.reps + 1):
            start, done = ctx.Event(), ctx.Queue()
            senders = [ctx.Process(target=_sender, args=(mode, port, p, rep, start, done))
                       for p in paths]
            for p in senders:
                p.start()
            time.sleep(1.0 + size * args.ranks / 2e9)  # each sender's copies written first
            began = time.monotonic()
            start.set()
            ends = [done.get(timeout=600) for _ in senders]
            took.append(round(max(ends) - began, 3))
            for p in senders:
                p.join()
    finally:
        server.kill()
        server.join()
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--senders", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--mib", type=float, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks"))
    args = p.parse_args()
    result: dict[str, Any] = {"args": vars(args)}
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="bench-push-") as tmp:
        for mode in ("floor", "wire", "floor", "wire"):  # interleaved: the machine drifts
            result.setdefault(mode, []).extend(_run(mode, args, tmp))
    gib = args.senders * args.ranks * args.mib / 1024
    fresh = {"floor": 1, "wire": 4}  # saves of each run before its steady state
    rows = {m: (result[m][0], statistics.median(
        [t for i, t in enumerate(result[m]) if i % args.reps >= fresh[m]]))
            for m in ("floor", "wire")}
    result["median_s"] = {m: r[1] for m, r in rows.items()}
    text = (f"One save's copies to a hot spare: {args.senders} nodes x {args.ranks} ranks x "
            f"{args.mib:g} MiB ({gib:g} GiB) at once over loopback, {args.reps} saves, twice "
            f"each, interleaved (`python benchmarks/bench_push.py`).\n\n"
            "| | first save (new pages) | steady state, median | GiB/s |\n"
            "| --- | --- | --- | --- |\n"
            + "".join(f"| {m} | {r[0]:.2f} s | {r[1]:.2f} s | {gib / r[1]:.2f} |\n"
                      for m, r in rows.items())
            + f"\nwire / floor: {rows['wire'][1] / rows['floor'][1]:.2f}x; all (s): "
            f"floor {result['floor']}, wire {result['wire']}\n")
    print(text)
    Path(args.out, "push.md").write_text(text)
    Path(args.out, "push.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
