"""`one-gpu run` (`deploy/run.sh`): the operator's path from a GPU box to a served endpoint.

Plans the placement exactly as the server will (`serve --plan-only`, the same options)
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

from deploy.numa import Target, candidates, choose, sysfs, target

SERVE = [sys.executable, "-m", "api.cli", "serve"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="one-gpu run", description=__doc__.split("\n\n")[0],
        epilog="Any other option is passed to `one-gpu serve`.",
    )  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--gpu", type=int, help="the GPU to bind to, by nvidia-smi index (default 0)")
    return p


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


def dry_run(t: Target | str, rest: Sequence[str]) -> list[str]:
    """The lines `--dry-run` prints: what would run, in order, nothing started."""
    if isinstance(t, str):
        lines = [f"# binding: none ({t})"]
        prefix: list[str] = []
        threads = None
    else:
        tries = candidates(t.node, t.cpus)
        lines = [f"# {t.where}", "# binding: the first of these no-ops that runs:"]
        lines += [shlex.join([*p, "true"]) for p, _ in tries]
        prefix, threads = tries[0][0], t.cores
    opts = serve_options(rest, threads)
    lines += ["# plan, as the server will (a plan that does not fit stops here):",
              shlex.join([*SERVE, "--plan-only", *opts]),
              "# serve (under the binding that held; shown with the first):",
              shlex.join([*prefix, *SERVE, *opts])]  # fmt: skip
    return lines


def main(argv: Sequence[str]) -> int:
    args, rest = parser().parse_known_args(argv)
    try:
        t = target(sysfs(), args.gpu)
    except ValueError as e:
        sys.stderr.write(f"one-gpu run: {e}\n")
        return 2
    if args.dry_run:
        sys.stdout.write("\n".join(dry_run(t, rest)) + "\n")
        return 0
    binding = choose(t)
    sys.stdout.write(binding.report + "\n")
    opts = serve_options(rest, binding.threads)
    plan = subprocess.run([*SERVE, "--plan-only", *opts], check=False)
    if plan.returncode != 0:
        sys.stderr.write("one-gpu run: the plan does not fit (above); not serving\n")
        return plan.returncode
    sys.stdout.flush()
    cmd = [*binding.prefix, *SERVE, *opts]
    os.execvp(cmd[0], cmd)  # the server takes this process's place (signals, exit code)
