"""Build the llama.cpp peers — `llama-server`, `llama-batched-bench` and
`llama-perplexity` — from the very sources llama-cpp-python vendors, so both servers run
the same kernels.

The build is cached under the bench cache folder (ignored by git) and reused while the
binaries exist. On a host with a GPU (or with cuda=True) it is a CUDA build.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from bench.server_proc import on_gpu

log = logging.getLogger(__name__)
LLAMA_CPP_PYTHON = "0.3.36"
# As the Makefile builds ours: without ggml's AMX kernels, which die of SIGILL on VMs whose
# CPUs advertise AMX (the same kernels in both servers).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


@dataclass(frozen=True)
class Peers:
    server: Path
    batched_bench: Path
    perplexity: Path


def _sdist(cache: Path) -> Path:
    """The llama-cpp-python source tarball: a local copy (offline GPU host) or from PyPI."""
    for cand in (
        cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz",
        Path(f".build/llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"),  # the Makefile's
        Path(".gpu/llama-cpp-python-src.tgz"),  # stripped (no models/templates): GPU host
    ):
        if cand.exists():
            return cand
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
            "-d",
            str(cache),
        ],
        check=True,
    )
    return cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"


def llama_cpp_source(cache: Path) -> Path:
    """The llama.cpp tree llama-cpp-python vendors, unpacked under `cache` (its
    `models/templates` holds real models' chat templates, which the tests render)."""
    src = cache / "src"
    root = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if not (root / "CMakeLists.txt").exists():
        src.mkdir(parents=True, exist_ok=True)
        with tarfile.open(_sdist(cache)) as tar:
            tar.extractall(src, filter="data")
    return root


def ensure_peers(cache: Path, *, cuda: bool) -> Peers:
    out = cache / f"peers-{LLAMA_CPP_PYTHON}-{'cuda' if cuda else 'cpu'}-noamx"
    peers = Peers(out / "llama-server", out / "llama-batched-bench", out / "llama-perplexity")
    if all(p.exists() for p in (peers.server, peers.batched_bench, peers.perplexity)):
        return peers
    root = llama_cpp_source(cache)
    build = root / ("build-cuda" if cuda else "build-cpu")
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
        f"-DCMAKE_C_FLAGS={NO_AMX}",
        f"-DCMAKE_CXX_FLAGS={NO_AMX}",
    ]
    if cuda:
        flags += [
            "-DGGML_CUDA=ON",
            f"-DCMAKE_CUDA_ARCHITECTURES={os.environ.get('CUDA_ARCH', '90')}",
        ]
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    log.info(
        "building llama-server and llama-batched-bench (%s) in %s", "cuda" if cuda else "cpu", build
    )
    subprocess.run(["cmake", "-S", str(root), "-B", str(build), *gen, *flags], check=True)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        [
            "cmake",
            "--build",
            str(build),
            "-j",
            jobs,
            "--target",
            "llama-server",
            "llama-batched-bench",
            "llama-perplexity",
        ],
        check=True,
    )
    out.mkdir(parents=True, exist_ok=True)
    for name in ("llama-server", "llama-batched-bench", "llama-perplexity"):
        shutil.copy2(build / "bin" / name, out / name)
    return peers


def main() -> None:
    """`python -m bench.peers`: build the peers now, for this machine (`make test` does
    this before the tests, so a clean clone's suite times tests, not a compiler)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cache = Path(sys.argv[1] if len(sys.argv) > 1 else ".bench").resolve()
    peers = ensure_peers(cache, cuda=on_gpu(None))
    log.info("peers ready: %s", peers.server.parent)


if __name__ == "__main__":
    main()
