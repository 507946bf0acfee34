"""What the process's cgroup grants it: the CPUs of its cpuset and the memory under its limit.

A container (`docker run --cpuset-cpus --memory`, a Kubernetes pod's limits) confines a
process without changing what the host's sysfs and /proc/meminfo say. A plan sized by
MemAvailable alone would put more weights in RAM than the limit allows — mapped, they are
page cache the limit keeps reclaiming, so steps read them from disk again; read, the
process is killed — and threads counted from a NUMA node's CPUs would spin on CPUs the
process may not use. Both are read from the process's own cgroup (`/proc/self/cgroup`)
under the cgroup mount, in either layout: v2 (one hierarchy) or v1 (one per controller).
What cannot be read or parsed counts as no constraint (None), never as an error: a
server must not refuse to start over an odd cgroup file.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_OF = Path("/proc/self/cgroup")
MOUNT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # v1 writes "no limit" as a huge number (2^63 rounded to pages)


def parse_cpulist(text: str) -> list[int]:
    """CPUs from a cpulist ("0-15,32-47"), as sysfs and cgroups write them."""
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _dirs(controller: str, mount: Path, cgroup_of: Path) -> list[Path]:
    """The process's cgroup for `controller` and its ancestors, nearest first (v1's
    hierarchy of that controller, then v2's); [] where /proc says nothing."""
    try:
        lines = cgroup_of.read_text().splitlines()
    except (OSError, ValueError):
        return []
    out: list[Path] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            base = mount
        elif controller in controllers.split(","):
            base = mount / controller
        else:
            continue
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        out += [base.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return out


def _read(d: Path, *names: str) -> str | None:
    for name in names:
        try:
            return (d / name).read_text()
        except (OSError, ValueError):
            continue
    return None


def allowed_cpus(mount: Path = MOUNT, cgroup_of: Path = CGROUP_OF) -> set[int] | None:
    """The CPUs the process's cpuset allows; None where no cpuset says. A cgroup that does
    not run the cpuset controller has its parent's set: the nearest that has one holds."""
    for d in _dirs("cpuset", mount, cgroup_of):
        text = _read(d, "cpuset.cpus.effective", "cpuset.effective_cpus")
        if text is not None:
            try:
                cpus = parse_cpulist(text)
            except ValueError:
                return None
            return set(cpus) if cpus else None
    return None


def memory_headroom(mount: Path = MOUNT, cgroup_of: Path = CGROUP_OF) -> int | None:
    """Bytes the process may still use under the memory limits of its cgroup and every
    ancestor (the tightest counts): limit - usage + the page cache charged there, which
    the kernel reclaims before it refuses memory (MemAvailable counts it too: a model
    just downloaded and checked sits in it). None where no limit is set."""
    room: int | None = None
    for d in _dirs("memory", mount, cgroup_of):
        limit = _read(d, "memory.max", "memory.limit_in_bytes")
        usage = _read(d, "memory.current", "memory.usage_in_bytes")
        if limit is None or usage is None or limit.strip() == "max":
            continue
        try:
            cap, used = int(limit), int(usage)
        except ValueError:
            continue
        if cap >= UNLIMITED:
            continue
        free = max(0, cap - used) + _file_cache(d)
        room = free if room is None else min(room, free)
    return room


def _file_cache(d: Path) -> int:
    """The page cache charged to `d` and below (v1: its `total_` counts cover the subtree,
    the plain ones only `d` itself; v2 counts the subtree)."""
    stat: dict[str, int] = {}
    for line in (_read(d, "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            stat[key] = int(value)
    if "total_inactive_file" in stat:
        return stat["total_inactive_file"] + stat.get("total_active_file", 0)
    return stat.get("inactive_file", 0) + stat.get("active_file", 0)
