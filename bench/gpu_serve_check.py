"""The GPU run's first step: start our server on a model, answer one request, stop.

A kit that cannot serve (a wheel missing, a library that does not load, a CUDA error at
the first step) must stop the run before its benchmarks measure nothing: this exits 1 with
the reason and the server log's last lines.

    python -m bench.gpu_serve_check --model M.gguf [-- SERVE OPTIONS...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from openai import OpenAI

from bench.server_proc import start_server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--log", type=Path, default=Path("/tmp/serve-check.log"))
    p.add_argument("serve_args", nargs="*", help="more `one-gpu serve` options (after --)")
    args = p.parse_args()
    t0 = time.monotonic()
    try:
        srv = start_server(
            ["--model", args.model, "--served-model-name", "m", "--n-ctx", "4096",
             *args.serve_args],
            args.log, ready_timeout_s=240,
        )  # fmt: skip
    except Exception as e:  # the reason with the log's tail, then stop the run
        print(f"SERVER DID NOT START: {str(e)[-4000:]}", flush=True)
        return 1
    try:
        ready = time.monotonic() - t0
        client = OpenAI(base_url=srv.base_url, api_key="x", _strict_response_validation=True)
        r = client.completions.create(model="m", prompt="The GPU check", max_tokens=16)
        print(f"served: ready in {ready:.1f} s, answered {r.usage and r.usage.completion_tokens} "
              f"tokens", flush=True)  # fmt: skip
        for line in srv.log().splitlines():
            if "weights on" in line or "routed-expert cache" in line or "moe_cache" in line:
                print(line)
        return 0
    except Exception as e:
        print(f"SERVER DID NOT ANSWER: {e}\n{srv.log()[-3000:]}", flush=True)
        return 1
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
