"""Flood worker: prints many numbered lines as fast as it can (stdlib only, never imports torch).

Run by the orchestrator (it sets RANK), or by hand: ``RANK=0 FLOOD_LINES=10 python3 flood.py``.

Environment:
    FLOOD_LINES        lines to print (default 200000)
    FLOOD_STREAM       stdout | stderr | both (both: even i to stdout, odd i to stderr)
    FLOOD_WIDTH        pad each line to at least this many characters with " xxx..." (default 0)
    FLOOD_EXIT         exit code (default 0)
    FLOOD_SLEEP_EVERY  with FLOOD_SLEEP: sleep FLOOD_SLEEP seconds after every that many lines

Lines are ``flood <rank> <i>`` for i in 0..N-1, then ``flood <rank> done <N>`` on stdout.
"""

from __future__ import annotations

import os
import sys
import time

CHUNK = 4096  # lines joined per write(): one big write is far cheaper than 4096 small ones


def line(rank: str, i: int, width: int) -> str:
    text = f"flood {rank} {i}"
    if len(text) < width:
        text += " " + "x" * max(1, width - len(text) - 1)
    return text


def main() -> int:
    rank = os.environ.get("RANK", "0")
    n = int(os.environ.get("FLOOD_LINES", "200000"))
    stream = os.environ.get("FLOOD_STREAM", "stdout")
    width = int(os.environ.get("FLOOD_WIDTH", "0"))
    code = int(os.environ.get("FLOOD_EXIT", "0"))
    sleep_every = int(os.environ.get("FLOOD_SLEEP_EVERY", "0"))
    sleep = float(os.environ.get("FLOOD_SLEEP", "0"))
    if stream not in ("stdout", "stderr", "both"):
        print(f"FLOOD_STREAM must be stdout, stderr or both, not {stream!r}", file=sys.stderr)
        return 2
    pausing = sleep_every > 0 and sleep > 0
    start = 0
    while start < n:
        stop = min(start + CHUNK, n)
        if pausing:  # a chunk never spans a pause, so pauses fall exactly every sleep_every lines
            stop = min(stop, (start // sleep_every + 1) * sleep_every)
        batch = range(start, stop)
        if stream == "both":
            sys.stdout.write("".join(line(rank, i, width) + "\n" for i in batch if i % 2 == 0))
            sys.stderr.write("".join(line(rank, i, width) + "\n" for i in batch if i % 2 == 1))
        else:
            out = sys.stdout if stream == "stdout" else sys.stderr
            out.write("".join(line(rank, i, width) + "\n" for i in batch))
        if pausing and stop % sleep_every == 0:
            # Flushed first: a pause is meant to be seen by the reader as a burst, then quiet.
            sys.stdout.flush()
            sys.stderr.flush()
            time.sleep(sleep)
        start = stop
    sys.stderr.flush()
    sys.stdout.write(f"flood {rank} done {n}\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
