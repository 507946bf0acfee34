"""What requests see: how many run and wait, what they were answered, their tokens, their
latencies (first token, between tokens, queue, end to end, the longest gap) and how they
finished."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from api.server.metrics.families import ITL, LATENCY, ByLane
from scheduler.stats import StepStats


class RequestMetrics:
    def __init__(self, r: CollectorRegistry, lane_gauge: ByLane, lane_counter: ByLane) -> None:
        self.running = lane_gauge("onegpu_requests_running", "Requests holding a sequence now")
        self.waiting = lane_gauge("onegpu_requests_waiting", "Requests queued for a sequence")
        self.http_responses = Counter(
            "onegpu_http_responses", "HTTP responses by route and status code",
            ["route", "code"], registry=r,
        )  # fmt: skip
        self.lane_requests = lane_counter(
            "onegpu_lane_requests", "Requests accepted, by numerics lane"
        )
        self.prompt_tokens = Counter(
            "onegpu_prompt_tokens",
            "Prompt tokens of requests that got their first token (cached ones included)",
            registry=r,
        )
        self.generated_tokens = Counter("onegpu_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "onegpu_requests_finished",
            "Finished requests by reason (stop, length, abort, error)",
            ["finish_reason"],
            registry=r,
        )
        self.kv_wait = Histogram(
            "onegpu_request_kv_wait_seconds",
            "Per finished request, the time it waited in the queue while KV kept it out",
            buckets=LATENCY, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "onegpu_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "onegpu_inter_token_latency_seconds", "Gap between a request's successive tokens",
            buckets=ITL, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "onegpu_e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY,
            registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "onegpu_request_queue_time_seconds", "Arrival to first scheduled", buckets=LATENCY,
            registry=r,
        )  # fmt: skip
        self.max_gap = Histogram(
            "onegpu_request_max_token_gap_seconds",
            "Per finished request, its longest gap between two tokens: the stall it saw",
            buckets=LATENCY, registry=r,
        )  # fmt: skip

    def observe(self, s: StepStats) -> None:
        self.running.labels(lane=s.lane).set(s.num_running)
        self.waiting.labels(lane=s.lane).set(s.num_waiting)
        if s.num_prompt_tokens:
            self.prompt_tokens.inc(s.num_prompt_tokens)
        if s.num_generated_tokens:
            self.generated_tokens.inc(s.num_generated_tokens)
        for v in s.ttft_s:
            self.ttft.observe(v)
        for v in s.itl_s:
            self.itl.observe(v)
        for v in s.queue_s:
            self.queue.observe(v)
        for f in s.finished:
            self.finished.labels(finish_reason=f.finish_reason).inc()
            self.e2e.observe(f.e2e_s)
            self.kv_wait.observe(f.kv_wait_s)
            if f.max_gap_s is not None:
                self.max_gap.observe(f.max_gap_s)
