"""Prints this worker's orchestrator/torchrun environment as one JSON line, then exits 0."""
import json
import os

KEYS = [
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS", "ORCHESTRATOR_JOB_ID", "ORCHESTRATOR_ATTEMPT",
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "USER_VAR", "EXTRA", "KEEP",
    "NCCL_ASYNC_ERROR_HANDLING",
]
print("ENV " + json.dumps({k: os.environ.get(k) for k in KEYS}, sort_keys=True), flush=True)
