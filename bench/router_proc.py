"""vllm-router (PyPI `vllm-router`, a Rust router) in front of replicas of our server: the
command line docs/design/router.md chooses, and a launcher for the tests and benchmarks.

The router reads nothing from a replica but `GET /health` (registration and a periodic
check: 2xx serving, anything else out of rotation) and, for its cache-aware policy, the
prompt's tokens (`POST /v1/chat/completions/render`, 404 here, then `POST /tokenize`).
Generation requests are forwarded with their fields (unknown ones kept; some of its own
added at their defaults) and, on 408/429/5xx or a connection error, sent again to the
replica its policy chooses then; the other routes (/v1/models, /tokenize, /v1/messages...)
are passed to one replica as they are.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from bench.server_proc import Server, free_port, start_process

# How the router treats a replica that drains (SIGTERM: /health 503, new requests 503,
# running ones finish, then the port closes) or restarts: a check a second, one failure
# takes it out and one success brings it back; a 503 or a refused connection is retried
# on another replica, with backoffs (100 ms x 1.5 per try, at most 1 s) that outlast
# the second before the check notices (a retry asks the policy again, and the policy
# keeps choosing the replica that holds the prompt's prefix until the check has taken it
# out). The circuit breaker (10 failures: out of rotation) counts a drain's 503s too; its
# default 60 s out would keep a restarted replica idle for a minute, so it gives the
# replica a new try after 5 s. The cache-aware policy's balance thresholds are
# in requests in flight: its default (64 more than the least loaded) suits engines that
# run hundreds at once; ours run tens, and a shared system prompt would otherwise send
# every new conversation to the replica that saw it first.
ROUTER_OPTIONS: tuple[str, ...] = (
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1",
    "--health-success-threshold", "1",
    "--health-check-timeout-secs", "5",
    "--worker-startup-check-interval", "1",
    "--retry-max-retries", "8",
    "--retry-initial-backoff-ms", "100",
    "--retry-max-backoff-ms", "1000",
    "--cb-timeout-duration-secs", "5",
    "--cache-threshold", "0.5",
    "--balance-abs-threshold", "2",
    "--balance-rel-threshold", "1.5",
)  # fmt: skip


def router_command(
    worker_urls: Sequence[str], port: int, metrics_port: int, policy: str = "cache_aware",
    extra: Sequence[str] = (),
) -> list[str]:  # fmt: skip
    """The router on loopback `port`, its own Prometheus metrics on `metrics_port`."""
    return [
        sys.executable, "-m", "vllm_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--policy", policy, *ROUTER_OPTIONS, *extra,
        "--worker-urls", *worker_urls,
    ]  # fmt: skip


def start_router(
    worker_urls: Sequence[str], log_path: Path, policy: str = "cache_aware",
    extra: Sequence[str] = (), ready_timeout_s: float = 120.0,
) -> Server:  # fmt: skip
    """Start the router and wait until its /readiness answers 200 (a replica is healthy;
    its /health is 503 while any replica is not)."""
    port = free_port()
    cmd = router_command(worker_urls, port, free_port(), policy, extra)
    return start_process(cmd, port, log_path, ready_timeout_s, ready_path="/readiness")
