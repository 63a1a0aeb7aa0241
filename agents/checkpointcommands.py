"""Commands and settings of the checkpoint store (agents/checkpoints.py), part of
agents/commands.py: the job's ``checkpoint`` section as a node needs it with the step to
resume, the replicas to pull and where other ranks' copies are, where a node replicates, and
which steps it retains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents import protocol as P
from agents.commandbase import Command
from agents.fields import MAX_ARG, MAX_COUNT, MAX_PORT, MAX_RANK
from agents.fields import CommandFields as _Read


@dataclass(frozen=True)
class Pull:
    """A copy of ``rank`` at ``step`` to fetch from the replicas at ``address:port``."""

    rank: int
    step: int
    address: str
    port: int

    @classmethod
    def read(cls, f: _Read) -> Pull:
        return cls(f.integer("rank", 0, MAX_RANK), f.integer("step"),
                   f.text("address", 255), f.integer("port", 1, MAX_PORT))


MAX_COPIES = 1 << 14  # entries of a directory of other ranks' copies (Copies)
MAX_STEPS = 16  # steps of one rank one entry names


@dataclass(frozen=True)
class Copies:
    """Copies of ``rank`` at ``steps`` that the replica server at ``address:port`` serves
    (its replicas, or its own ranks' saves): what a DCP load into fewer ranks reads
    (agents/borrows.py, orchestrator/checkpoint_reshard.py)."""

    rank: int
    steps: tuple[int, ...]
    address: str
    port: int

    @classmethod
    def read(cls, f: _Read) -> Copies:
        return cls(f.integer("rank", 0, MAX_RANK),
                   tuple(f.integer("steps", value=s)
                         for s in f.array("steps", limit=MAX_STEPS)),
                   f.text("address", 255), f.integer("port", 1, MAX_PORT))


@dataclass(frozen=True)
class CheckpointConfig:
    """The job's ``checkpoint`` section as a node needs it (agents/checkpoints.py), and the
    step the controller found every rank of this attempt holding (None: start fresh)."""

    dir: str | None = None  # persisted copies, relative to the workdir (None: memory only)
    persist_every: int = 10
    keep: int = 2
    memory: int | None = None  # bytes of the node's memory for its ranks' saves
    restore_step: int | None = None
    pulls: tuple[Pull, ...] = ()  # copies to fetch before the workers start
    # Where the copies of ranks not held here are, when the job goes on with fewer ranks
    # than saved (a DCP load reshards them): read from their nodes' memory, as needed.
    copies: tuple[Copies, ...] = ()

    @classmethod
    def read(cls, f: _Read) -> CheckpointConfig:
        pulls = tuple(Pull.read(_Read(p, f"{f.kind}.pulls")) if isinstance(p, dict) else
                      _bad(f, "pulls", p) for p in f.array("pulls", True, limit=P.MAX_LOCAL))
        copies = tuple(Copies.read(_Read(c, f"{f.kind}.copies")) if isinstance(c, dict) else
                       _bad(f, "copies", c)
                       for c in f.array("copies", True, limit=MAX_COPIES))
        return cls(f.text("dir", MAX_ARG, True), f.integer("persist_every", 1, MAX_COUNT),
                   f.integer("keep", 1, MAX_COUNT),
                   f.integer("memory", 1, MAX_COUNT, optional=True),
                   f.integer("restore_step", 0, MAX_COUNT, optional=True), pulls, copies)


def _bad(f: _Read, name: str, value: Any) -> Any:
    raise f.bad(name, value)


NO_CHECKPOINT = CheckpointConfig()  # the defaults, and no step to resume


MAX_TARGETS = 64  # replica servers one node sends to
MAX_HOLD = 86400.0  # seconds ranks may wait at a step a planned move asked for


@dataclass(frozen=True)
class ReplicateTo(Command):
    """Send this node's checkpoints to its buddy's replica server (port 0: to nobody), and
    ``also`` to these (a hot spare's: it holds them before it may take this node's place)."""

    OP = "replicate_to"
    address: str
    port: int
    also: tuple[tuple[str, int], ...] = ()

    @classmethod
    def read(cls, f: _Read) -> ReplicateTo:
        also = []
        for target in f.array("also", True, limit=MAX_TARGETS):
            if not (isinstance(target, list) and len(target) == 2):
                _bad(f, "also", target)
            also.append((f.text("also", 255, value=target[0]),
                         f.integer("also", 1, MAX_PORT, value=target[1])))
        return cls(f.text("address", 255), f.integer("port", 0, MAX_PORT), tuple(also))



@dataclass(frozen=True)
class Retain(Command):
    """Keep copies of steps from ``step`` on (memory and replicas), while memory allows."""

    OP = "retain"
    step: int

    @classmethod
    def read(cls, f: _Read) -> Retain:
        return cls(f.integer("step"))


@dataclass(frozen=True)
class Resumed(Command):
    """Every rank of ``attempt`` resumes (or resumed) ``step``: copies of later steps saved
    before it are of a timeline no rank follows, and go. Told to every node once the ranks
    loaded an older step than they were told (a copy that did not verify, a load into
    another world size), and to the spares as an attempt starts (a fall back's spare kept
    the steps it fell back from, and the attempt after resumed them)."""

    OP = "resumed"
    step: int
    attempt: int

    @classmethod
    def read(cls, f: _Read) -> Resumed:
        return cls(f.integer("step"), f.integer("attempt"))


@dataclass(frozen=True)
class Release(Command):
    """This node keeps nothing of the job's any more: drained, out of the job, and the
    ranks that took its place loaded their copies. Its checkpoint memory goes (its replica
    server stays: undrained, it may be a spare again)."""

    OP = "release"


@dataclass(frozen=True)
class SaveAt(Command):
    """Every rank of this node saves ``step`` and then waits there up to ``hold`` seconds (a
    planned interruption: the ranks of every node save the same step, and the job moves on
    from it with none done twice); None: the request is over, the ranks go on."""

    OP = "save_at"
    step: int | None
    hold: float = 0.0
    persist: bool = False  # to checkpoint.dir as well (every node leaves: the job stops)
    # False: this node stays (or the job stops), so its copies of the step are needed on no
    # other node for the move; they are sent after it, not beside the leaving node's.
    replicate: bool = True

    @classmethod
    def read(cls, f: _Read) -> SaveAt:
        hold = f.number("hold")
        if not 0.0 <= hold <= MAX_HOLD:
            raise f.bad("hold", hold)
        return cls(f.integer("step", optional=True), hold, f.flag("persist", False),
                   f.flag("replicate", True))
