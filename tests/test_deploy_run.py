"""`one-gpu run`'s NUMA binding and dry run, on a made-up two-socket host: a sysfs tree of
our own (ONEGPU_SYSFS) and stub `numactl` / `taskset` on PATH that behave as the real ones
do where they work, and as seccomp makes them behave where they do not (EPERM)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from bench.server_proc import Server, free_port, start_process
from deploy.numa import Binding, choose, target
from tests.tiny_gguf import write_llama, write_qwen3moe

ROOT = Path(__file__).resolve().parents[1]
# node 0: CPUs 0-3 and their hyperthreads 8-11; node 1: 4-7 and 12-15
NODE_CPUS = {0: "0-3,8-11", 1: "4-7,12-15"}
GPUS = {"0000:17:00.0": 0, "0000:ca:00.0": 1}  # bus id -> node, in bus order
STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "{log}"
{body}
"""
NUMACTL_EPERM = """for a in "$@"; do case $a in --preferred=*)
  echo "set_mempolicy: Operation not permitted" >&2; exit 1;; esac; done
exit 0"""


def _sysfs(root: Path, gpus: dict[str, int], nodes: dict[int, str]) -> Path:
    for node, cpus in nodes.items():
        d = root / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    for c in range(16):
        t = root / f"devices/system/cpu/cpu{c}/topology"
        t.mkdir(parents=True)
        (t / "thread_siblings_list").write_text(f"{c % 8},{c % 8 + 8}\n")
    driver = root / "bus/pci/drivers/nvidia"
    driver.mkdir(parents=True)
    for bus, node in gpus.items():
        dev = root / "bus/pci/devices" / bus
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(f"{node}\n")
        (dev / "class").write_text("0x030200\n")  # 3D controller
        (driver / bus).symlink_to(dev)
    (driver / "module").mkdir()  # what else a driver folder holds: not a device
    switch = root / "bus/pci/devices/0000:05:00.0"  # an NVSwitch: the driver's, not a GPU
    switch.mkdir(parents=True)
    (switch / "class").write_text("0x068000\n")
    (switch / "numa_node").write_text("0\n")
    (driver / switch.name).symlink_to(switch)
    return root


@pytest.fixture
def host(tmp_path: Path) -> Path:
    return _sysfs(tmp_path / "sys", GPUS, NODE_CPUS)


def _stubs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **bodies: str) -> Path:
    """Stub tools on a PATH of their own (with the basics a bash script needs); each
    records its command line in the returned log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for name, body in bodies.items():
        f = bin_dir / name
        f.write_text(STUB.format(log=log, body=body))
        f.chmod(0o755)
    for tool in ("bash", "basename", "env", "true"):
        real = Path("/usr/bin", tool) if Path("/usr/bin", tool).exists() else Path("/bin", tool)
        (bin_dir / tool).symlink_to(real)
    monkeypatch.setenv("PATH", str(bin_dir))
    return log


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_the_strongest_binding_that_runs_is_chosen(
    host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _stubs(tmp_path, monkeypatch, numactl="exit 0", taskset="exit 0")
    b = choose(target(host))
    assert b.prefix == ["numactl", "--cpunodebind=0", "--preferred=0"]
    assert b.threads == 4  # node 0's physical cores (8 CPUs, hyperthreads counted once)
    assert b.report == (
        "binding: numactl --cpunodebind=0 --preferred=0 — CPUs and memory on node 0 "
        "(GPU 0 (0000:17:00.0) on NUMA node 0, 4 physical cores)"
    )
    assert _calls(log) == ["numactl --cpunodebind=0 --preferred=0 true"]


def test_memory_binding_refused_as_seccomp_does_falls_back_to_cpus_and_says_so(
    host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _stubs(tmp_path, monkeypatch, numactl=NUMACTL_EPERM, taskset="exit 0")
    b = choose(target(host))
    assert b.prefix == ["numactl", "--cpunodebind=0"]
    assert b.report.startswith("binding: numactl --cpunodebind=0 — CPUs on node 0, memory")
    assert b.report.endswith("refused: numactl --cpunodebind=0 --preferred=0: "
                             "set_mempolicy: Operation not permitted")  # fmt: skip
    assert _calls(log) == ["numactl --cpunodebind=0 --preferred=0 true",
                           "numactl --cpunodebind=0 true"]  # fmt: skip


def test_without_numactl_taskset_pins_the_node_s_cpus(
    host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _stubs(tmp_path, monkeypatch, taskset="exit 0")
    b = choose(target(host, 1))  # the second GPU: node 1
    assert b.prefix == ["taskset", "-c", "4-7,12-15"]
    assert "numactl --cpunodebind=1 --preferred=1: numactl is not installed" in b.report
    assert b.report.startswith("binding: taskset -c 4-7,12-15 — CPUs of node 1 (taskset)")
    assert _calls(log) == ["taskset -c 4-7,12-15 true"]


def test_two_gpus_on_two_nodes_bind_to_the_chosen_one_s(
    host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stubs(tmp_path, monkeypatch, numactl="exit 0")
    assert choose(target(host, 0)).prefix[1:] == ["--cpunodebind=0", "--preferred=0"]
    assert choose(target(host, 1)).prefix[1:] == ["--cpunodebind=1", "--preferred=1"]
    with pytest.raises(ValueError, match="this host has GPUs 0-1"):
        target(host, 2)


def test_no_gpu_one_node_or_nothing_that_runs_serves_unbound_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stubs(tmp_path, monkeypatch, numactl="exit 1", taskset="echo 'taskset: failed' >&2; exit 1")
    bare = _sysfs(tmp_path / "bare", {}, NODE_CPUS)
    one = _sysfs(tmp_path / "one", {"0000:17:00.0": 0}, {0: "0-15"})
    assert choose(target(bare)) == Binding([], "binding: none (no NVIDIA GPU on this host)")
    assert choose(target(one)).report == (
        "binding: none (GPU 0 (0000:17:00.0); one NUMA node: nothing to bind to)"
    )
    b = choose(target(_sysfs(tmp_path / "two", GPUS, NODE_CPUS)))
    assert b.prefix == [] and "taskset -c 0-3,8-11: taskset: failed" in b.report


def test_a_cpuset_narrows_the_binding_to_the_node_s_cpus_it_allows(
    host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container confined to some of the GPU node's CPUs binds to those and runs a
    decode thread per core it has, not per core the node has; confined elsewhere, it is
    not bound and the report says why."""
    log = _stubs(tmp_path, monkeypatch, numactl=NUMACTL_EPERM, taskset="exit 0")
    b = choose(target(host, 1, allowed={0, 1, 5, 6, 13, 14}))  # node 1: 4-7,12-15
    # by list: --cpunodebind would widen the process to the whole node
    assert _calls(log) == ["numactl --physcpubind=5-6,13-14 --preferred=1 true",
                           "numactl --physcpubind=5-6,13-14 true"]  # fmt: skip
    assert b.prefix == ["numactl", "--physcpubind=5-6,13-14"]
    assert b.threads == 2  # CPUs 5 and 13 are one core, 6 and 14 another
    assert "4 physical cores" not in b.report
    (tmp_path / "t").mkdir()
    _stubs(tmp_path / "t", monkeypatch, taskset="exit 0")
    assert choose(target(host, 1, allowed={5, 13})).prefix == ["taskset", "-c", "5,13"]
    assert "2 physical cores (the cpuset allows 4 of its 8 CPUs: 5-6,13-14)" in b.report
    b = choose(target(host, 1, allowed={0, 1, 2}))
    assert b == Binding([], "binding: none (GPU 1 (0000:ca:00.0) on NUMA node 1, whose CPUs "
                            "(4-7,12-15) this process's cpuset (0-2) leaves none of)")  # fmt: skip
    whole = target(host, 1, allowed=set(range(16)))
    assert whole == target(host, 1)  # a cpuset that holds the node changes nothing


def test_dry_run_prints_every_command_and_starts_nothing(
    host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _stubs(tmp_path, monkeypatch, numactl="exit 0", taskset="exit 0")
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env |= {"ONEGPU_SYSFS": str(host), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "api.server.cli", "run", "--dry-run", "--gpu", "1", "--model",
         "m.gguf", "--n-ctx", "8192"],
        cwd=work, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # the server drives GPU 1 alone, numbered as nvidia-smi and --gpu number it
    serve = (
        f"CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=1 {sys.executable} -m api.server.cli "
        "serve"
    )
    opts = "--host 0.0.0.0 --port 8090 --threads 4 --model m.gguf --n-ctx 8192"
    assert out.stdout.splitlines() == [
        "# GPU 1 (0000:ca:00.0) on NUMA node 1, 4 physical cores",
        "# binding: the first of these no-ops that runs:",
        "numactl --cpunodebind=1 --preferred=1 true",
        "numactl --cpunodebind=1 true",
        "taskset -c 4-7,12-15 true",
        "# plan, as the server will (a plan that does not fit stops here):",
        f"{serve} --plan-only {opts}",
        "# serve (under the binding that held; shown with the first):",
        "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=1 numactl --cpunodebind=1 "
        f"--preferred=1 {sys.executable} -m api.server.cli serve {opts}",
    ]
    assert _calls(log) == []  # no binding was tried, no tool started
    assert list(work.iterdir()) == []  # nothing written
    # an operator's own CUDA_VISIBLE_DEVICES is left alone
    env["CUDA_VISIBLE_DEVICES"] = "0"
    mine = subprocess.run(
        [sys.executable, "-m", "api.server.cli", "run", "--dry-run", "--gpu", "1", "--model",
         "m.gguf"],
        cwd=work, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert "CUDA_VISIBLE_DEVICES" not in mine.stdout
    # in a container confined to two of node 1's cores, the threads follow the cpuset
    (host / "fs/cgroup/cpuset").mkdir(parents=True)  # v2's file, and v1's where v1 holds it
    (host / "fs/cgroup/cpuset.cpus.effective").write_text("0-1,6-7,14-15\n")
    (host / "fs/cgroup/cpuset/cpuset.effective_cpus").write_text("0-1,6-7,14-15\n")
    confined = subprocess.run(
        [sys.executable, "-m", "api.server.cli", "run", "--dry-run", "--gpu", "1", "--model",
         "m.gguf"],
        cwd=work, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    lines = confined.stdout.splitlines()
    assert lines[0] == ("# GPU 1 (0000:ca:00.0) on NUMA node 1, 2 physical cores "
                        "(the cpuset allows 4 of its 8 CPUs: 6-7,14-15)")  # fmt: skip
    assert "taskset -c 6-7,14-15 true" in lines
    assert lines[-1].endswith("--threads 2 --model m.gguf")


def answers_then_stops(srv: Server, max_tokens: int) -> None:
    """A server `one-gpu run` started answers a completion (model "tiny"); then it stops."""
    try:
        with OpenAI(base_url=srv.base_url, api_key="none", _strict_response_validation=True) as c:
            got = c.completions.create(
                model="tiny", prompt="abc", max_tokens=max_tokens, temperature=0
            )
        assert got.usage and got.usage.completion_tokens == max_tokens
    finally:
        srv.stop()


@pytest.mark.e2e
def test_run_binds_plans_and_serves(
    host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path on this CPU machine: the binding it reports is the one the server
    runs under (the stub numactl runs the command it is given, as the real one does), the
    plan is checked first, the server answers."""
    log = _stubs(tmp_path, monkeypatch, numactl='while [[ $1 == --* ]]; do shift; done\n'
                 'exec "$@"')  # fmt: skip
    model = write_llama(tmp_path / "tiny.gguf", seed=1)
    port = free_port()
    srv = start_process(
        [sys.executable, "-m", "api.server.cli", "run", "--model", str(model),
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
         "--n-ctx", "512", "--repro-slots", "0"],
        port, tmp_path / "run.log", env={"ONEGPU_SYSFS": str(host)},
    )  # fmt: skip
    answers_then_stops(srv, 3)
    out = srv.log()
    assert "binding: numactl --cpunodebind=0 --preferred=0 — CPUs and memory on node 0" in out
    assert "GPU: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0" in out
    assert "no GPU: every tensor in RAM" in out  # the plan, checked before serving
    assert _calls(log) == [
        "numactl --cpunodebind=0 --preferred=0 true",
        f"numactl --cpunodebind=0 --preferred=0 {sys.executable} -m api.server.cli serve "
        f"--threads 4 --model {model} --served-model-name tiny --host 127.0.0.1 --port {port} "
        "--n-ctx 512 --repro-slots 0",
    ]


def test_run_stops_on_a_plan_that_does_not_fit_before_binding_or_serving(
    host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan is checked first (as the server would make it, its numbers shown); one that
    does not fit ends the run with exit 2 and no server."""
    log = _stubs(tmp_path, monkeypatch, numactl="exit 0")
    model = write_qwen3moe(tmp_path / "moe.gguf", seed=5)
    env = {**os.environ, "ONEGPU_SYSFS": str(host), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "api.server.cli", "run", "--model", str(model), "--n-ctx", "1024",
         "--repro-slots", "0", "--vram-budget", "64MiB", "--port", str(free_port())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 2
    assert "not serving: VRAM: needs" in out.stderr
    assert "one-gpu run: the plan does not fit (above); not serving" in out.stderr
    assert _calls(log) == ["numactl --cpunodebind=0 --preferred=0 true"]  # bound, never served
