"""`one-gpu run` (`deploy/run.sh`): the operator's path from a GPU box to a served endpoint.

Fetches the model when it is named on the hub (`--hf-repo`, `--hf-file`; deploy.download),
plans the placement exactly as the server will (`serve --plan-only`, the same options)
and refuses to start on a plan that does not fit; binds the server to the GPU's NUMA node
(deploy.numa: the strongest binding the host allows, and which one it got); serves on
0.0.0.0:8090 with decode threads on that node's physical cores. Every option it does not
know is a `one-gpu serve` option and goes to both commands. `--dry-run` prints the
commands (the bindings it would try, strongest first) and starts nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from deploy.download import DownloadError, Source, add_hub_options, endpoint, fetch
from deploy.numa import Target, candidates, choose, gpus, process_cpus, sysfs, target

SERVE = [sys.executable, "-m", "api.server.cli", "serve"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="one-gpu run", description=__doc__.split("\n\n")[0],
        epilog="Any other option is passed to `one-gpu serve`.",
    )  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--gpu", type=int, help="the GPU to bind to, by nvidia-smi index (default 0)")
    add_hub_options(p, required=False)  # or --model
    return p


def source(args: argparse.Namespace, rest: Sequence[str]) -> Source | None:
    """The hub model to fetch, if one is named (`ValueError` for a half-named one)."""
    if not args.hf_repo and not args.hf_file:
        return None
    if not (args.hf_repo and args.hf_file):
        raise ValueError("--hf-repo and --hf-file go together")
    if any(a == "--model" or a.startswith("--model=") for a in rest):
        raise ValueError("--model or --hf-repo/--hf-file, not both")
    return Source(args.hf_repo, args.hf_file, args.hf_revision, args.hf_cache)


def serve_options(rest: Sequence[str], threads: int | None) -> list[str]:
    """The serve options: the operator's, over run's defaults (all interfaces, :8090,
    decode threads on the node's physical cores)."""
    given = {a.split("=", 1)[0] for a in rest if a.startswith("--")}
    out: list[str] = []
    if "--host" not in given:
        out += ["--host", "0.0.0.0"]
    if "--port" not in given:
        out += ["--port", "8090"]
    if threads and "--threads" not in given:
        out += ["--threads", str(threads)]
    return [*out, *rest]


def gpu_env(root: Path, gpu: int | None, environ: dict[str, str]) -> dict[str, str]:
    """What makes the server drive the GPU it is bound beside, and only that one: CUDA
    numbers GPUs fastest first unless told to follow the PCI bus, as nvidia-smi's indices
    (and `--gpu`) do. Nothing where the operator (or a container runtime) chose the
    visible GPUs already, or no GPU is found."""
    found = gpus(root)
    # (a container runtime that exposes some GPUs says so in NVIDIA_VISIBLE_DEVICES, and
    # sysfs there still lists the host's: its numbering is not CUDA's)
    if {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"} & set(environ) or not found:
        return {}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(gpu or 0)}


def dry_run(
    t: Target | str,
    rest: Sequence[str],
    src: Source | None = None,
    env: dict[str, str] | None = None,
) -> list[str]:
    """The lines `--dry-run` prints: what would run, in order, nothing started."""
    lines = []
    pre = [f"{k}={v}" for k, v in (env or {}).items()]
    if src is not None:
        parts = src.parts
        lines += [f"# fetch into {src.where()} what is not there (sized against the free "
                  "disk first, resumed if broken, SHA-256 checked):"]  # fmt: skip
        lines += [f"{endpoint()}/{src.repo}/resolve/{src.revision or 'main'}/{p}" for p in parts]
        rest = ["--model", f"<{parts[0]} in the cache>", *rest]
    if isinstance(t, str):
        lines += [f"# binding: none ({t})"]
        prefix: list[str] = []
        threads = None
    else:
        tries = candidates(t)
        lines += [f"# {t.where}", "# binding: the first of these no-ops that runs:"]
        lines += [shlex.join([*p, "true"]) for p, _ in tries]
        prefix, threads = tries[0][0], t.cores
    opts = serve_options(rest, threads)
    lines += ["# plan, as the server will (a plan that does not fit stops here):",
              shlex.join([*pre, *SERVE, "--plan-only", *opts]),
              "# serve (under the binding that held; shown with the first):",
              shlex.join([*pre, *prefix, *SERVE, *opts])]  # fmt: skip
    return lines


def main(argv: Sequence[str]) -> int:
    args, rest = parser().parse_known_args(argv)
    try:
        t = target(sysfs(), args.gpu, process_cpus(sysfs()))
        src = source(args, rest)
    except ValueError as e:
        sys.stderr.write(f"one-gpu run: {e}\n")
        return 2
    env = gpu_env(sysfs(), args.gpu, dict(os.environ))
    if args.dry_run:
        sys.stdout.write("\n".join(dry_run(t, rest, src, env)) + "\n")
        return 0
    os.environ.update(env)  # the plan and the server see the same GPU
    if src is not None:
        try:
            rest = ["--model", str(fetch(src)), *rest]
        except DownloadError as e:
            sys.stderr.write(f"one-gpu run: {e}\n")
            return 2
    binding = choose(t)
    sys.stdout.write(binding.report + "\n")
    if env:
        sys.stdout.write(f"GPU: {shlex.join(f'{k}={v}' for k, v in env.items())}\n")
    opts = serve_options(rest, binding.threads)
    plan = subprocess.run([*SERVE, "--plan-only", *opts], check=False)
    if plan.returncode != 0:
        sys.stderr.write("one-gpu run: the plan does not fit (above); not serving\n")
        return plan.returncode
    sys.stdout.flush()
    cmd = [*binding.prefix, *SERVE, *opts]
    os.execvp(cmd[0], cmd)  # the server takes this process's place (signals, exit code)
