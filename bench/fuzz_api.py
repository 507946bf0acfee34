"""Fuzz the HTTP API from the server's own OpenAPI document (schemathesis).

Starts a small server, loads its `/openapi.json`, and lets schemathesis send every operation
valid and invalid inputs (its examples, coverage and fuzzing phases; positive and negative
generation). Checks: no 5xx; every response with status >= 400 is exactly an OpenAI error
body served as JSON — what the `openai` SDK needs to raise a typed error with the server's
message — or, on Anthropic's routes (/v1/messages…), exactly Anthropic's envelope; and (by
default, `--extra-checks`) every documented response, SSE frames included, matches the
document. Prints the statuses seen per operation and each distinct failure with the
request that triggers it; exits 1 if there was one.

The request bodies are steered towards what this server can serve (`model` is the served
model's name, `role` one the chat template knows) so that most valid cases reach the
engine rather than stopping at a 404; negative generation still breaks those fields.

    python -m bench.fuzz_api [--max-examples 200] [--seed N] [--server-args "..."] [--url URL]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from schemathesis.engine import events
from schemathesis.engine import from_schema as engine_for
from schemathesis.engine.recorder import CheckFailureInfo

from bench.server_proc import Server, start_server

log = logging.getLogger(__name__)

# Small enough that the worst valid request (n=16, no max_tokens) generates ~1k tokens.
SERVER_ARGS = (
    "--max-model-len", "64", "--n-ctx", "2048", "--n-seq-max", "8",
    "--repro-slots", "1", "--repro-ctx", "128", "--repro-chunk", "64",
)  # fmt: skip
ERROR_KEYS = frozenset({"message", "type", "param", "code"})
CHAT_ROLES = ("system", "user", "assistant")
LANES = ("required", "off")
PHASES = ("examples", "coverage", "fuzzing")
EXTRA_CHECKS = ("response_schema_conformance",)


def error_body_problems(body: object) -> list[str]:
    """What keeps `body` from being exactly `{"error": {"message", "type", "param", "code"}}`
    with a non-empty message and type (empty: it is one)."""
    if not isinstance(body, dict) or set(body) != {"error"}:
        return [f"body is not an object with exactly the key `error`: {body!r:.200}"]
    err = body["error"]
    if not isinstance(err, dict):
        return [f"`error` is not an object: {err!r:.200}"]
    problems = []
    if set(err) != ERROR_KEYS:
        problems.append(f"`error` keys are {sorted(err)}, not {sorted(ERROR_KEYS)}")
    for key in ("message", "type"):
        if not isinstance(err.get(key), str) or not err.get(key):
            problems.append(f"`error.{key}` is not a non-empty string: {err.get(key)!r}")
    for key in ("param", "code"):
        if key in err and err[key] is not None and not isinstance(err[key], str):
            problems.append(f"`error.{key}` is neither a string nor null: {err[key]!r}")
    return problems


def anthropic_error_body_problems(body: object) -> list[str]:
    """What keeps `body` from being exactly `{"type": "error", "error": {"type",
    "message"}}` with a non-empty type and message (empty: it is one)."""
    if not isinstance(body, dict) or set(body) != {"type", "error"} or body["type"] != "error":
        return [f"body is not an object of `type` error and an `error`: {body!r:.200}"]
    err = body["error"]
    if not isinstance(err, dict) or set(err) != {"type", "message"}:
        return [f"`error` is not an object of exactly `type` and `message`: {err!r:.200}"]
    return [
        f"`error.{key}` is not a non-empty string: {err[key]!r}"
        for key in ("type", "message")
        if not isinstance(err[key], str) or not err[key]
    ]


def openai_error_body(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case[Any]
) -> bool | None:
    """A schemathesis check: every status >= 400 carries an OpenAI error body as JSON
    (Anthropic's envelope on its routes)."""
    if response.status_code < 400:
        return None
    ctype = ",".join(response.headers.get("content-type", []))
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise AssertionError(
            f"status {response.status_code} with content type {ctype!r}, not application/json"
        )
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(
            f"status {response.status_code} with a body that is not JSON: {response.content!r:.200}"
        ) from None
    anthropic = case.path.startswith("/v1/messages")
    problems = (anthropic_error_body_problems if anthropic else error_body_problems)(body)
    if problems:
        raise AssertionError(f"status {response.status_code}: " + "; ".join(problems))
    return None


def _refs(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            yield ref.rsplit("/", 1)[1]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _request_components(doc: dict[str, Any]) -> set[str]:
    """Every component a request body reaches through `$ref`s."""
    schemas: dict[str, Any] = doc["components"]["schemas"]
    todo = [
        name
        for item in doc["paths"].values()
        for op in item.values()
        for name in _refs(op.get("requestBody", {}))
    ]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen and name in schemas:
            seen.add(name)
            todo.extend(_refs(schemas[name]))
    return seen


def steer(doc: dict[str, Any], model: str, *, max_tokens: int | None = None) -> dict[str, Any]:
    """A copy of `doc` whose request bodies name the served model, a chat role and a lane
    the server knows, so valid cases get past the 404 and reach generation. With
    `max_tokens`, valid bodies also ask for at most that many tokens (the field becomes
    required): each valid case then costs a few decode steps, not a whole context, which
    keeps a bounded run short; negative cases still leave it out or exceed it. Fields not
    in the document are left alone (the document follows the wire types as they change)."""
    out = copy.deepcopy(doc)
    narrow: dict[str, dict[str, Any]] = {
        "model": {"type": "string", "enum": [model]},
        "role": {"type": "string", "enum": list(CHAT_ROLES)},
        "strata_reproducible": {"anyOf": [{"type": "string", "enum": list(LANES)},
                                          {"type": "null"}]},
    }  # fmt: skip
    if max_tokens is not None:
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            narrow[key] = {"type": "integer", "minimum": 1, "maximum": max_tokens}
    schemas = out["components"]["schemas"]
    for name in _request_components(out):
        schema = schemas[name]
        props = schema.get("properties", {})
        for key, value in narrow.items():
            if key in props:
                props[key] = value
        limit = next((k for k in ("max_tokens", "max_output_tokens") if k in props), None)
        if max_tokens is not None and limit is not None and "model" in props:
            schema["required"] = sorted({*schema.get("required", []), limit})
    return out


def served_model(server_url: str, headers: dict[str, str] | None = None) -> str:
    r = httpx.get(server_url + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def fuzz_config(
    base_url: str | None,
    *,
    max_examples: int,
    seed: int | None = None,
    headers: dict[str, str] | None = None,
    phases: tuple[str, ...] = PHASES,
    workers: int = 1,
    extra_checks: tuple[str, ...] = (),
) -> schemathesis.Config:
    """Both generation modes (valid and invalid data), the given phases, no stateful
    phase (the API has no links), no example database left in the checkout, only the
    no-5xx built-in check (plus `openai_error_body`, registered by the caller). Without
    `base_url`, each call names its server."""
    data: dict[str, Any] = {
        "workers": workers,  # the engine's (bench): operations tested at once
        "continue-on-failure": True,  # the engine's: keep fuzzing an operation that failed
        # reproductions verbatim: the default hides every field whose name has "token" in it
        "output": {"sanitization": {"enabled": False}},
        "request-timeout": 120,
        "suppress-health-check": ["too_slow", "filter_too_much", "data_too_large"],
        "generation": {"mode": "all", "max-examples": max_examples, "database": "none"},
        "phases": {
            "stateful": {"enabled": False},
            **{p: {"enabled": p in phases} for p in PHASES},
        },
        "checks": {
            "enabled": False,
            "not_a_server_error": {"enabled": True},
            openai_error_body.__name__: {"enabled": True},
            **{name: {"enabled": True} for name in extra_checks},
        },
    }
    if base_url is not None:
        data["base-url"] = base_url
    if seed is not None:
        data["seed"] = seed
    if headers:
        data["headers"] = headers
    return schemathesis.Config.from_dict(data)


def load_schema(
    server_url: str,
    config: schemathesis.Config,
    headers: dict[str, str] | None = None,
    max_tokens: int | None = None,
) -> schemathesis.BaseSchema:
    """The server's own document, validated, steered (see `steer`), bound to `config`."""
    raw = schemathesis.openapi.from_url(server_url + "/openapi.json", config=config)
    raw.validate()
    doc = steer(raw.raw_schema, served_model(server_url, headers), max_tokens=max_tokens)
    return schemathesis.openapi.from_dict(doc, config=config)


# ---- the run ------------------------------------------------------------------------
@dataclass
class Finding:
    """One distinct failure: the first request and response that showed it."""

    operation: str
    check: str
    title: str
    message: str
    status: int | None
    response_body: str
    curl: str
    count: int = 1


@dataclass
class Summary:
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    seconds: defaultdict[tuple[str, int], float] = field(default_factory=lambda: defaultdict(float))
    # distinct by operation, check, status and the start of the message
    failures: dict[tuple[str, str, int | None, str], Finding] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    requests: int = 0

    def add(self, event: events.ScenarioFinished) -> None:
        rec = event.recorder
        for interaction in rec.interactions.values():
            self.requests += 1
            if interaction.response is not None:
                seen = (rec.label, interaction.response.status_code)
                self.statuses[seen] += 1
                self.seconds[seen] += interaction.response.elapsed
        for case_id, nodes in rec.checks.items():
            sent = rec.interactions.get(case_id)
            resp = None if sent is None else sent.response
            for node in nodes:
                if node.failure_info is not None:
                    self._failure(rec.label, node.name, node.failure_info, resp)

    def _failure(
        self, label: str, check: str, info: CheckFailureInfo, resp: schemathesis.Response | None
    ) -> None:
        status = None if resp is None else resp.status_code
        message = info.failure.message
        key = (label, check, status, message[:80])
        if key in self.failures:
            self.failures[key].count += 1
            return
        body = "" if resp is None else resp.content[:500].decode("utf-8", "replace")
        self.failures[key] = Finding(
            label, check, info.failure.title, message, status, body, info.code_sample
        )

    def report(self) -> str:
        lines = [f"{self.requests} requests", "", "| operation | status | responses | mean s |",
                 "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {op} | {st} | {n} | {self.seconds[(op, st)] / n:.3f} |"
                  for (op, st), n in sorted(self.statuses.items())]  # fmt: skip
        lines += ["", f"{len(self.failures)} distinct failures"]
        for f in self.failures.values():
            lines += [
                "",
                f"## {f.operation}: {f.check} ({f.title}), status {f.status}, seen {f.count}x",
                f.message,
                f"request:  {f.curl}",
                f"response: {f.response_body}",
            ]
        lines += [f"error: {e}" for e in self.errors]
        return "\n".join(lines)


def run(schema: schemathesis.BaseSchema) -> Summary:
    """Every phase of the engine over every operation; failures are collected, not raised."""
    summary = Summary()
    for event in engine_for(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            summary.add(event)
            log.info(
                "%s %s: %d requests (%d in all), %s",
                event.phase.value, event.label, len(event.recorder.interactions),
                summary.requests, event.status.value,
            )  # fmt: skip
        elif isinstance(event, events.NonFatalError):
            summary.errors.append(f"{event.label}: {event.info.format()}")
        elif isinstance(event, events.FatalError):
            summary.errors.append(f"fatal: {event.exception!r}")
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-examples", type=int, default=200, help="fuzzing cases per operation")
    p.add_argument("--seed", type=int, help="reproduce a run (default: random)")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated, of " + str(PHASES))
    p.add_argument("--server-args", default=" ".join(SERVER_ARGS),
                   help="`one-gpu serve` options, quoted (default: %(default)s)")  # fmt: skip
    p.add_argument("--workers", type=int, default=2, help="operations fuzzed at once")
    p.add_argument(
        "--extra-checks", default=",".join(EXTRA_CHECKS),
        help="comma-separated schemathesis checks beside the two always run (default: "
        "%(default)s); e.g. negative_data_rejection,status_code_conformance",
    )  # fmt: skip
    p.add_argument("--api-key", help="start the server with this key and send it")
    p.add_argument("--url", help="fuzz a running server instead of starting one")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    schemathesis.check(openai_error_body)  # enabled by name in fuzz_config
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    server: Server | None = None
    url = args.url
    if url is None:
        server_args = args.server_args.split()
        if args.api_key:
            server_args += ["--api-key", args.api_key]
        log_path = Path(tempfile.mkdtemp(prefix="fuzz-api-")) / "server.log"
        log.info("starting one-gpu serve %s (log %s)", " ".join(server_args), log_path)
        server = start_server(server_args, log_path)
        url = server.url
    try:
        phases = tuple(x for x in args.phases.split(",") if x)
        config = fuzz_config(
            url, max_examples=args.max_examples, seed=args.seed, headers=headers, phases=phases,
            workers=args.workers, extra_checks=tuple(x for x in args.extra_checks.split(",") if x),
        )  # fmt: skip
        schema = load_schema(url, config, headers)
        start = time.monotonic()
        summary = run(schema)
        print(f"seed {config.seed}, {time.monotonic() - start:.0f} s, phases {', '.join(phases)}")
        print(summary.report())
    finally:
        if server is not None:
            code = server.stop()
            log.info("server exited with %s; log %s", code, server.log_path)
    if summary.failures or summary.errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
