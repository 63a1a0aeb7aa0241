"""A torch.distributed.launch script of torch >= 2.0's era: it takes ``--local-rank`` (the
spelling that launcher passes since 2.0) and nothing else."""
import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--local-rank", type=int, required=True)
args = parser.parse_args()
assert args.local_rank == int(os.environ["LOCAL_RANK"])
print(f"local-rank {args.local_rank} of rank {os.environ['RANK']}", flush=True)
