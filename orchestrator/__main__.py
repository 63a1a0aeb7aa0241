"""``python -m orchestrator`` is the ``orchestrator`` command."""

from orchestrator.cli import main

main()
