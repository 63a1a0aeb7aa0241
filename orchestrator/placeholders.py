"""``${name}`` placeholders in ``command`` items and ``env`` values, filled in per worker.

    ${rank} ${local_rank} ${node_rank} ${world_size} ${nnodes} ${job_id} ${attempt}
    ${master_addr} ${master_port} ${node_start_rank} ${nproc_per_node}

``$$`` is a literal ``$``; any other ``$`` is kept as it is. With these, a script written
for ``torch.distributed.launch`` runs unchanged:
``command: [python3, train.py, "--local_rank=${local_rank}"]``, and so does one that starts
its own workers on each node (``launch: per-node``): ``--master_addr ${master_addr}
--master_port ${master_port} --world_size ${world_size} --start_rank ${node_start_rank}
--num_gpus ${nproc_per_node}``. Pure: no I/O.
"""

from __future__ import annotations

import re

NAMES = ("rank", "local_rank", "node_rank", "world_size", "nnodes", "job_id", "attempt",
         "master_addr", "master_port", "node_start_rank", "nproc_per_node")
#: One worker's own: an env value that uses them is filled in per worker.
PER_RANK = frozenset({"rank", "local_rank"})
#: Known only when the orchestrator assigns the ranks: not before torch's own rendezvous
#: has run (c10d: torchrun assigns them).
STATIC_ONLY = frozenset({"rank", "local_rank", "world_size", "node_start_rank"})

_TOKEN = re.compile(r"\$\$|\$\{([^{}]*)\}|\$\{")


def names_in(text: str) -> set[str]:
    """The placeholder names ``text`` uses; ValueError names an unknown or unclosed one."""
    found = set()
    for m in _TOKEN.finditer(text):
        if m.group(0) == "$$":
            continue
        if m.group(0) == "${":
            raise ValueError(f"unclosed placeholder at {text[m.start():m.start() + 20]!r}")
        name = m.group(1)
        if name not in NAMES:
            raise ValueError(f"unknown placeholder ${{{name}}} (known: "
                             + ", ".join(f"${{{n}}}" for n in NAMES) + "; $$ for a literal $)")
        found.add(name)
    return found


def expand(text: str, values: dict[str, object]) -> str:
    """``text`` with its placeholders replaced (the names were checked by names_in)."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return str(values[m.group(1)])

    return _TOKEN.sub(one, text)
