"""Wait for a server started by `deploy/run.sh` to be ready, send it one chat request, and
print the answer's first words and the binding the run reported (its first log lines).

    python -m bench.deploy_smoke --port 8091 --log serve.log
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from pathlib import Path


def ready(base: str, timeout_s: float) -> float:
    """Seconds until /health answered 200."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise SystemExit(f"not ready after {timeout_s:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--log", type=Path, help="the run's log, for its binding report")
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    print(f"ready after {ready(base, args.timeout):.1f} s")
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 16}  # fmt: skip
    req = urllib.request.Request(
        f"{base}/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.load(r)
    print(f"chat completion in {time.monotonic() - t0:.2f} s: {out['usage']}")
    if args.log is not None:
        lines = args.log.read_text(errors="replace").splitlines()
        print("the run's report:")
        print("\n".join(lines[:5]))


if __name__ == "__main__":
    main()
