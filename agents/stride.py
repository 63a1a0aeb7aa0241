"""Which saves a node sends to the nodes that keep its replicas: those whose step is a
multiple of a stride, a power of two each node finds alone from how far behind its sends are.

A node that sent each rank's newest save whenever the last send ended skipped the steps it
had no time for, and two nodes skipped different ones: a spare held one node's ranks at
steps 5 and 7 and the other's at 4 and 6, so no step of every rank was anywhere but in the
lost node's memory, and a cut node's job resumed up to 9 steps back where its copies were
2 steps behind (measured: 2 nodes x 2 ranks of 512 MiB saved every 2 s step, 12 runs). Sent
only at multiples of a stride, no node skips a step it means to send in the steady state,
and a stride that is a power of two makes every multiple of the widest node's stride one
that each node with a narrower one sends too: the nodes' copies meet on those steps.

- **Wider**: a rank saved two or more multiples of the stride since its last sent step,
  held still or let go of (it would skip one, or did): doubled until it would not.
- **A buddy after a spare**: at half the spare's rate at most (the spare is where a lost
  node's ranks resume; a buddy's copy going held the spare's next).
- **Narrower**: twice running, a target's sends of a pass ended before any rank saved the
  step half a stride after the one they sent: halved (sends at half the stride keep up).

Pure: the store (agents/checkpoints.py) tells it what each rank holds and what went.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

MAX_STRIDE = 256  # saves between sends at most: a send that slow is a broken link, not news
FAST_PASSES = 2  # passes in a row that kept up before the stride halves
SAVED_KEPT = 2 * MAX_STRIDE  # a rank's latest saves each node counts skips among


class Stride:
    def __init__(self) -> None:
        self.stride = 1
        self._fast = 0  # passes in a row that ended before half a stride's saves came

    def pick(self, sealed: Mapping[int, Iterable[int]], sent: Mapping[int, int],
             aligned: bool = True, least: int = 1,
             saved: Mapping[int, Iterable[int]] | None = None) -> dict[int, int]:
        """Rank -> the step to send it (its newest multiple of the stride, or of ``least``
        where that is wider; -1: none), the stride widened first while a rank would skip
        one (``sent``: rank -> its last sent step; a rank sent nothing yet skips nothing;
        ``saved``: the steps each rank saved lately, those let go of too, which it skipped
        as well). Not ``aligned``: the newest (a planned move's asked step, which every node
        sends)."""
        steps = {rank: sorted(set(held)) for rank, held in sealed.items()}
        if not aligned:
            return {rank: max(held, default=-1) for rank, held in steps.items()}
        came = {rank: set(held).union((saved or {}).get(rank, ())) for rank, held in steps.items()}

        def skips(k: int) -> bool:
            return any(rank in sent and sum(1 for s in seen if s % k == 0 and s > sent[rank]) > 1
                       for rank, seen in came.items())
        stride = max(self.stride, least)
        while stride < MAX_STRIDE and skips(stride):
            stride *= 2
            self.stride, self._fast = stride, 0
        return {rank: max((s for s in held if s % stride == 0), default=-1)
                for rank, held in steps.items()}

    def passed(self, sent: int, newest: int) -> None:
        """A pass sent every rank's ``sent`` step (the oldest of them) to the target, and
        ``newest`` is the newest step any rank has saved as it ends."""
        if self.stride > 1 and newest < sent + self.stride // 2:
            self._fast += 1
            if self._fast >= FAST_PASSES:
                self.stride, self._fast = self.stride // 2, 0
        else:
            self._fast = 0


class Strides:
    """The stride of each target a node sends to, in the order the store sends to them: the
    first (a hot spare, where there is one), then its buddy, at half the first's rate at most
    (the spare is where a lost node's ranks resume, and a buddy's copy going held the
    spare's next). A target that refused a copy is behind by no skip of ours: it widens
    nothing until one goes."""

    def __init__(self) -> None:
        self._of: dict[tuple[str, int], Stride] = {}
        self._saved: dict[int, set[int]] = {}  # rank -> the steps it saved lately
        self._timeline = 0
        self._order: list[tuple[str, int]] = []
        self._failed: set[tuple[str, int]] = set()
        self._sent: dict[tuple[str, int], int] = {}  # this pass: target -> its oldest step

    def targets(self, targets: list[tuple[str, int]]) -> None:
        self._of = {t: self._of.get(t, Stride()) for t in targets}
        self._order = list(targets)

    def stride(self, target: tuple[str, int]) -> int:
        return self._of[target].stride if target in self._of else 1

    def pick(self, target: tuple[str, int], sealed: Mapping[int, Iterable[int]],
             sent: Mapping[int, int], aligned: bool) -> dict[int, int]:
        """What ``Stride.pick`` says for ``target`` (a new pass begins at its first)."""
        if self._order and target == self._order[0]:
            self._sent = {}
        least = 2 * self.stride(self._order[0]) if self._order and target != self._order[0] \
            else 1
        return self._of.setdefault(target, Stride()).pick(
            sealed, {} if target in self._failed else sent, aligned, least, self._saved)

    def saved(self, rank: int, step: int, timeline: int) -> None:
        """``rank`` saved ``step`` (on the store's ``timeline``: a new one forgets the old
        one's steps, which may be later by number). Counted whether it is sent or let go of
        first: a rank holds only its last few saves, and a node whose sends took longer than
        those saves came saw no skip among what it held, kept its stride and sent other
        multiples than its peers (measured: one node's ranks on the spare at steps 4, 10,
        16, 22, the other's at 6, 12, 18, 24, and a cut node's job resumed step 0)."""
        if timeline != self._timeline:
            self._saved, self._timeline = {}, timeline
        steps = self._saved.setdefault(rank, set())
        steps.add(step)
        if len(steps) > SAVED_KEPT:
            steps.discard(min(steps))

    def went(self, target: tuple[str, int], step: int) -> None:
        self._failed.discard(target)
        self._sent[target] = min(self._sent.get(target, step), step)

    def refused(self, target: tuple[str, int]) -> None:
        self._failed.add(target)
        self._sent.pop(target, None)

    def ended(self, target: tuple[str, int], newest: int) -> None:
        """``target``'s sends of this pass ended (``newest``: the newest step any rank has
        saved as they did): whether they kept up is counted for it alone, as they end. Counted
        when the whole pass ended, a spare whose sends took 1.3 s of a 2 s step never narrowed
        to 1: every other pass, its buddy's sends after them took the pass past the next save
        (measured: 2 nodes x 2 ranks of 512 MiB, the spare's stride stuck at 2, a cut node
        redid 2 steps every time)."""
        if target in self._sent and target in self._of:
            self._of[target].passed(self._sent.pop(target), newest)
