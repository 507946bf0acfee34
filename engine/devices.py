"""What the host offers a plan: the GPU's free memory and the RAM the kernel can give us.

GPU memory comes from ggml's backend device API (`ggml_backend_dev_memory`), through the
libggml that llama.cpp itself loaded — the same devices llama.cpp will allocate on, and no
text parsing of nvidia-smi. RAM is `MemAvailable` from /proc/meminfo: the kernel's own
estimate of what can be allocated without swapping (free pages plus reclaimable cache);
no system call reports it, and `sysconf(_SC_AVPHYS_PAGES)` counts free pages only, which
on a machine with a warm page cache badly understates what a server can use. In a
container the cgroup's memory limit may be tighter than the host (engine.cgroup): the
smaller of the two counts.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cgroup import CGROUP_OF, MOUNT, memory_headroom
from engine.placement import GPU_TYPES, ggml_devices


@dataclass(frozen=True, slots=True)
class GpuMemory:
    name: str
    free: int
    total: int


def gpu_memory(ll: Any) -> list[GpuMemory]:
    """Free and total memory of each GPU ggml can use (empty on a CPU-only build)."""
    g = ggml_devices(ll)
    g.ggml_backend_dev_memory.restype = None
    g.ggml_backend_dev_memory.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)
    ]  # fmt: skip
    out = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        if g.ggml_backend_dev_type(dev) not in GPU_TYPES:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(GpuMemory(g.ggml_backend_dev_name(dev).decode(), free.value, total.value))
    return out


@dataclass(frozen=True, slots=True)
class HostRam:
    available: int  # bytes the process may use: the smaller of the two below
    host: int  # MemAvailable
    cgroup: int | None  # what the cgroup's memory limits leave (None: no limit)

    @property
    def capped(self) -> bool:
        """Whether the cgroup's limit, not the host, sets `available`."""
        return self.cgroup is not None and self.cgroup < self.host

    @property
    def source(self) -> str:
        if self.cgroup is not None and self.capped:
            return (f"the cgroup's memory limit leaves {self.cgroup / 2**30:.1f} GiB "
                    f"(the host has {self.host / 2**30:.1f} GiB available)")  # fmt: skip
        return "MemAvailable"


def available_ram(
    meminfo: Path = Path("/proc/meminfo"), mount: Path = MOUNT, cgroup_of: Path = CGROUP_OF
) -> HostRam:
    """Bytes the kernel reports as available (MemAvailable), capped by what the process's
    cgroup memory limits leave."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            host = int(line.split()[1]) * 1024
            cgroup = memory_headroom(mount, cgroup_of)
            return HostRam(host if cgroup is None else min(host, cgroup), host, cgroup)
    raise OSError(f"no MemAvailable in {meminfo}")
