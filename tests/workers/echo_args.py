"""Prints this worker's rank and its command-line arguments as JSON, then exits 0: what
``orchestrator run`` passed after the script must arrive untouched."""
import json
import os
import sys

print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} args "
      + json.dumps(sys.argv[1:]))
