"""Which NUMA node the GPU hangs off, and the strongest binding to it this host allows.

With the experts in host RAM every decode step streams them from memory to the CPU
cores that run them: memory on the GPU's node and threads on its cores keep that traffic
off the socket link (the system this project re-creates reports 53 → 63 tok/s from the
binding alone). Read from sysfs, no process started: the GPUs are the PCI devices the
`nvidia` driver holds, in bus order (nvidia-smi's index order), each with its
`numa_node`; a node's CPUs are its `cpulist`.

Containers often refuse `numactl --preferred` (seccomp denies set_mempolicy, EPERM) with
a message that is easy to miss, so the binding is tried strongest first — memory and
CPUs, CPUs only, `taskset` on the node's CPUs — each by running a no-op under it, and the
report says which one held and why the others did not.

A container (`--cpuset-cpus`), Kubernetes' CPU manager, a `taskset` or systemd's
`CPUAffinity=` may already confine the process to some CPUs: the binding then covers the
node's CPUs among those, by list (`--physcpubind`: `--cpunodebind` would widen it to the
whole node), and the decode threads count only those (llama.cpp's threads spin: more
threads than CPUs thrash). A node that leaves no CPU of those is not bound to, and the
report says so.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.cgroup import allowed_cpus, parse_cpulist

BUS_ID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]$")
Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    bus_id: str
    node: int | None  # None: the platform does not say (one node, or firmware silent)


@dataclass(frozen=True, slots=True)
class Binding:
    prefix: list[str]  # what the server's command line starts with ([] = unbound)
    report: str  # one line for the operator: which binding held, and why not a stronger one
    threads: int | None = None  # the node's physical cores (None: leave the default)


def sysfs() -> Path:
    """The sysfs root (ONEGPU_SYSFS: tests give a tree of their own)."""
    return Path(os.environ.get("ONEGPU_SYSFS", "/sys"))


def gpus(root: Path) -> list[Gpu]:
    """The GPUs: devices the driver holds whose PCI class is a display controller (an HGX
    board's NVSwitches are the driver's too, as bridges)."""
    driver = root / "bus/pci/drivers/nvidia"
    if not driver.is_dir():
        return []
    devices = root / "bus/pci/devices"
    found = sorted(
        p.name for p in driver.iterdir() if BUS_ID.match(p.name) and _is_gpu(devices / p.name)
    )
    return [Gpu(i, bus, _node(root / "bus/pci/devices" / bus / "numa_node"))
            for i, bus in enumerate(found)]  # fmt: skip


def _is_gpu(dev: Path) -> bool:
    try:
        return int((dev / "class").read_text().strip(), 16) >> 16 == 0x03
    except (OSError, ValueError):
        return True  # no class to read: trust the driver


def _node(path: Path) -> int | None:
    try:
        n = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return n if n >= 0 else None


def nodes(root: Path) -> list[int]:
    base = root / "devices/system/node"
    if not base.is_dir():
        return []
    return sorted(int(p.name[4:]) for p in base.iterdir() if re.fullmatch(r"node\d+", p.name))


def node_cpus(root: Path, node: int) -> list[int]:
    """The CPUs of `node`, from its cpulist ("0-15,32-47")."""
    return parse_cpulist((root / f"devices/system/node/node{node}/cpulist").read_text())


def physical_cores(root: Path, cpus: list[int]) -> int:
    """Cores among `cpus`, hyperthreads counted once (decode threads beyond the physical
    cores only contend)."""
    seen = set()
    for c in cpus:
        path = root / f"devices/system/cpu/cpu{c}/topology/thread_siblings_list"
        try:
            seen.add(path.read_text().strip())
        except OSError:
            seen.add(str(c))
    return len(seen)


def cpulist(cpus: list[int]) -> str:
    """`cpus` as a list of ranges, as taskset and cpulist write them."""
    out: list[str] = []
    start = prev = cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if c is not None:
            start = prev = c
    return ",".join(out)


def process_cpus(root: Path) -> set[int] | None:
    """The CPUs this process may run on (None: no constraint): its cpuset's, read under
    `root`'s cgroup mount, and on the real host its affinity too (a `taskset` or
    `CPUAffinity=` the operator set; a cgroup tree mounted where it is not looked for).
    A made-up sysfs tree (the tests') has CPUs of its own: this process's affinity, on
    the real host, does not apply to it."""
    cpus = allowed_cpus(root / "fs/cgroup")
    if root == Path("/sys") and hasattr(os, "sched_getaffinity"):
        mine = set(os.sched_getaffinity(0))
        cpus = mine if cpus is None else (cpus & mine or mine)
    return cpus


def candidates(t: Target) -> list[tuple[list[str], str]]:
    """The bindings to try, strongest first, with what each gives; a node the process may
    use only some CPUs of is bound by their list."""
    node = t.node
    if t.confined:
        where = cpulist(t.cpus)
        return [
            (["numactl", f"--physcpubind={where}", f"--preferred={node}"],
             f"CPUs {where} and memory on node {node}"),
            (["numactl", f"--physcpubind={where}"],
             f"CPUs {where} of node {node}, memory anywhere"),
            (["taskset", "-c", where], f"CPUs {where} of node {node} (taskset), memory anywhere"),
        ]  # fmt: skip
    return [
        (["numactl", f"--cpunodebind={node}", f"--preferred={node}"],
         f"CPUs and memory on node {node}"),
        (["numactl", f"--cpunodebind={node}"], f"CPUs on node {node}, memory anywhere"),
        (["taskset", "-c", cpulist(t.cpus)], f"CPUs of node {node} (taskset), memory anywhere"),
    ]  # fmt: skip


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)


@dataclass(frozen=True, slots=True)
class Target:
    """The GPU the server drives and its node's CPUs."""

    gpu: Gpu
    node: int
    cpus: list[int]  # the node's CPUs this process's cgroup allows
    cores: int  # physical, among `cpus`
    node_cpus: int = 0  # all the node's CPUs, where a cpuset leaves fewer (else 0)

    @property
    def confined(self) -> bool:
        return self.node_cpus > 0

    @property
    def where(self) -> str:
        confined = (f" (the cpuset allows {len(self.cpus)} of its {self.node_cpus} CPUs: "
                    f"{cpulist(self.cpus)})" if self.confined else "")  # fmt: skip
        return (f"GPU {self.gpu.index} ({self.gpu.bus_id}) on NUMA node {self.node}, "
                f"{self.cores} physical cores{confined}")  # fmt: skip


def target(
    root: Path, gpu_index: int | None = None, allowed: set[int] | None = None
) -> Target | str:
    """The GPU (the given one, else the first) and its node's CPUs that `allowed` (this
    process's cpuset; None: every CPU) holds; or why there is nothing to bind to.
    `ValueError` for a GPU index this host does not have."""
    found = gpus(root)
    if gpu_index is not None and not 0 <= gpu_index < len(found):
        have = f"GPUs 0-{len(found) - 1}" if found else "no NVIDIA GPU"
        raise ValueError(f"--gpu {gpu_index}: this host has {have}")
    if not found:
        return "no NVIDIA GPU on this host"
    gpu = found[gpu_index or 0]
    if len(nodes(root)) < 2:
        return f"GPU {gpu.index} ({gpu.bus_id}); one NUMA node: nothing to bind to"
    if gpu.node is None:
        return f"GPU {gpu.index} ({gpu.bus_id}): the platform reports no NUMA node"
    cpus = node_cpus(root, gpu.node)
    inside = cpus if allowed is None else [c for c in cpus if c in allowed]
    if not inside:
        return (f"GPU {gpu.index} ({gpu.bus_id}) on NUMA node {gpu.node}, whose CPUs "
                f"({cpulist(cpus)}) this process's cpuset ({cpulist(sorted(allowed or ()))}) "
                "leaves none of")  # fmt: skip
    fewer = len(cpus) if len(inside) < len(cpus) else 0
    return Target(gpu, gpu.node, inside, physical_cores(root, inside), fewer)


def choose(t: Target | str, run: Runner = _run) -> Binding:
    """The strongest binding whose no-op runs; unbound, with the reasons, otherwise."""
    if isinstance(t, str):
        return Binding([], f"binding: none ({t})")
    refused: list[str] = []
    for prefix, gives in candidates(t):
        why = _refusal(prefix, run)
        if why is None:
            also = f"; refused: {'; '.join(refused)}" if refused else ""
            return Binding(
                prefix, f"binding: {' '.join(prefix)} — {gives} ({t.where}){also}", t.cores
            )
        refused.append(f"{' '.join(prefix)}: {why}")
    return Binding([], f"binding: none ({t.where}; refused: {'; '.join(refused)})", t.cores)


def _refusal(prefix: list[str], run: Runner) -> str | None:
    """Why a no-op under `prefix` does not run (None: it runs)."""
    if shutil.which(prefix[0]) is None:
        return f"{prefix[0]} is not installed"
    try:
        out = run([*prefix, "true"])
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    if out.returncode == 0:
        return None
    lines = (out.stderr or out.stdout or "").strip().splitlines()
    return lines[0] if lines else f"exit {out.returncode}"
