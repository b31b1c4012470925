"""Clients for the fault tests, each one request on its own thread through the official Anthropic or
OpenAI SDK (or a TCP frame connection), recording how it ended:

- "ok": the whole reply (a stop reason / finish reason / LAST frame);
- "error": the API's error: an error status, an error event in the stream, an ERROR frame;
- "lost": anything else: a stream that stops without either, a connection closed without an
  answer, no answer within the (generous) timeout. The fault tests require none.

``Tally`` turns a list of them into the figures of docs/serving.md's fault table.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai

from zlc.runtime.serve.ingress import frames

MODEL = "llama-chat"
TIMEOUT_S = 60.0


class Client(threading.Thread):
    """One request; ``first`` is set when its first token arrives."""

    def __init__(self, name: str, body: Callable[[Client], None]):
        super().__init__(name=name, daemon=True)
        self.body = body
        self.first = threading.Event()
        self.kind = "lost"
        self.detail = "did not finish"
        self.t_end = float("inf")
        self.error_body: Any = None

    def run(self) -> None:
        try:
            self.body(self)
        except (anthropic.APIStatusError, openai.APIStatusError) as e:
            self.kind, self.detail, self.error_body = "error", f"HTTP {e.status_code}: {e.message}", e.body
        except (anthropic.APIConnectionError, openai.APIConnectionError) as e:
            self.kind, self.detail = "lost", f"connection: {e!r} ({e.__cause__!r})"
        except openai.APIError as e:  # an error data line in a stream
            self.kind, self.detail, self.error_body = "error", f"stream error: {e.message}", e.body
        except Exception as e:  # noqa: BLE001 - anything else is a way to lose a request
            self.kind, self.detail = "lost", f"{type(e).__name__}: {e}"
        self.t_end = time.monotonic()

    def done(self, detail: str) -> None:
        self.kind, self.detail = "ok", detail


# The SDK clients are made before the threads start (that takes a while), so that the requests
# reach the server together.


def anthropic_stream(base_url: str, max_tokens: int, prompt: str = "hi", key: str = "k") -> Client:
    a = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=TIMEOUT_S)

    def body(c: Client) -> None:
        with a.messages.stream(model=MODEL, max_tokens=max_tokens,
                               messages=[{"role": "user", "content": prompt}]) as s:
            for _ in s.text_stream:
                c.first.set()
            final = s.get_final_message()
        if final.stop_reason is None:
            raise RuntimeError("the stream ended without a stop reason")
        c.done(f"stop_reason {final.stop_reason}, {final.usage.output_tokens} tokens")

    return Client("anthropic stream", body)


def anthropic_message(base_url: str, max_tokens: int, prompt: str = "hi", key: str = "k") -> Client:
    a = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0, timeout=TIMEOUT_S)

    def body(c: Client) -> None:
        m = a.messages.create(model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}])
        c.first.set()
        c.done(f"stop_reason {m.stop_reason}")

    return Client("anthropic message", body)


def openai_stream(base_url: str, max_tokens: int, prompt: str = "hi", key: str = "k") -> Client:
    o = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT_S)

    def body(c: Client) -> None:
        finish = None
        for chunk in o.chat.completions.create(model=MODEL, max_tokens=max_tokens, temperature=0, stream=True,
                                               messages=[{"role": "user", "content": prompt}]):
            if chunk.choices:
                c.first.set()
                finish = chunk.choices[0].finish_reason or finish
        if finish is None:
            raise RuntimeError("the stream ended without a finish reason")
        c.done(f"finish_reason {finish}")

    return Client("openai stream", body)


def frame_request(host: str, port: int, tokens: list[int], max_tokens: int) -> Client:
    def body(c: Client) -> None:
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as s:
            s.sendall(frames.encode_request(1, tokens, max_tokens))
            buf = bytearray()
            while True:
                data = s.recv(65536)
                if not data:
                    raise RuntimeError("the frame connection closed before LAST")
                buf += data
                for f in frames.decode_results(buf):
                    if f.flags & frames.FrameFlag.ERROR:
                        c.kind, c.detail = "error", f"ERROR frame, code {frames.FrameErrorCode(f.tokens[0]).name}"
                        c.error_body = f.tokens[0]
                        return
                    c.first.set()
                    if f.flags & frames.FrameFlag.LAST:
                        return c.done("LAST frame")

    return Client("tcp frames", body)


@dataclass
class Tally:
    """What happened to the requests in flight at a fault."""

    fault: str
    clients: list[Client]
    t_fault: float
    rows: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for c in self.clients:
            c.join(TIMEOUT_S + 10)
        live = [c for c in self.clients if c.t_end > self.t_fault]
        self.rows = {"in_flight": len(live), "ok": sum(c.kind == "ok" for c in live),
                     "error": sum(c.kind == "error" for c in live), "lost": sum(c.kind == "lost" for c in live)}

    def explain(self) -> str:
        return "; ".join(f"{c.name}: {c.kind} ({c.detail})" for c in self.clients)

    def row(self) -> str:
        r = self.rows
        return f"| {self.fault} | {r['in_flight']} | {r['ok']} | {r['error']} | {r['lost']} |"


def warm_up(base_url: str) -> None:
    """One short request through each SDK: their first use in a process imports and builds models
    for a while, which would hold back the first clients of a fault test."""
    for make in (anthropic_stream, anthropic_message, openai_stream):
        c = make(base_url, 1)
        c.start()
        c.join(TIMEOUT_S)
        assert c.kind == "ok", c.detail


def wait_first_token(clients: list[Client], timeout: float = 30.0) -> None:
    """Until one of `clients` has its first token (they are mid-stream)."""
    deadline = time.monotonic() + timeout
    while not any(c.first.is_set() for c in clients):
        if time.monotonic() > deadline:
            states = "; ".join(f"{c.name}: {c.kind} ({c.detail})" for c in clients)
            raise AssertionError(f"no first token: {states}")
        time.sleep(0.002)
