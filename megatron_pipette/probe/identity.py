"""Who each rank is: host, local rank, device name and memory, catalog GPU.

Why: the planner places pipeline stages and tensor-parallel groups by node
and needs each device's memory; the catalog name gives it datasheet peaks.
"""

from __future__ import annotations

import os
import socket

import torch

from megatron_pipette.spec.hardware import gpu_catalog


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def node_name() -> str:
    """The node this process runs on: the host, and torchrun's node rank (GROUP_RANK) when set,
    so that several torchrun agents on one host (containers, emulated clusters) count as nodes."""
    group = os.environ.get("GROUP_RANK")
    return socket.gethostname() if group is None else f"{socket.gethostname()}/{group}"


def host_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """Physical memory of this host: MemTotal from /proc/meminfo, else sysconf."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def catalog_name(device_name: str) -> str | None:
    """The catalog GPU for a torch device name ("NVIDIA H100 80GB HBM3" -> "H100-80GB"), else None."""
    gpu = gpu_catalog().get(device_name.lower())
    return gpu.name if gpu else None


def gpu_id(device: torch.device) -> str | None:
    """Which GPU this is, for telling a machine's measurements apart from another's: the UUID where
    torch shows it (CUDA), else the CUDA_VISIBLE_DEVICES this process was given (None: not set)."""
    if device.type == "cuda":
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:
            return str(uuid)
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def identify(device: torch.device) -> dict:
    """This rank's identity as plain data (see document.RankReport.identity).

    On CPU the memory figure is the host's; rank 0 divides it among the ranks
    on that host (LOCAL_WORLD_SIZE when torchrun set it).
    """
    ident: dict = {"host": node_name(), "local_rank": _env_int("LOCAL_RANK"),
                   "local_world_size": _env_int("LOCAL_WORLD_SIZE"),
                   "host_memory_bytes": host_memory_bytes(), "gpu_id": gpu_id(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        ident.update(device_name=props.name, gpu=catalog_name(props.name), memory_bytes=int(props.total_memory))
    else:
        ident.update(device_name="cpu", gpu=None, memory_bytes=None)
    return ident
