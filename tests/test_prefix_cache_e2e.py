"""The prefix cache through the whole server: a real llama.cpp backend, real HTTP, the
official `openai` client in strict response validation, metrics read from /metrics."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from bench.server_proc import Server, start_server
from tests.tiny_gguf import Shape, write_llama

pytestmark = pytest.mark.e2e
GEMMA = "gemma-3-270m"


def _client(server: Server) -> OpenAI:
    return OpenAI(
        base_url=server.base_url, api_key="none", _strict_response_validation=True,
        max_retries=0, timeout=300,
    )  # fmt: skip


def _metric(server: Server, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no {name}")


def _prefilled(server: Server) -> float:
    return _metric(server, "onegpu_prefill_tokens_total")


def _complete(server: Server, prompt: list[int] | str, max_tokens: int, **kw: object) -> object:
    with _client(server) as c:
        return c.completions.create(
            model=kw.pop("model", "tiny"), prompt=prompt, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True, **kw},  # type: ignore[arg-type]
        )  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = Shape(n_layer=4, n_embd=256, n_head=8, n_head_kv=4, head_dim=32, n_ff=512)
    return write_llama(tmp_path_factory.mktemp("prefix") / "tiny.gguf", seed=5, wtype="f16",
                       shape=shape)  # fmt: skip


def _serve(model: Path | None, *extra: str) -> Server:
    where = Path(model).parent if model else Path("/tmp")
    args = ["--model", str(model), "--served-model-name", "tiny"] if model else []
    return start_server(
        [*args, "--n-ctx", "8192", "--n-seq-max", "8", *extra],
        where / f"server-prefix{'-'.join(extra)}.log",
    )


@pytest.fixture(scope="module")
def cached(tiny: Path) -> Iterator[Server]:
    srv = _serve(tiny)
    yield srv
    srv.stop()


def test_a_shared_prefix_is_read_and_the_output_is_what_it_is_without_cache(
    tiny: Path, cached: Server
) -> None:
    """A second request with the same 2,000-token start reads it from the cache: usage
    reports it, /metrics shows only the rest prefilled, and its greedy tokens are those it
    gets alone on a server without the cache.

    Why the same tokens: on a fresh server each request's prompt goes in the same step
    shapes into the same cells (the first request's here, the second's own there), and a
    token's K and V depend only on the tokens before it — the rest of the step does not
    enter its row of any matmul. So the cells read from the cache hold exactly what the
    second request would compute; only the attention over its own last tokens groups
    cells differently (the first request's tail sits between), a rounding-level difference
    far below the gap between a greedy choice and the next."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, 250) for _ in range(2000)]
    first = [*prefix, *(rng.randrange(3, 250) for _ in range(40))]
    second = [*prefix, *(rng.randrange(3, 250) for _ in range(40))]
    plain = _serve(tiny, "--no-prefix-cache")
    try:
        want = _complete(plain, second, 24)
    finally:
        plain.stop()
    a = _complete(cached, first, 8)
    assert a.usage is not None and a.usage.prompt_tokens_details is not None  # type: ignore[attr-defined]
    before = _prefilled(cached)
    b = _complete(cached, second, 24)
    after = _prefilled(cached)
    usage = b.usage  # type: ignore[attr-defined]
    assert usage.prompt_tokens == len(second)
    assert usage.prompt_tokens_details.cached_tokens >= 2000
    assert after - before == len(second) - usage.prompt_tokens_details.cached_tokens
    assert b.choices[0].text == want.choices[0].text  # type: ignore[attr-defined]


def test_n_choices_prefill_their_prompt_once(cached: Server) -> None:
    """`n`=4 choices share one prompt's KV: it is computed once, and each choice computes
    only its last token (whose logits are its own)."""
    rng = random.Random(8)
    prompt = [rng.randrange(3, 250) for _ in range(600)]
    before = _prefilled(cached)
    r = _complete(cached, prompt, 6, n=4)
    after = _prefilled(cached)
    assert after - before == len(prompt) + 3
    texts = [c.text for c in r.choices]  # type: ignore[attr-defined]
    assert len(texts) == 4 and len(set(texts)) == 1  # greedy: the same tokens each
    assert r.usage.prompt_tokens_details.cached_tokens == 3 * (len(prompt) - 1)  # type: ignore[attr-defined]


def test_cache_prompt_false_computes_the_whole_prompt(cached: Server) -> None:
    rng = random.Random(9)
    prompt = [rng.randrange(3, 250) for _ in range(300)]
    _complete(cached, prompt, 4)
    before = _prefilled(cached)
    r = _complete(cached, prompt, 4, cache_prompt=False)
    assert _prefilled(cached) - before == len(prompt)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[attr-defined]


COUNT = ", ".join(str(i) for i in range(1, 301))  # ~1,200 Gemma tokens, easy to continue


def test_a_sliding_window_model_never_reads_a_pruned_prefix() -> None:
    """Gemma 3's window layers let llama.cpp overwrite a cell one sequence owns once it lies
    512 positions behind that sequence's end. After a conversation is cached, other
    requests cycle through the whole pool (so new cells land on the cached conversation's
    old ones); then a prompt that shares only the start of that conversation must compute
    it (its window there may be gone), while the conversation's next turn reads it. Both
    give the tokens a server without the cache gives."""
    fillers = [f"Item {k}: " + " ".join(["the sea is wide and deep"] * 150) for k in range(4)]
    turn = f"Count: {COUNT},"
    branch = f"Count: {', '.join(str(i) for i in range(1, 201))}, then letters: a, b, c, d,"
    srv = _serve(None, "--n-ctx", "4096")
    try:
        a = _complete(srv, turn, 12, model=GEMMA)
        next_turn = turn + a.choices[0].text + " and then"  # type: ignore[attr-defined]
        for text in fillers:  # ~900 tokens each: the pool's head wraps onto the old cells
            _complete(srv, text, 4, model=GEMMA, cache_prompt=False)  # (and evicts nothing)
        b = _complete(srv, branch, 12, model=GEMMA)
        d = _complete(srv, next_turn, 12, model=GEMMA)
    finally:
        srv.stop()
    assert b.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[attr-defined]
    assert d.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens - 1  # type: ignore[attr-defined]
    plain = _serve(None, "--n-ctx", "4096", "--no-prefix-cache")
    try:
        for got, prompt in ((b, branch), (d, next_turn)):
            want = _complete(plain, prompt, 12, model=GEMMA)
            assert got.choices[0].text == want.choices[0].text  # type: ignore[attr-defined]
    finally:
        plain.stop()


def test_a_sliding_window_model_computes_a_burst_s_shared_start_once() -> None:
    """Four requests arrive together behind one long shared start (~1,200 Gemma tokens)
    and part only in their last words. Under Gemma's window a read must end where the
    window before it is intact, which the end of the first request's prompt is not for the
    others: the first offers the shared start to the cache as soon as it has computed it
    (its chunks are small here, so the others arrive while it computes), and the others
    read it and compute only their own endings."""
    prompts = [f"Count: {COUNT}, and one question {k}: what is {k} times {k}?" for k in range(4)]
    srv = _serve(None, "--n-ctx", "8192", "--max-num-batched-tokens", "256")
    try:
        before = _prefilled(srv)
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: _complete(srv, p, 4, model=GEMMA), prompts))
        after = _prefilled(srv)
    finally:
        srv.stop()
    usage = [r.usage for r in got]  # type: ignore[attr-defined]
    cached = sorted(u.prompt_tokens_details.cached_tokens for u in usage)
    assert cached[0] == 0 and cached[1] >= 1_100  # all but the first read the shared start
    assert after - before == sum(u.prompt_tokens for u in usage) - sum(cached)
    assert after - before < max(u.prompt_tokens for u in usage) + 3 * 100


def test_a_sliding_window_model_reads_a_system_prompt_an_earlier_chat_left() -> None:
    """Two chats one after the other with the same system prompt and different questions:
    under Gemma's window a read must end at a point offered, and the end of the first
    prompt is none for the second; the first offers its system block's end on the way, so
    the second reads the system prompt and computes only its question."""
    system = {"role": "system", "content": f"Count with me: {COUNT}."}
    srv = _serve(None, "--n-ctx", "8192")
    try:
        with _client(srv) as c:

            def ask(question: str) -> object:
                return c.chat.completions.create(
                    model=GEMMA, max_tokens=4, temperature=0,
                    messages=[system, {"role": "user", "content": question}],  # type: ignore[list-item]
                )  # fmt: skip

            first = ask("What comes after the last number?")
            second = ask("Which number is the largest?")
    finally:
        srv.stop()
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[attr-defined]
    got = second.usage  # type: ignore[attr-defined]
    assert got.prompt_tokens_details.cached_tokens >= got.prompt_tokens - 20 > 1_000


def test_the_reproducible_lane_computes_every_prompt_itself() -> None:
    """The reproducible lane keeps no cache: its KV is one private stream per request (what
    makes it reproducible), and llama.cpp shares cells only within a stream (across
    streams `seq_cp` copies a whole stream). A repeated prompt is computed again, and its
    output is the same to the bit."""
    srv = _serve(None)
    try:
        with _client(srv) as c:
            got = [
                c.completions.create(
                    model=GEMMA, prompt=f"Count: {COUNT[:400]},", max_tokens=8,
                    temperature=0, logprobs=2, extra_body={"strata_reproducible": "required"},
                )
                for _ in range(2)
            ]  # fmt: skip
    finally:
        srv.stop()
    assert [g.usage.prompt_tokens_details.cached_tokens for g in got] == [0, 0]  # type: ignore[union-attr]
    assert got[0].choices[0].text == got[1].choices[0].text
    assert got[0].choices[0].logprobs == got[1].choices[0].logprobs
