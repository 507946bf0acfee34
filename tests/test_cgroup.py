"""The process's cgroup, read as a container confines it: the CPUs of its cpuset (what
`one-gpu run` binds to and counts threads by) and the memory under its limits (what a
plan may put in host RAM), from made-up cgroup trees in both layouts."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import api.server.planning
from api.server.planning import PlanRequest, budgets
from engine.cgroup import allowed_cpus, memory_headroom
from engine.devices import HostRam, available_ram

GiB = 2**30


def test_a_cpuset_the_process_has_is_read_from_its_cgroup(tmp_path: Path) -> None:
    """cgroup v2: the nearest cgroup on the process's path with a cpuset (a container's
    own cgroup runs none: its pod's set holds); v1: the cpuset hierarchy's; none: None."""
    root = tmp_path / "sys"
    pod = root / "fs/cgroup/kubepods/pod1"
    (pod / "ctr").mkdir(parents=True)
    (pod / "cpuset.cpus.effective").write_text("4-5,12\n")
    (root / "fs/cgroup/cpuset.cpus.effective").write_text("0-15\n")
    v2 = tmp_path / "v2"
    v2.write_text("0::/kubepods/pod1/ctr\n")
    assert allowed_cpus(root / "fs/cgroup", v2) == {4, 5, 12}
    v1 = tmp_path / "v1"
    v1.write_text("4:memory:/docker/abc\n3:cpuset:/docker/abc\n0::/\n")
    (root / "fs/cgroup/cpuset/docker/abc").mkdir(parents=True)
    (root / "fs/cgroup/cpuset/docker/abc/cpuset.effective_cpus").write_text("1,3\n")
    assert allowed_cpus(root / "fs/cgroup", v1) == {1, 3}
    assert allowed_cpus(tmp_path / "no-cgroups", v2) is None
    assert allowed_cpus(root / "fs/cgroup", tmp_path / "no-such-file") is None


def _meminfo(tmp_path: Path, available: int) -> Path:
    f = tmp_path / "meminfo"
    f.write_text(f"MemTotal: {2 * available // 1024} kB\nMemAvailable: {available // 1024} kB\n")
    return f


def test_a_memory_limit_caps_the_ram_a_plan_may_use(tmp_path: Path) -> None:
    """v2: a pod limited to 8 GiB (6 in use, 2 of it page cache the kernel would reclaim)
    on a host with 64 GiB available leaves 4 GiB; the container's own cgroup has no
    limit, a looser ancestor does not count. Without any limit MemAvailable stands."""
    mount = tmp_path / "cgroup"
    pod = mount / "kubepods/pod1"
    (pod / "ctr").mkdir(parents=True)
    (pod / "ctr/memory.max").write_text("max\n")
    (pod / "ctr/memory.current").write_text(f"{5 * GiB}\n")
    (pod / "memory.max").write_text(f"{8 * GiB}\n")
    (pod / "memory.current").write_text(f"{6 * GiB}\n")
    (pod / "memory.stat").write_text(
        f"anon {4 * GiB}\nfile {2 * GiB}\nactive_file {GiB}\ninactive_file {GiB}\n"
    )
    (mount / "kubepods/memory.max").write_text(f"{100 * GiB}\n")
    (mount / "kubepods/memory.current").write_text(f"{6 * GiB}\n")
    of = tmp_path / "cgroup-of"
    of.write_text("0::/kubepods/pod1/ctr\n")
    assert memory_headroom(mount, of) == 4 * GiB
    ram = available_ram(_meminfo(tmp_path, 64 * GiB), mount, of)
    assert ram == HostRam(4 * GiB, 64 * GiB, 4 * GiB)
    assert ram.source == ("the cgroup's memory limit leaves 4.0 GiB "
                          "(the host has 64.0 GiB available)")  # fmt: skip
    free = available_ram(_meminfo(tmp_path, 64 * GiB), tmp_path / "none", of)
    assert free == HostRam(64 * GiB, 64 * GiB, None) and free.source == "MemAvailable"


def test_v1_memory_limits_and_their_no_limit_value(tmp_path: Path) -> None:
    mount = tmp_path / "cgroup"
    d = mount / "memory/docker/abc"
    d.mkdir(parents=True)
    of = tmp_path / "cgroup-of"
    of.write_text("5:memory:/docker/abc\n3:cpuset:/docker/abc\n0::/\n")
    (d / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (d / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    assert memory_headroom(mount, of) is None
    (d / "memory.limit_in_bytes").write_text(f"{16 * GiB}\n")
    # v1's plain counts are the cgroup's own, its total_ ones the subtree's (usage's scope)
    (d / "memory.stat").write_text(
        f"cache {GiB}\ninactive_file 4096\nactive_file 0\n"
        f"total_inactive_file {GiB // 2}\ntotal_active_file {GiB // 4}\n"
    )
    assert memory_headroom(mount, of) == 15 * GiB + GiB // 2 + GiB // 4


def test_odd_cgroup_files_count_as_no_constraint(tmp_path: Path) -> None:
    """A malformed line, a value that is not a number, a path that climbs out: no limit,
    no cpuset, never an exception (a server must not refuse to start over them)."""
    mount = tmp_path / "cgroup"
    (mount / "a").mkdir(parents=True)
    (mount / "a/memory.max").write_text("lots\n")
    (mount / "a/memory.current").write_text("12\n")
    (mount / "a/cpuset.cpus.effective").write_text("0-x\n")
    of = tmp_path / "cgroup-of"
    of.write_text("garbage\n0::/a\n")
    assert memory_headroom(mount, of) is None and allowed_cpus(mount, of) is None
    of.write_text("0::/../../etc\n")
    assert memory_headroom(mount, of) is None


def test_the_plan_s_ram_budget_is_what_the_cgroup_leaves_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(api.server.planning, "available_ram",
                        lambda: HostRam(3 * GiB, 64 * GiB, 3 * GiB))  # fmt: skip
    caplog.set_level(logging.INFO, logger="api.server.planning")
    assert budgets(PlanRequest(vram_budget="8GiB")).ram == 3 * GiB
    assert "RAM budget: the cgroup's memory limit leaves 3.0 GiB" in caplog.text
    assert budgets(PlanRequest(vram_budget="8GiB", ram_budget="40GiB")).ram == 40 * GiB
