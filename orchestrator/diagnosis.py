"""Where each rank is: parse the stacks that py-spy or faulthandler gave, and say it short.

``diagnose`` groups ranks by where their main thread is and names the odd one out first::

    rank 3 in stuck_in_data_loading (data.py:12); ranks 0-2 in all_reduce (train.py:41)

The place is the innermost frame (what the rank is doing) and the innermost frame of the
user's own code (where it was called from). Pure: no I/O.
"""

from __future__ import annotations

import re

_PYSPY_FRAME = re.compile(r"^\s+(?P<fn>\S.*?) \((?P<file>[^():]+):(?P<line>\d+)\)\s*$")
_FAULT_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>.+)$')
_LIBRARY = ("site-packages", "dist-packages", "/lib/python", "<frozen", "threading.py", "torch/")


def frames(text: str) -> list[tuple[str, str, int]]:
    """The main thread's frames, innermost first, as (function, file, line).

    py-spy names it (MainThread). faulthandler does not, and marks as current whichever
    thread took the signal; there the main thread is the one not started by ``threading``
    (whose outermost frame is not ``_bootstrap``), such as the orchestrator's sampler."""
    threads: list[tuple[str, list[tuple[str, str, int]]]] = []
    for line in text.splitlines():
        if line.startswith("Thread ") or line.startswith("Current thread "):
            threads.append((line, []))
            continue
        m = _PYSPY_FRAME.match(line) or _FAULT_FRAME.match(line)
        if m:
            if not threads:
                threads.append(("", []))
            threads[-1][1].append((m["fn"].strip(), m["file"], int(m["line"])))
    named = [f for head, f in threads if "MainThread" in head]
    unstarted = [f for _, f in threads
                 if f and not (f[-1][0].endswith("_bootstrap") and "threading" in f[-1][1])]
    for candidates in (named, unstarted, [f for _, f in threads]):
        if candidates:
            return candidates[0]
    return []


def where(text: str) -> str:
    """``fn (file:line)``: the innermost function, and the user's call site if it differs."""
    stack = frames(text)
    if not stack:
        return "stack unknown"
    fn, file, line = stack[0]
    own = next(((f, fl, ln) for f, fl, ln in stack if not any(s in fl for s in _LIBRARY)),
               stack[0])
    return f"{fn} ({own[1].rsplit('/', 1)[-1]}:{own[2]})"


def _ranks_text(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    parts, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None], strict=True):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b if b is not None else start
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def diagnose(stacks: dict[int, str]) -> str:
    """One line: ranks grouped by where they are, smallest group (the odd one out) first."""
    groups: dict[str, list[int]] = {}
    for rank, text in stacks.items():
        groups.setdefault(where(text), []).append(int(rank))
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), min(kv[1])))
    return "; ".join(f"{_ranks_text(ranks)} in {place}" for place, ranks in ordered)


# --- stragglers ------------------------------------------------------------------------------
# Each rank's sampler reports how often its main thread was seen inside a collective over the
# last 30 s (agents/shims/sitecustomize.py). Under synchronous collectives every rank steps at
# the pace of the slowest, so step rates cannot tell; but the fast ranks spend the difference
# waiting in the collective, and the slow one hardly waits at all.
STRAGGLER_MIN_SAMPLES = 100  # 10 s at the default 10 samples a second
STRAGGLER_OTHERS_WAIT = 0.3  # the others must wait at least this share of the time...
STRAGGLER_RATIO = 3.0  # ...and at least this many times as much as the rank


def stragglers(waits: dict[int, tuple[int, int]]) -> list[int]:
    """Ranks that make the others wait: rank -> (samples, of them waiting in a collective).

    A rank is named when the median of the *other* ranks waits at least 30% of the time and
    at least 3x as much as it does. A balanced job, where everyone waits about alike, names
    nobody, however much time goes to communication; ranks with too few samples say nothing.
    """
    shares = {rank: waiting / samples for rank, (samples, waiting) in waits.items()
              if samples >= STRAGGLER_MIN_SAMPLES}
    named = []
    for rank, share in shares.items():
        others = sorted(v for r, v in shares.items() if r != rank)
        if not others:
            continue
        mid = len(others) // 2
        median = others[mid] if len(others) % 2 else (others[mid - 1] + others[mid]) / 2
        if median >= STRAGGLER_OTHERS_WAIT and median >= STRAGGLER_RATIO * share:
            named.append(rank)
    return sorted(named)
