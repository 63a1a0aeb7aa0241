"""What an agent tells about its node, read without importing torch: the interface toward an
address, free ports, GPUs, torch's version (and which flight recorder variables it reads),
and the machine's identity."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import socket
import struct
import sys


def interface_for(address: str) -> str | None:
    """Name of the network interface this node uses to reach ``address``.

    gloo and NCCL otherwise bind to the address of the machine's hostname, which on common
    images resolves to 127.0.x.1 and breaks every cross-node job.
    """
    try:
        infos = socket.getaddrinfo(address, 9, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # UDP connect sends nothing: it only picks the route
            local_ip = probe.getsockname()[0]
        if local_ip.startswith("127.") or local_ip == "::1":
            return "lo"
        return _interface_with_address(local_ip)
    except OSError:
        return None


def _interface_with_address(ip: str) -> str | None:
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, request)
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


def torch_version() -> str | None:
    """torch's version from its dist-info folder's name, without importing it (2 s of CPU)
    or scanning every distribution (importlib.metadata). The agent runs isolated (-I), so
    the places a worker's python also looks (PYTHONPATH, the user's site) are added."""
    import site

    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for entry in [*extra, site.getusersitepackages(), *sys.path]:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith("torch-") and name.endswith(".dist-info"):
                return name[len("torch-"):-len(".dist-info")]
    return None


# torch's flight recorder variables: the TORCH_FR_* names since 2.8 (the old TORCH_NCCL_*
# names still work there, with a deprecation warning in every process that sets them).
FR_SIZE_NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_DUMP_NAMES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def flight_recorder_names(torch: str | None) -> tuple[str, str]:
    """(buffer size, dump file) variable names that this torch reads without a warning."""
    m = re.match(r"(\d+)\.(\d+)", torch or "")
    old = m is not None and (int(m[1]), int(m[2])) < (2, 8)
    return (FR_SIZE_NAMES[1], FR_DUMP_NAMES[1]) if old else (FR_SIZE_NAMES[0], FR_DUMP_NAMES[0])


def machine_id() -> str:
    """This machine, as a short hash: its machine-id and its name (on Slurm, the node's)."""
    try:
        with open("/etc/machine-id", encoding="ascii", errors="replace") as f:
            ident = f.read(64).strip()
    except OSError:
        ident = ""
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return hashlib.sha256(f"{ident}\0{name}".encode()).hexdigest()[:16]


def gpu_count() -> int:
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    try:
        return len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])
    except OSError:
        return 0


def free_port(port: int) -> tuple[int, bool]:
    """Bind ``port`` (0: any) on all addresses to show it is free now; return it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return port, False
        return s.getsockname()[1], True
