"""The benchmarks' worker, runnable under torchrun or the orchestrator (gloo, env://).

--once: one all-reduce, then exit (launch time).
otherwise: print READY <restarted> <rank> <time> once every rank joined, then all-reduce
        every 0.1 s. Unless --crash-marker exists, the last rank prints CRASH <time> and
        exits 1 after 2 s (creating it); once it exists, the group runs 3 s and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def say(line: str) -> None:
    # One write per line: under torchrun, ranks share one pipe, and print() with
    # PYTHONUNBUFFERED writes the text and the newline separately, so lines interleave.
    os.write(1, (line + "\n").encode())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--once", action="store_true")
    p.add_argument("--crash-marker", default="")
    args = p.parse_args()
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1)
    dist.all_reduce(t)
    if args.once:
        dist.destroy_process_group()
        return
    restarted = int(os.path.exists(args.crash_marker))
    say(f"READY {restarted} {rank} {time.time():.4f}")
    started = time.monotonic()
    while True:
        time.sleep(0.1)
        if not restarted and rank == world - 1 and time.monotonic() - started > 2:
            open(args.crash_marker, "w").close()
            say(f"CRASH {time.time():.4f}")
            sys.exit(1)
        dist.all_reduce(t)
        if restarted and time.monotonic() - started > 3:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
