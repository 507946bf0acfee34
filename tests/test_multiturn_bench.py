"""bench/multiturn.py's pure parts: the text both servers get, the pool it sizes, the
statistics and the tables it prints, on hand-built records (no server)."""

from __future__ import annotations

import math
import random

import pytest

from bench.multiturn import (
    COUNTERS,
    Probe,
    Rec,
    Run,
    Trial,
    counter_deltas,
    hit_rate,
    parse_args,
    pct,
    report,
    table,
    text,
    turn_stats,
    uncached_tokens,
)


def test_pct_interpolates_between_order_statistics() -> None:
    assert pct([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert pct([1.0, 2.0, 3.0, 4.0], 0.99) == pytest.approx(3.97)
    assert pct([7.0], 0.99) == 7.0
    assert math.isnan(pct([], 0.5))


def test_text_is_seeded_and_about_the_asked_length() -> None:
    a, b = text(random.Random(1), 1000), text(random.Random(1), 1000)
    assert a == b
    assert a != text(random.Random(2), 1000)
    assert 800 <= len(a.split()) * 1.15 <= 1200  # words x the tokens-per-word estimate
    assert a[0].isupper() and a[-1] in ".?!"


def _rec(turn: int, prompt: int, cached: int, ttft: float, error: str | None = None) -> Rec:
    return Rec(0, turn, 0.0, ttft, 1.0, prompt, 8, cached, error)


RECORDS = [
    _rec(1, 300, 0, 0.5),
    _rec(1, 300, 0, 0.7),
    _rec(2, 400, 300, 0.2),
    _rec(2, 410, 0, 0.6),
    _rec(3, 500, 400, 0.1),
    _rec(2, 0, 0, 0.0, error="APIConnectionError: refused"),
]


def test_turn_stats_leave_failed_requests_out_of_the_figures() -> None:
    first = turn_stats(RECORDS, 1)
    assert (first.requests, first.failed, first.prompt_tokens) == (2, 0, 300)
    assert first.ttft_p50 == pytest.approx(0.6)
    second = turn_stats(RECORDS, 2)
    assert (second.requests, second.failed, second.cached_tokens) == (3, 1, 150)
    later = turn_stats(RECORDS, 0)  # turns >= 2
    assert (later.requests, later.failed) == (4, 1)
    assert later.ttft_p50 == pytest.approx(0.2)
    assert turn_stats(RECORDS).requests == len(RECORDS)
    assert math.isnan(turn_stats(RECORDS, 9).ttft_p50)


def test_hit_rate_and_uncached_tokens_count_answered_requests_only() -> None:
    assert hit_rate(RECORDS) == pytest.approx(700 / 1910)
    assert uncached_tokens(RECORDS) == 100  # of 100, 410, 100 (turns >= 2, answered)
    assert uncached_tokens([RECORDS[2], RECORDS[3], RECORDS[5]]) == 255  # not the failed 0
    assert math.isnan(uncached_tokens(RECORDS[:2]))


def test_counter_deltas_sum_labels_and_skip_absent_counters() -> None:
    pre = "onegpu_preemptions_total"
    before = {(pre, (("kind", "swap"),)): 1.0, ("onegpu_prefill_tokens_total", ()): 100.0}
    after = {
        (pre, (("kind", "swap"),)): 3.0,
        (pre, (("kind", "recompute"),)): 1.0,  # new series: counts from 0
        ("onegpu_prefill_tokens_total", ()): 160.0,
        ("onegpu_ttft_seconds_count", ()): 9.0,  # not one of COUNTERS
    }
    got = counter_deltas(before, after)
    assert got == {pre: 3.0, "onegpu_prefill_tokens_total": 60.0}
    assert set(got) <= set(COUNTERS)


def test_default_pool_holds_every_chat_history_or_the_burst() -> None:
    chat = parse_args(["--scenario", "chat", "--users", "8", "--turns", "6"])
    assert chat.n_ctx % 1024 == 0
    assert chat.n_ctx >= 1.2 * 8 * (1500 + 6 * (120 + 48))
    burst = parse_args(["--scenario", "burst", "--burst", "32", "--burst-prefix-tokens", "4096"])
    assert 4096 + 32 * (40 + 48) <= burst.n_ctx < 32 * 4096  # one shared copy of the prefix
    both = parse_args([])
    assert both.n_ctx == max(chat.n_ctx, burst.n_ctx)
    assert parse_args(["--n-ctx", "5000"]).n_ctx == 5000
    assert both.cache_seqs == 0 and parse_args(["--cache-seqs", "8"]).cache_seqs == 8


def test_table_aligns_labels_left_and_figures_right() -> None:
    lines = table(["a", "b", "c"], [["x", "y", "1"]], left=2)
    assert lines == ["| a | b | c |", "|---|---|---:|", "| x | y | 1 |"]


def _trial(ttfts: list[float], cached: int, wall_s: float, probe_s: float) -> Trial:
    chat = [_rec(1 + i % 2, 400, cached if i % 2 else 0, t) for i, t in enumerate(ttfts)]
    burst = [_rec(1, 500, 0, t) for t in ttfts]
    runs = {"chat": Run(wall_s, chat), "burst": Run(wall_s, burst)}
    return Trial(runs, Probe(100, 101, [probe_s] * 3), [])


def test_report_gives_per_turn_rows_and_the_ratios() -> None:
    args = parse_args(["--turns", "2", "--osl", "8"])
    ours = _trial([0.4, 0.1, 0.4, 0.1], cached=300, wall_s=2.0, probe_s=0.1)
    theirs = _trial([0.4, 0.4, 0.4, 0.4], cached=0, wall_s=4.0, probe_s=0.2)
    out = "\n".join(report({"ours": [ours], "llama-server": [theirs]}, args))
    assert "| ours | 1 | 2 (0) | 400 | 0 | 400 | 400 |" in out
    assert "|  | 2 | 2 (0) | 400 | 300 | 100 | 100 |" in out
    # chat: TTFT p50 of all requests 0.25 vs 0.4; turns >= 2 0.1 vs 0.4; tok/s 16 vs 8
    assert "| chat | 0.62 | 0.25 | 2.00 |" in out
    assert (
        "| chat | ours | 4 (0) | 2.0 | 16.0 | 37.5% | 250 | 400 | 100 | 100 (101) | 1.00 |" in out
    )
    assert "our /metrics has none of the prefix-cache counters" in out
