"""A long prompt that no step beside the decoders could carry within the stall target is
prefilled by the side context while they keep decoding, and answers as the same prompt
computed in place does: a real server (the embedded model, CPU) and the official client.

On the CPU no step is ever that expensive at the default target; a 1 ms target makes every
step with a prompt chunk "beyond reach", which is the case the side context exists for
(with routed experts in host RAM on a GPU, every prompt batch copies them all).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from openai import APITimeoutError, AsyncOpenAI
from openai.types import Completion

from bench.server_proc import Server, start_server
from tests.conftest import MODEL
from tests.test_api_e2e import arun, metrics, wait_for

pytestmark = pytest.mark.e2e

# ~1,900 tokens whose continuation the model is sure of: a KV moved wrong would lose it,
# and no near-tie flips it between batch shapes (a prose prompt's flat next-token
# distribution moved by 0.2-0.4 in logprob between one batch and two, in one context)
LONG = " ".join(str(i) for i in range(1, 500))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("side") / "server.log"
    srv = start_server(
        ["--n-ctx", "8192", "--n-seq-max", "4", "--max-stall-ms", "1",
         "--side-prefill-ctx", "4096", "--repro-slots", "0"],
        log,
    )  # fmt: skip
    yield srv
    srv.stop()


def first_logprob(r: Completion) -> float:
    """The first generated token's logprob."""
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs and lp.token_logprobs[0] is not None
    return lp.token_logprobs[0]


async def decode(c: AsyncOpenAI, decoding: asyncio.Event, done: asyncio.Event) -> list[float]:
    """A user streaming a long answer: the arrival time of each token, `decoding` set at
    its fourth (past a burst's first step), the stream closed once `done` is set."""
    times: list[float] = []
    stream = await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=3000, temperature=0, stream=True,
    )  # fmt: skip
    async for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            times.append(time.monotonic())
            if len(times) == 4:
                decoding.set()
            if done.is_set():
                await stream.close()
                break
    return times


def test_a_prompt_beyond_the_target_is_prefilled_aside_while_users_decode(server: Server) -> None:
    before = metrics(server)

    async def run(c: AsyncOpenAI) -> tuple[list[float], float, float, int, Completion]:
        decoding = asyncio.Event()
        long_done = asyncio.Event()
        task = asyncio.create_task(decode(c, decoding, long_done))
        await decoding.wait()
        t_sent = time.monotonic()
        r = await c.completions.create(
            model=MODEL, prompt=LONG, max_tokens=8, temperature=0, logprobs=5
        )
        t_done = time.monotonic()
        long_done.set()
        assert r.usage is not None
        return await task, t_sent, t_done, r.usage.prompt_tokens, r

    times, t_sent, t_done, n_prompt, aside = arun(server, run)
    after = metrics(server)
    side = after["onegpu_side_prefill_tokens_total"] - before["onegpu_side_prefill_tokens_total"]
    assert n_prompt > 1000 and side == n_prompt - 1, "all but its last token went aside"
    # no step carried a chunk of it: the decoder got its tokens one a step meanwhile
    steps = after["onegpu_step_prompt_tokens_count"] - before["onegpu_step_prompt_tokens_count"]
    assert steps <= 3  # (the decoder's own prompt, the moved prompt's last token)
    assert sum(t_sent < t < t_done for t in times) >= 5, "the decoder kept decoding"

    async def in_place(c: AsyncOpenAI) -> Completion:
        return await c.completions.create(
            model=MODEL, prompt=LONG, max_tokens=8, temperature=0, logprobs=5,
            extra_body={"cache_prompt": False},  # computed whole, alone: in place
        )  # fmt: skip

    # The moved KV continues the prompt as computing it in place does
    here = arun(server, in_place)
    assert aside.choices[0].text == here.choices[0].text and "500" in here.choices[0].text
    a, b = first_logprob(aside), first_logprob(here)
    assert abs(a - b) < 0.05 and a > -0.1, (a, b)
    final = metrics(server)
    assert final["onegpu_side_prefill_tokens_total"] == after["onegpu_side_prefill_tokens_total"]
    assert final["onegpu_swap_space_used_cells{lane=fast}"] == 0


def test_a_client_gone_while_its_prompt_is_aside_frees_it_and_the_side_serves_the_next(
    server: Server,
) -> None:
    """The client of a prompt being prefilled aside hangs up: its swap space is given
    back, the bytes that arrive later are dropped, the decoder is undisturbed and the side
    context takes the next such prompt."""
    before = metrics(server)

    async def run(c: AsyncOpenAI) -> tuple[int, int]:
        decoding = asyncio.Event()
        done = asyncio.Event()
        task = asyncio.create_task(decode(c, decoding, done))
        await decoding.wait()
        impatient = c.with_options(timeout=0.5)  # gone while its prompt is aside
        with pytest.raises(APITimeoutError):
            await impatient.completions.create(model=MODEL, prompt=LONG, max_tokens=8)
        r = await c.completions.create(model=MODEL, prompt=LONG, max_tokens=8, temperature=0)
        done.set()
        assert r.usage is not None and r.choices[0].finish_reason == "length"
        return len(await task), r.usage.prompt_tokens

    n_decoded, n_prompt = arun(server, run)
    assert n_decoded > 8
    assert wait_for(lambda: metrics(server)["onegpu_swap_space_used_cells{lane=fast}"] == 0)
    after = metrics(server)
    aside = after["onegpu_side_prefill_tokens_total"] - before["onegpu_side_prefill_tokens_total"]
    assert aside == n_prompt - 1  # the second prompt's (the first one's never came back)
