"""The node's checkpoint store: the memory its workers save into, which this agent owns
(it outlives them), sealed, persisted, replicated and reported in the background.

A worker's ``save()`` (agents/shims/orchestrator_checkpoint.py; the format in
orchestrator_checkpoint_format.py) copies its state into a slot under ``memory_root()`` and
writes the save's meta last, then pokes the store (a datagram on ``<memory root>/wake``). On a
thread of its own, woken so, the store then, for every save it finds:

- **seals** it: a manifest of CRC-32s over the slot's bytes, taken under a shared lock of the
  slot (a save takes an exclusive one, so it never writes what is being read);
- **persists** each one its worker marked (every ``persist_every``-th save) to
  ``checkpoint.dir``, checking the bytes it wrote against the manifest, synced, the manifest
  last; and keeps the ``keep`` newest persisted steps of each of its ranks;
- **replicates** each rank's newest sealed save whose step is a multiple of the target's
  stride (agents/stride.py: so that two nodes' copies on one spare meet on common steps) to
  the buddy and spare the controller named (``replicate_to``; agents/replicas.py), and keeps
  its buddy's replicas in turn;
- **keeps pages**: a replica it lets go leaves its data as a *blank* that the next copy the
  node writes whole takes by a rename (orchestrator_checkpoint_format.py: new pages are most
  of a copy's cost), and a rank whose next save would need new pages is given one made
  ahead (agents/pages.py); blanks count as memory in use, and go while that is over
  ``checkpoint.memory``;
- **shares** ``checkpoint.memory`` between its ranks' own copies and its buddy's replicas:
  the copies each rank may keep (``share``; a file in the memory root its saves obey);
- **reports** what the node holds (``held``: the steps of each rank in memory, persisted and
  as replicas, the replica server's port, the bytes of memory in use) whenever that changes,
  on every new controller connection, and before ``stopped``, so that the controller's
  choice of the step every rank resumes is made on what is there.

A node that takes a lost or drained node's place ``install``s the copies the controller told
it to pull (agents/pulls.py). The memory goes with the agent: ``close()`` removes it, and the
watchdog does when the agent dies (agents/processes.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from agents import borrows, disk, rankfiles
from agents import commands as C
from agents import protocol as P
from agents.holds import hold_save, mapped
from agents.memshare import budget, copies_for
from agents.outbox import Outbox
from agents.pages import Maker
from agents.paths import entries, memory_root, own_memory, remove, steps_in, sweep_memory
from agents.pulls import install
from agents.replicas import Server
from agents.replicas import push as push_replica
from agents.shims import orchestrator_checkpoint_format as F
from agents.storewake import Wake
from agents.stride import Strides
from agents.transfers import ReplicaError, Transfers

MAX_REPORTED = 64  # steps per rank in one report (the newest)
MAX_PROBLEMS = 256  # problems said in the agent's log over its life
LOAD_FIRST = 10.0  # seconds a resuming attempt's copies wait for its ranks' loads at most


class Store:
    def __init__(self, job_id: str, node_index: int, outbox: Outbox, secret: str):
        self.root = memory_root(job_id, node_index)
        self.outbox = outbox
        self.secret = secret
        self.replicas: Server | None = None  # its buddy's copies (agents/replicas.py)
        # Where this node's copies go: a hot spare's replica server, then its buddy's.
        self.targets: list[tuple[str, int]] = []
        self._pushed: dict[tuple[tuple[str, int], int], int] = {}  # (target, rank) -> step
        self._strides = Strides()  # which steps go to each target (agents/stride.py)
        self._sending = Transfers()  # ended by close: no cut-off buddy holds the agent's end
        self._timeline = 0  # one more at each attempt that resumes: a push under way is of the last
        self._saves: dict[int, list[int | float]] = {}  # rank -> [step, bytes, block_s]
        self._copies: int | None = None  # each rank's share of the memory, as last told
        self.config = C.CheckpointConfig()
        self.persist_dir: str | None = None
        self.persist_step: int | None = None  # a planned stop's step: persisted when sealed
        self._late_persists: set[tuple[int, int]] = set()  # (rank, step): persist_sealed's
        self.deferred = False  # a planned move in which this node stays: replicas wait
        self._loading: tuple[float, int] | None = None  # (until, ranks) a restart loads
        self._owner: int | None = None  # the flock that says this memory is a live agent's
        self.store_id: str | None = None
        self.attempt = 0
        self._lock = threading.Lock()
        self._wake = Wake()
        self._pages = Maker(self.root, lambda: budget(self.config) - self.holdings()["bytes"])
        self._closed = False
        self._last: dict[str, Any] | None = None
        self._sent_to: object = None
        self._thread: threading.Thread | None = None
        self.problems: list[str] = []  # said once each in the agent's log (error messages)

    # --- the attempt's side ------------------------------------------------------------------
    def start(self) -> None:
        """Serve replicas and report, from the agent's start: a controller learns this
        node's replica port before it plans the first attempt's buddies."""
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        try:
            self._owner = own_memory(self.root)
            for path in sweep_memory(self.root):
                self._problem(f"checkpoint: removed {path}, the memory of a dead agent")
        except OSError as exc:
            self._problem(f"checkpoint: cannot mark or sweep the node's memory: {exc}")
        self._wake.listen(os.path.join(self.root, F.WAKE_NAME))
        try:
            self.replicas = Server(self.root, self.secret, self._room, self._problem,
                                   self._wake.set)
        except OSError as exc:  # no TCP here: the node keeps its own copies only
            self._problem(f"checkpoint replicas: cannot listen: {exc}")
        self._thread = threading.Thread(target=self._run, daemon=True, name="checkpoints")
        self._thread.start()

    def replicate_to(self, buddy: C.ReplicateTo) -> None:
        with self._lock:
            # The spare first: it is where a lost node's ranks resume, and what it holds
            # newest decides whether their copies are there already or must be pulled.
            first = [(buddy.address, buddy.port)] if buddy.port else []
            self.targets = [t for t in buddy.also if t not in first] + first
            self._pushed = {k: v for k, v in self._pushed.items() if k[0] in self.targets}
            self._strides.targets(self.targets)
        self._wake.set()

    def retain(self, keep: C.Retain) -> None:
        """Copies from ``keep.step`` on stay while memory allows, and those config.copies names."""
        F.write_file(os.path.join(self.root, "retain"), str(keep.step).encode())
        if self.replicas is not None:
            self.replicas.retain_from(keep.step, _loads_read(self.config))

    def save_at(self, at: C.SaveAt) -> None:
        """Every rank of this node saves ``at.step`` and holds there (the shim reads the file
        at each save: ``save(step, state, every=N)`` saves that step too); None: over."""
        path = os.path.join(self.root, F.SAVE_AT_NAME)
        self.persist_step = at.step if at.persist else None
        # A node that stays sends nothing while the move lasts: the leaving node's copies,
        # which the move waits for, then have the network and the cores to themselves.
        self.deferred = at.step is not None and not at.replicate
        if not self.deferred or at.persist:  # a step saved before it was asked persisted
            self._wake.set()
        if at.step is None:
            remove(path)
        else:  # the hold's end by this node's clock, which the workers share
            F.write_file(path, F.save_at_text(at.step, time.time() + at.hold))

    def release(self) -> None:
        """Nothing here is of use any more (C.Release): copies, replicas, pages go."""
        # Under the reporter's lock: one between said it held a replica whose bytes had gone.
        with self._lock:
            self.targets, self._pushed = [], {}
            self._saves.clear()
            for _, rank_dir in _rank_dirs(self.root):
                shutil.rmtree(rank_dir, ignore_errors=True)  # a copy being sent is held open
            if self.replicas is not None:
                self.replicas.discard(lambda step, _: step is not None)
            self._pages.stop(made=True)
            remove(os.path.join(self.root, F.SAVE_AT_NAME))
            borrows.end(self.root)
        self._wake.set()  # the report: nothing held

    def install(self, pulls: tuple[C.Pull, ...]) -> None:
        """Copies of ranks that now run here, into this node's memory (agents/pulls.py)."""
        install(self.root, self.secret, self.replicas, pulls, self._problem, self._wake.set)

    def configure(self, config: C.CheckpointConfig, workdir: str, attempt: int,
                  local_ranks: int) -> dict[str, str | None]:
        """Take the attempt's settings; the variables its workers need (None: unset, as a
        node's own environment could have them)."""
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        with self._lock:
            new = attempt != self.attempt
            self.config, self.attempt = config, attempt
            self.persist_dir = None
            if config.dir:
                path = os.path.join(workdir, os.path.expanduser(config.dir))
                self.persist_dir = os.path.abspath(path)
                self.store_id = disk.store_id(self.persist_dir)
            if new:
                self.deferred = False  # a move that ended the attempt before is over
                # A resuming attempt's ranks load first (see _loading), then replicas go.
                self._loading = (time.monotonic() + LOAD_FIRST, local_ranks) \
                    if config.restore_step is not None else None
                self._discard_after(config.restore_step)
                self.persist_step, self._late_persists = None, set()  # a stop before's
                remove(os.path.join(self.root, F.SAVE_AT_NAME))  # an attempt before's
                borrows.begin(self.root, self.secret, config.copies, attempt, local_ranks,
                              self._room, self._problem)  # before a worker can load()
        node = budget(config)
        return {F.MEMORY_VAR: self.root,
                F.BUDGET_VAR: str(node // max(1, local_ranks)),
                F.PERSIST_VAR: str(config.persist_every if self.persist_dir else 0),
                F.DIR_VAR: self.persist_dir,
                F.STEP_VAR: None if config.restore_step is None else str(config.restore_step)}

    def resumed(self, resumed: C.Resumed) -> None:
        """An attempt's ranks resume an older step than the copies here go on to
        (C.Resumed): those saved before it, of a timeline none follows, go (the buddy kept
        the old copy of the step the ranks were told, the new one never went, and a node's
        loss resumed ranks from two timelines); this attempt's own saves stay."""
        with self._lock:
            told = self.config.restore_step
            if resumed.attempt == self.attempt:  # it runs ranks of that attempt
                if told is None or resumed.step >= told:
                    return
                self.config = replace(self.config, restore_step=resumed.step)
            elif resumed.attempt < self.attempt:
                return  # of an attempt before this node's
            self._discard_after(resumed.step, before=resumed.attempt)
        self._wake.set()

    def _discard_after(self, step: int | None, before: int | None = None) -> None:
        """A new attempt resumes ``step`` (None: from scratch): copies of later steps are of a
        timeline no rank follows any more, never to be mixed with the new one's (with
        ``before``, only those saved before that attempt, and a spare takes no put of an
        attempt before it). Persisted copies go only when a step is resumed (a first
        attempt may resume from them)."""
        self._pushed.clear()
        self._timeline += 1
        self._sending.end()  # a copy of the timeline left behind goes no further
        self._sending = Transfers()
        if self.replicas is not None:
            self.replicas.attempt = max(self.replicas.attempt, self.attempt, before or 0)
        remove(os.path.join(self.root, "retain"))

        def later(s: int | None, meta: str) -> bool:
            return s is not None and (step is None or s > step) and \
                (before is None or _attempt_of(meta) < before)
        _discard_own(_rank_dirs(self.root), self.persist_dir if step is not None else None,
                     later)
        if self.replicas is not None:  # (what the loads read stays: Server._reserve)
            self.replicas.retain, self.replicas.keep = None, _loads_read(self.config)
            self.replicas.discard(later)

    def report_now(self) -> None:
        """What the node holds, said now (before ``stopped``: the controller plans on it)."""
        self._report(force=True)

    def close(self) -> None:
        """The workers are gone: a copy going to a buddy stops (of no use now), what they
        saved and marked is persisted (a last pass), then the memory goes."""
        self._closed = True
        self._sending.end()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60.0)
            try:
                self._pass(final=True)
            except Exception as exc:
                self._problem(f"checkpoint store: {exc!r}")
        self._pages.stop()  # after the store's passes (one could start a blank), before rmtree
        if self.replicas is not None:
            self.replicas.close()
            self.replicas = None
        self._wake.close()
        borrows.end(self.root)
        shutil.rmtree(self.root, ignore_errors=True)
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None
        self._report(force=True)  # nothing held any more: what status shows from now on

    # --- the background ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed:
            try:
                self._pass()
            except Exception as exc:  # never the agent's end: said, and tried again
                self._problem(f"checkpoint store: {exc!r}")
            self._wake.wait()

    def _pass(self, final: bool = False) -> None:
        ranks = _rank_dirs(self.root)
        tried: dict[str, set[int]] = {}
        for rank, rank_dir in ranks:
            unsealed = _unsealed(rank_dir)
            tried[rank_dir] = set(unsealed)
            for step, meta_bytes in sorted(unsealed.items()):
                self._seal(rank, rank_dir, step, meta_bytes)
                self._strides.saved(rank, step, self._timeline)  # sent or skipped, it came
            if self.persist_step is not None and self.persist_dir:
                disk.persist_sealed(self.persist_dir, self.config.keep, rank, rank_dir,
                                    self.persist_step, self._late_persists)
        if final:  # the job ends: its buddy's copy is of no use any more
            return
        self._share(ranks)
        self._pages.tend([r for r, _ in ranks])  # over the bound they go; asked, made
        # What memory holds is news at once: a planned move waits for every rank's save
        # there, and replicating a big state takes seconds (measured: 5 s of a drain's 11 s
        # at 512 MiB per rank went to waiting for this report).
        self._report()
        if self.deferred:
            return
        # Saves this pass tried and could not seal (their slot reused meanwhile) are no news
        # later; one that came after its rank was looked at is (measured: a leaving node's
        # second rank waited 3.5 s, through two pushes of the first, for its seal).
        self._replicate(ranks, tried)
        self._report()

    def _replicate(self, ranks: list[tuple[int, str]],
                   left: dict[str, set[int]]) -> None:
        """Each rank's newest sealed save whose step is a multiple of the node's stride
        (agents/stride.py: so that the nodes' copies meet on common steps), to each target
        that lacks it, one target at a time: every rank's copy on some other node is what a
        move waits for. Never a queue of older ones (sent oldest first, copies elsewhere fell
        ever further behind: measured, 512 MiB saved every second, a cut node's job started
        again from scratch). Only the step a planned move asked for while it lasts, none
        older than the step the attempt resumed (measured: a leaving node pushing an older
        step slowed every rank's save of the asked one fourfold; the next attempt's nodes
        pushing steps it will never resume held its first save for 7 s). A new save is
        sealed first."""
        if self._loading is not None:
            if _still_loading(self._loading, self.attempt, ranks):
                return
            self._loading = None
        asked = F.asked(self.root)[0]
        floor = self.config.restore_step
        for target in list(self.targets):
            # Every rank's newest to this target before a new save is sealed: the ranks
            # save the same steps, so a lost node's ranks then have a step in common (a
            # new save looked at after each push, the first rank's copies starved the
            # second's: measured, rank 1 had none anywhere after 30 s).
            if any(set(_unsealed(d)) - left.get(d, set()) for _, d in ranks):
                return  # a new save: sealed first, by the next pass
            sealed = {rank: [s for s in steps_in(rank_dir, ".manifest")
                             if (asked is None or s == asked) and (floor is None or s >= floor)]
                      for rank, rank_dir in ranks}
            pushed = {rank: self._pushed[(target, rank)] for rank in sealed
                      if (target, rank) in self._pushed}
            picked = self._strides.pick(target, sealed, pushed, aligned=asked is None)
            # Every rank's copy held (a shared lock: no save writes over it) before the first
            # is sent: while one rank's went, the next rank's newest sealed copy was written
            # over, its push found it gone, and that rank's copies went nowhere (measured:
            # 512 MiB per rank saved every 0.5 s, the second rank of each node had no copy
            # on any other node, and a cut node's job started again from scratch).
            held = []
            try:
                for rank, rank_dir in ranks:
                    step = picked[rank]
                    if step > pushed.get(rank, -1):
                        copy = hold_save(rank_dir, step)
                        if copy is not None:
                            held.append((rank, step, copy))
                for rank, step, copy in held:
                    if self.deferred or self._closed or target not in self.targets:
                        return  # a move in which this node stays, a target no more
                    if not self._push(rank, step, copy, target):
                        self._strides.refused(target)
                        break  # this target is behind: the next pass tries again
                    self._strides.went(target, step)
            finally:
                for _, _, (_, _, fd, _) in held:
                    os.close(fd)
            if asked is None:  # whether its sends kept up, as they end (agents/stride.py)
                self._strides.ended(target, _newest_saved(ranks))

    def _push(self, rank: int, step: int, copy: tuple[bytes, bytes, int, int],
              buddy: tuple[str, int]) -> bool:
        """``copy`` (as ``hold_save`` gives it) to ``buddy``; False if it did not go."""
        meta, manifest, fd, size = copy
        with self._lock:
            timeline, attempt, sending = self._timeline, self.attempt, self._sending
        try:
            with mapped(fd, size) as view:
                push_replica(buddy[0], buddy[1], self.secret, rank, step, meta, manifest, view,
                             sending, attempt)
            with self._lock:  # not if a new attempt began meanwhile: its own step goes too
                if timeline == self._timeline:
                    self._pushed[(buddy, rank)] = step
            return True
        except (OSError, ReplicaError) as exc:
            if not self._closed and timeline == self._timeline:  # ended by close (Transfers)
                self._problem(f"checkpoint: replicating to {buddy[0]}:{buddy[1]} failed: {exc}")
            return False

    def _share(self, ranks: list[tuple[int, str]]) -> None:
        """Tell the node's ranks how many copies each may keep (agents/memshare.py)."""
        copies = copies_for(self.root, self._saves, dict(ranks), budget(self.config))
        if copies is not None and copies != self._copies:
            F.write_file(os.path.join(self.root, F.COPIES_NAME), str(copies).encode())
            self._copies = copies

    def _room(self) -> int:
        """Bytes of checkpoint.memory not in use, blanks too (a buddy's replica takes one)."""
        return budget(self.config) - self.holdings()["bytes"] + F.blank_bytes(self.root)

    def _seal(self, rank: int, rank_dir: str, step: int, meta_bytes: bytes) -> None:
        """A manifest of the save, and its persisted copy where asked; neither made once a new
        attempt discarded the step meanwhile (a seal of a big state takes seconds: a copy of
        the timeline no rank follows, trusted by a later load, gave a rank other weights)."""
        base = os.path.join(rank_dir, F.step_name(step))
        timeline = self._timeline
        try:
            meta = json.loads(meta_bytes)
            slot, size = meta["slot"], meta["size"]
            fd = os.open(os.path.join(rank_dir, f"slot-{int(slot)}"), os.O_RDONLY | os.O_CLOEXEC)
        except (ValueError, KeyError, TypeError, OSError):
            return  # gone meanwhile (its slot reused), or not ours to judge: the worker's load does
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if F.read_bytes(base + ".meta") != meta_bytes:
                return  # the slot was written again before we had it
            block = meta.get("block_s")
            if type(size) is int and 0 <= size < F.MAX_STEP and type(block) in (int, float) \
                    and 0 <= block < 1e9 and step >= self._saves.get(rank, [-1])[0]:
                self._saves[rank] = [step, size, float(block)]  # the newest save, as shown
            with mapped(fd, size) as view:
                manifest = F.manifest(meta_bytes, F.checksums(view, size), size)
                with self._lock:  # a new attempt's discard (under the lock) came first
                    if timeline != self._timeline:
                        return  # sealed again by the next pass, where the step stays
                    F.write_file(base + ".manifest", json.dumps(manifest).encode())
                where = self.persist_dir
                if (meta.get("persist") or step == self.persist_step) and where:
                    disk.persist(where, rank, step, meta_bytes, manifest, view)
                    with self._lock:
                        restore = self.config.restore_step
                        if timeline != self._timeline and restore is not None and \
                                step > restore and F.read_bytes(base + ".meta") != meta_bytes:
                            disk.remove_copy(where, rank, step)  # discarded meanwhile
                            return  # (a Resumed keeps this attempt's own saves: so here)
                        open(base + ".persisted", "w").close()
                    F.trim(where, rank, self.config.keep)
        finally:
            os.close(fd)

    # --- what the node holds -----------------------------------------------------------------
    def holdings(self) -> dict[str, Any]:
        persisted: dict[str, list[int]] = {}
        ranks = _rank_dirs(self.root)
        memory, restored, used = _own_held(ranks)
        if self.persist_dir:
            for rank, steps in disk.steps(self.persist_dir).items():
                persisted[str(rank)] = sorted(steps)[-MAX_REPORTED:]
        used += F.blank_bytes(self.root)  # kept for the next copies
        replicas: dict[str, list[int]] = {}
        if self.replicas is not None:
            kept, replica_bytes = self.replicas.holdings()
            used += replica_bytes
            replicas = {str(r): sorted(s)[-MAX_REPORTED:] for r, s in kept.items()}
        return {"type": P.HELD, "attempt": self.attempt, "memory": memory,
                "persisted": persisted, "replicas": replicas, "bytes": used,
                "store": self.store_id,
                "port": self.replicas.port if self.replicas is not None else None,
                "saves": {str(r): v for r, v in list(self._saves.items()) if r in dict(ranks)},
                "restored": restored}

    def _report(self, force: bool = False) -> None:
        conn = self.outbox.current()
        if conn is None:
            return
        with self._lock:
            held = self.holdings()
            if held != self._last or conn is not self._sent_to or force:
                self._last, self._sent_to = held, conn
                self.outbox.put(held)

    def _problem(self, text: str) -> None:
        # Bounded: a job a week old with a flaky buddy says each new problem once, up to
        # MAX_PROBLEMS of them, not one message per save.
        if text not in self.problems and len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)
            self.outbox.put({"type": P.ERROR, "attempt": self.attempt, "message": text[:4000]})


def _discard_own(ranks: list[tuple[int, str]], persisted: str | None,
                 later: Callable[[int | None, str], bool]) -> None:
    """The node's own ``ranks``' copies that ``later`` names (by step and the path of
    their meta), in memory (a seal's manifest without its meta too) and persisted in
    ``persisted`` (None: none go)."""
    for rank, rank_dir in ranks:
        for name in entries(rank_dir):
            base, _, suffix = name.rpartition(".")
            if suffix in ("meta", "manifest", "persisted", "corrupt") and \
                    later(F.parse_step(base), os.path.join(rank_dir, base + ".meta")):
                remove(os.path.join(rank_dir, name))
        if persisted is None:
            continue
        for old in F.persisted_steps(persisted, rank):
            if later(old, os.path.join(F.persisted_dir(persisted, old), f"rank-{rank}.meta")):
                disk.remove_copy(persisted, rank, old)


def _loads_read(config: C.CheckpointConfig) -> frozenset[tuple[int, int]]:
    """The (rank, step) of the copies an attempt's loads into fewer ranks read
    (agents/borrows.py): replicas that stay whatever else comes (agents/replicas.py)."""
    return frozenset((c.rank, step) for c in config.copies for step in c.steps)


def _attempt_of(meta: str) -> int:
    """The attempt whose rank made the save ``meta`` describes (0: unknown, or saved
    before saves said: an attempt before any)."""
    described = F.read_json(meta)
    attempt = described.get("attempt") if isinstance(described, dict) else None
    return attempt if type(attempt) is int else 0


def _own_held(ranks: list[tuple[int, str]]
              ) -> tuple[dict[str, list[int]], dict[str, list[Any]], int]:
    """Of the node's own ``ranks`` (rank, directory): the steps each holds in memory (the
    newest MAX_REPORTED, none marked corrupt), each one's last load, and their slots' bytes."""
    memory: dict[str, list[int]] = {}
    restored: dict[str, list[Any]] = {}
    used = 0
    for rank, rank_dir in ranks:
        steps = []
        names = entries(rank_dir)
        for name in names:
            step = F.parse_step(name, suffix=".meta")
            if step is not None:
                if F.step_name(step) + ".corrupt" not in names:
                    steps.append(step)
            elif name.startswith("slot-"):
                try:
                    used += os.stat(os.path.join(rank_dir, name)).st_size
                except OSError:
                    pass
        if steps:
            memory[str(rank)] = sorted(steps)[-MAX_REPORTED:]
        if "restored.json" in names:
            found = _restored(os.path.join(rank_dir, "restored.json"))
            if found is not None:
                restored[str(rank)] = found
    return memory, restored, used


def _rank_dirs(root: str) -> list[tuple[int, str]]:
    """``(rank, directory)`` of each rank that saved in this node's memory."""
    out = []
    for name in entries(root):
        rank = F.parse_step(name, prefix="rank-")
        if rank is not None:
            out.append((rank, os.path.join(root, name)))
    return sorted(out)


def _restored(path: str) -> list[Any] | None:
    """A rank's ``restored.json`` (its load: attempt, step, which copy, seconds, copies
    skipped), or None when it is not that: the file is the worker's, so anything may be."""
    record = rankfiles.small_json(path, 4096)
    if not isinstance(record, dict):
        return None
    values: list[Any] = [record.get(k)
                         for k in ("attempt", "step", "source", "seconds", "skipped")]
    counts, source, seconds = [values[0], values[1], values[4]], values[2], values[3]
    if not all(type(v) is int and 0 <= v < F.MAX_STEP for v in counts):
        return None
    if source not in P.RESTORE_SOURCES or type(seconds) not in (int, float):
        return None
    return values if 0 <= seconds < 1e9 else None


def _still_loading(loading: tuple[float, int], attempt: int,
                   ranks: list[tuple[int, str]]) -> bool:
    """Whether a resuming attempt's ranks are loading yet (``loading``: until when at most,
    how many): sending copies takes the cores the restart waits for (measured: a move's
    nodes sent 1 GiB)."""
    until, expected = loading
    loaded = sum(1 for _, d in ranks
                 if (_restored(os.path.join(d, "restored.json")) or [None])[0] == attempt)
    return loaded < expected and time.monotonic() < until


def _newest_saved(ranks: list[tuple[int, str]]) -> int:
    """The newest step any of the node's ranks has saved (-1: none)."""
    return max((s for _, d in ranks for s in steps_in(d, ".meta")), default=-1)


def _unsealed(rank_dir: str) -> dict[int, bytes]:
    names = set(entries(rank_dir))
    out = {}
    for name in names:
        step = F.parse_step(name, suffix=".meta")
        if step is not None and F.step_name(step) + ".manifest" not in names and \
                F.step_name(step) + ".corrupt" not in names:
            data = F.read_bytes(os.path.join(rank_dir, name))
            if data is not None:
                out[step] = data
    return out
