"""The built-in GPU health check on a node, through ``nvidia-smi``: the GPUs it sees against
the count expected, uncorrectable ECC errors, pages waiting to be retired and (Ampere and
later, which remap rows instead) rows waiting to be remapped or that failed to remap. Any of
these makes the node unhealthy before an attempt starts on it. A node without
``nvidia-smi`` is a CPU node: nothing is checked.

``parse`` is pure (tests/unit/test_gpucheck.py feeds it nvidia-smi's CSV as it prints it).
"""

from __future__ import annotations

import shutil
import subprocess

from agents import containment

#: Asked of every driver; a field a GPU lacks prints as "[N/A]" or "[Not Supported]".
BASE_FIELDS = ("index", "pci.bus_id", "ecc.errors.uncorrected.volatile.total",
               "retired_pages.pending")
#: Only drivers since r450 know these; an older one refuses the whole query.
REMAP_FIELDS = ("index", "remapped_rows.pending", "remapped_rows.failure")


def check(expected: int | None, timeout: float) -> list[str]:
    """Problems with this node's GPUs (none: healthy, or no nvidia-smi here). ``expected``:
    the GPUs the node must show (None: any number, at least one)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    base = _query(smi, BASE_FIELDS, timeout)
    if isinstance(base, str):
        return [f"nvidia-smi failed: {base}"]
    remap = _query(smi, REMAP_FIELDS, timeout)
    return parse(base, remap if isinstance(remap, list) else [], expected)


def parse(base: list[list[str]], remap: list[list[str]], expected: int | None) -> list[str]:
    """The problems in nvidia-smi's rows (``--format=csv,noheader,nounits``, split on
    commas): ``base`` per BASE_FIELDS, ``remap`` per REMAP_FIELDS (empty: not known)."""
    problems = []
    if expected is not None and len(base) != expected:
        problems.append(f"nvidia-smi sees {len(base)} GPU(s), {expected} expected")
    elif not base:
        problems.append("nvidia-smi sees no GPU")
    for row in base:
        if len(row) != len(BASE_FIELDS):
            problems.append(f"nvidia-smi printed an unexpected line: {', '.join(row)[:200]}")
            continue
        index, bus, ecc, pending = row
        if _count(ecc) > 0:
            problems.append(f"GPU {index} ({bus}): {ecc} uncorrectable ECC error(s) since the "
                            "driver loaded")
        if _yes(pending):
            problems.append(f"GPU {index} ({bus}): retired pages pending (a reset is due)")
    for row in remap:
        if len(row) != len(REMAP_FIELDS):
            continue
        index, pending, failure = row
        if _yes(pending):
            problems.append(f"GPU {index}: remapped rows pending (a reset is due)")
        if _yes(failure):
            problems.append(f"GPU {index}: a row remapping failed")
    return problems


def _query(smi: str, fields: tuple[str, ...], timeout: float) -> list[list[str]] | str:
    try:
        done = containment.run([smi, f"--query-gpu={','.join(fields)}",
                                "--format=csv,noheader,nounits"], timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode != 0:
        last = (done.stdout + done.stderr).strip().splitlines()
        return f"exit code {done.returncode}: {last[-1] if last else ''}".strip()
    return [[cell.strip() for cell in line.split(",")]
            for line in done.stdout.splitlines() if line.strip()]


def _count(cell: str) -> int:
    return int(cell) if cell.isdigit() else 0  # "[N/A]", "[Not Supported]": no ECC here


def _yes(cell: str) -> bool:
    return cell.strip().lower() == "yes"
