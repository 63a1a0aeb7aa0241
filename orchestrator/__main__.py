"""``python -m orchestrator`` is the ``orchestrator`` command."""

from orchestrator.entry import main

main()
