"""The agent program's entry point: what a channel runs (see agents/relay.py)."""

from __future__ import annotations

import sys

from agents.relay import relay_main


def main() -> int:
    return relay_main()


if __name__ == "__main__":
    sys.exit(main())
