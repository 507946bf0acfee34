"""An independent streaming client, as a new user would measure the long-prompt stall:
4 users stream chat completions; once all of them stream, an ~8K-token chat prompt
arrives. Reports the long prompt's TTFT (to its first content token) and the decoders'
longest gap between tokens around its prefill. Only the official `openai` client.

    python -m bench.stall_client --url http://127.0.0.1:PORT/v1 [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import threading
import time

from openai import AsyncOpenAI, OpenAI

WORDS = tuple(
    [
        "the",
        "river",
        "city",
        "market",
        "winter",
        "light",
        "stone",
        "garden",
        "letter",
        "window",
        "morning",
        "voice",
        "road",
        "story",
        "table",
        "music",
        "paper",
        "forest",
        "engine",
        "island",
        "bridge",
        "silver",
        "summer",
        "harbor",
        "mountain",
        "teacher",
        "village",
        "station",
        "evening",
        "coffee",
        "train",
        "field",
        "cloud",
        "history",
        "painter",
        "doctor",
        "machine",
        "kitchen",
        "ocean",
        "camera",
        "lantern",
        "orchard",
        "museum",
        "festival",
        "library",
        "valley",
        "quietly",
        "slowly",
        "carefully",
        "often",
        "never",
        "always",
        "because",
        "although",
        "while",
        "after",
        "before",
        "walked",
        "carried",
        "opened",
        "remembered",
        "listened",
        "answered",
        "followed",
        "returned",
        "painted",
        "built",
    ]
)


def long_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    sents: list[str] = []
    while sum(len(s.split()) for s in sents) < n_words:
        k = rng.randint(8, 18)
        s = " ".join(rng.choice(WORDS) for _ in range(k))
        sents.append(s[0].upper() + s[1:] + ".")
    return " ".join(sents)


def first_token(url: str, model: str, text: str, out: dict[str, float]) -> None:
    """The long prompt, in its own thread and client (a second user)."""
    c = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)
    t0 = time.monotonic()
    out["t_send"] = t0
    stream = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text + "\n\nSummarize the text above."}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    for ch in stream:
        if ch.choices and ch.choices[0].delta and ch.choices[0].delta.content:
            out.setdefault("t_first", time.monotonic())
        if ch.usage:
            out["prompt_tokens"] = ch.usage.prompt_tokens


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--words", type=int, default=7540)  # ~8,180 Gemma tokens
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    a = p.parse_args()
    ac = AsyncOpenAI(base_url=a.url, api_key="none", max_retries=0, timeout=3600)
    model = (await ac.models.list()).data[0].id
    stamps: list[list[float]] = [[] for _ in range(a.users)]
    empties = [0] * a.users  # chunks without text (a user sees nothing new)
    done = asyncio.Event()

    async def user(i: int) -> None:
        stream = await ac.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Tell me a long story about {WORDS[i]}s."}],
            max_tokens=1024,
            stream=True,
            extra_body={"ignore_eos": True},  # keep streaming through the measurement
        )
        async for ch in stream:
            if ch.choices and ch.choices[0].delta and ch.choices[0].delta.content:
                stamps[i].append(time.monotonic())
            elif ch.choices:
                empties[i] += 1
            if done.is_set():
                break
        await stream.close()

    tasks = [asyncio.create_task(user(i)) for i in range(a.users)]
    while not all(len(s) >= 3 for s in stamps):
        await asyncio.sleep(0.05)
        for t in tasks:
            if t.done():
                t.result()
    await asyncio.sleep(a.warmup_s)
    res: dict[str, float] = {}
    text = long_text(a.words, a.seed)
    th = threading.Thread(target=first_token, args=(a.url, model, text, res))
    th.start()
    while th.is_alive():
        await asyncio.sleep(0.05)
    done.set()
    await asyncio.gather(*tasks)
    await ac.close()
    t_send, t_first = res["t_send"], res["t_first"]
    gaps = []
    for s in stamps:
        gaps += [b - a for a, b in itertools.pairwise(s) if b >= t_send and a <= t_first]
    out = {
        "model": model,
        "prompt_tokens": res.get("prompt_tokens"),
        "ttft_s": t_first - t_send,
        "longest_gap_s": max(gaps) if gaps else None,
        "median_gap_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
        "empty_chunks": empties,
        "decoder_tokens_in_window": sum(sum(t_send <= t <= t_first for t in s) for s in stamps),
    }
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    asyncio.run(main())
