"""The ``orchestrator`` command's first step (``python -m orchestrator`` alike): a command
that submits a job (``submit`` or ``run``, neither a ``--dry-run`` nor a ``--help``) forks the
job's supervisor before anything else is imported (orchestrator/spawn.py, ``fork_early``),
so that the supervisor's imports (the controller, paramiko: the longest step before the
first node's login) run while the command imports and checks, not after the job is
recorded. Then the command line itself (orchestrator/cli.py).

Only the standard library and orchestrator.spawn are imported here.
"""

from __future__ import annotations

import sys

SUBMITTING = ("submit", "run")
NOT_SUBMITTING = ("--dry-run", "--help", "-h")


def submits(argv: list[str]) -> bool:
    """Whether these arguments (``sys.argv[1:]``) submit a job, as far as can be told
    without parsing them: a command that ends before it submits tells its fork nothing,
    and the fork exits."""
    words = [a for a in argv if not a.startswith("-")]
    return bool(words) and words[0] in SUBMITTING and not any(
        a in NOT_SUBMITTING for a in argv)


def main() -> None:
    if submits(sys.argv[1:]):
        from orchestrator import spawn

        spawn.fork_early()
    from orchestrator.cli import main as command

    command()
