"""Load: 64 concurrent streaming clients (the async Anthropic and OpenAI SDKs) for 60 s on loopback.
Every request either completes with exactly the reply its own prompt gets alone (nothing lost,
nothing mixed up between streams) or gets the API's overload error; the server's memory stays flat.

ZLC_LOAD_SECONDS shortens the run for local iteration (CI runs the full 60 s)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

MODEL = "llama-chat"
CLIENTS = 64
MAX_TOKENS = 6
PROMPTS = [f"prompt {i}: tell me about {w}" for i, w in enumerate(
    ["rings", "kernels", "caches", "sockets", "frames", "tokens", "queues", "fences", "llamas", "latency",
     "memory", "threads", "events", "bytes", "graphs", "tiles"])]


@pytest.mark.slow
def test_64_streaming_clients_for_60_s(start_server: Any, chat_bundle: Path) -> None:
    import zlc

    seconds = float(os.environ.get("ZLC_LOAD_SECONDS", "60"))
    b = zlc.load(chat_bundle)
    tok = b.tokenizer
    expected = {p: tok.decode(b.generate(tok.encode_chat(p), MAX_TOKENS, device="reference", eos=b.eos_token_ids))
                for p in PROMPTS}
    server = start_server("--device", "reference", "--max-queue", "16")
    stats = {"ok": 0, "overloaded": 0, "wrong": 0, "other": 0}
    problems: list[str] = []
    rss: list[tuple[float, int]] = []

    async def anthropic_client(i: int, deadline: float) -> None:
        a = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="k", max_retries=0, timeout=120)
        n = 0
        while time.monotonic() < deadline:
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            n += 1
            try:
                async with a.messages.stream(model=MODEL, max_tokens=MAX_TOKENS,
                                             messages=[{"role": "user", "content": prompt}]) as s:
                    text = "".join([t async for t in s.text_stream])
                check(prompt, text)
            except anthropic.APIStatusError as e:
                count_error(e.status_code, 529, str(e))
                await asyncio.sleep(0.2)  # what a client does on overload: back off
        await a.close()

    async def openai_client(i: int, deadline: float) -> None:
        o = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0, timeout=120)
        n = 0
        while time.monotonic() < deadline:
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            n += 1
            try:
                stream = await o.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
                                                         stream=True,
                                                         messages=[{"role": "user", "content": prompt}])
                text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                check(prompt, text)
            except openai.APIStatusError as e:
                count_error(e.status_code, 429, str(e))
                await asyncio.sleep(0.2)
        await o.close()

    def check(prompt: str, text: str) -> None:
        if text == expected[prompt]:
            stats["ok"] += 1
        else:
            stats["wrong"] += 1
            problems.append(f"{prompt!r}: got {text!r}, expected {expected[prompt]!r}")

    def count_error(status: int, overload: int, msg: str) -> None:
        if status == overload:
            stats["overloaded"] += 1
        else:
            stats["other"] += 1
            problems.append(f"HTTP {status}: {msg}")

    async def sample_memory(deadline: float) -> None:
        while time.monotonic() < deadline:
            rss.append((time.monotonic(), server.rss_kib()))
            await asyncio.sleep(1.0)

    async def main() -> None:
        deadline = time.monotonic() + seconds
        tasks = [anthropic_client(i, deadline) if i % 2 == 0 else openai_client(i, deadline) for i in range(CLIENTS)]
        await asyncio.gather(sample_memory(deadline), *tasks)

    asyncio.run(main())
    assert not problems, problems[:5]
    assert stats["ok"] >= seconds / 2, stats  # the server kept making progress under overload
    assert stats["wrong"] == 0 and stats["other"] == 0, stats
    # flat memory: after the first 10 s of warm-up (allocator pools, SDK connections), RSS grows < 16 MiB
    warm = [kib for t, kib in rss if t >= rss[0][0] + min(10.0, seconds / 3)]
    assert warm and max(warm) - warm[0] < 16 * 1024, (stats, warm[0], max(warm))
    print(f"load: {stats}, ingress RSS {warm[0] / 1024:.1f} -> {max(warm) / 1024:.1f} MiB")
