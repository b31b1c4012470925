"""Serving overhead of `zlc serve` against FastAPI + uvicorn (the peer, measured in the same run):
the latency a server adds between the request's bytes going in and the first SSE byte / first token
coming out, for a model whose compute is real but small.

    python bench/serve_overhead.py                          # 10,000 timed requests per path (a few minutes)
    python bench/serve_overhead.py --requests 2000 --spin-us 50,0 --json out.json

Model: `bench/nolayer_model.py` (embedding straight into the LM head, no transformer layers; vocab
264, hidden 64) compiled by zlc with the zoo's byte-level ChatML tokenizer, so the kernel (here its
`--device reference` executor: the bundle's IR in torch on the CPU) is real, but its time does not
hide the serving layer's.

Paths, each with its own subprocess server and one keep-alive connection, requests one at a time
(the next is sent when the previous response has been read completely):
- zlc HTTP: `zlc serve BUNDLE` (one per --spin-us value), POST /v1/messages, stream true, max_tokens 1;
- FastAPI: the same endpoint written the way people write it today (this file, `--peer-server`):
  a pydantic request model, `StreamingResponse` over an async generator, every model step hopped to
  one worker thread with `run_in_executor` under an asyncio.Lock (batch 1, like zlc's engine), the
  same bundle, tokenizer (`encode_chat`, `stream_decoder`) and executor in-process; uvicorn with
  httptools + uvloop, access log off;
- zlc frames TCP / UDP: `--frame-port` / `--udp-port`, a request frame of the same prompt's token
  ids (no tokenizer on the server), time to the first result frame;
- floor: a uvloop server that answers each request frame at once (no parsing, no engine): the cost
  of one loopback round trip between two Python processes on this machine, before any work;
- compute: the executor alone, in this process: `session.stream(ids, 1)` up to its first token,
  which is all the engine runs for such a request; back to back, and after sleeping --idle-us
  before each call (a server's executor sleeps between sequential requests and wakes colder).

Timing: `time.perf_counter_ns()` just before the request is written, and when the `recv()` that
returns the first response byte / the first `content_block_delta` (the first token's text) / a
result frame returns. Warm-up requests are not timed. The paths are measured interleaved: rounds of
--block requests per path, in an order that rotates each round, so that the load of a shared
machine falls on all of them alike.

"Added" latency is what the server adds to the model: raw time to first token minus the MEDIAN
compute time of the same prompt measured in this run (p50: raw p50 - compute p50; p99: raw p99 -
compute p50, so the p99 includes every outlier, the executor's own included). Ratios are peer /
zlc (> 1: zlc is faster). --json adds p50/p99 per round (and, with --raw, every sample) to judge
how much a busy machine moved them.

--torch-threads N sets OMP_NUM_THREADS for the servers (zlc's engine inherits it) and torch's
threads here: torch's default, one thread per core, lets the processes that use torch (zlc's engine,
the FastAPI server, this one) stall each other on a 2-core machine (docs/performance.md).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib.util
import itertools
import json
import os
import platform
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL_NAME = "nolayer"
VOCAB = 264  # the zoo's chat vocabulary (256 bytes + 3 specials, padded)
HIDDEN = 64
# Candidate prompts: the first whose greedy first token is printable ASCII is used (a token that is
# EOS or half a UTF-8 character would produce no content_block_delta to time).
PROMPTS = ("What is the capital of France?", "Hello", "Tell me a story.", "Why is the sky blue?", "Hi there")


# --------------------------------------------------------------------------------------------------
# the model


def _load_nolayer_module() -> Any:
    spec = importlib.util.spec_from_file_location("nolayer_model", HERE / "nolayer_model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_bundle(workdir: Path) -> Path:
    """The no-layer model compiled with the chat tokenizer (reused when `workdir` already holds it)."""
    out = workdir / f"{MODEL_NAME}.zlc"
    if (out / "manifest.json").is_file():
        return out
    import zlc
    from zlc.testing import zoo

    onnx_path = _load_nolayer_module().export_nolayer(workdir / "nolayer.onnx", vocab=VOCAB, hidden=HIDDEN)
    tok = zoo.save_chat_tokenizer(workdir / "tokenizer")
    zlc.compile(onnx_path, targets=["cpu"], out=out, max_seq=128, tokenizer=tok, name=MODEL_NAME)
    return out


# --------------------------------------------------------------------------------------------------
# the peer: FastAPI + uvicorn (run as `python bench/serve_overhead.py --peer-server BUNDLE`)


def run_peer(bundle_path: str, device: str, host: str, port: int) -> None:
    """The Anthropic Messages endpoint (streaming) as a FastAPI app, on uvicorn's fastest settings."""
    import asyncio
    import secrets
    from concurrent.futures import ThreadPoolExecutor
    from typing import Literal

    import uvicorn
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, StreamingResponse
    from pydantic import BaseModel, Field

    import zlc

    bundle = zlc.load(bundle_path)
    tokenizer = bundle.tokenizer
    session = bundle.session(device)
    eos = bundle.eos_token_ids
    list(session.stream(tokenizer.encode_chat("warm up"), 1, eos=eos))
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    lock = asyncio.Lock()  # batch 1: one generation at a time, as zlc's engine

    class TextBlock(BaseModel):
        type: Literal["text"]
        text: str

    class Message(BaseModel):
        role: Literal["user", "assistant"]
        content: str | list[TextBlock]

    class MessagesRequest(BaseModel):
        model: str
        max_tokens: int = Field(ge=1)
        messages: list[Message] = Field(min_length=1)
        system: str | None = None
        stream: bool = False
        temperature: float = Field(default=0.0, ge=0.0, le=1.0)
        top_p: float = Field(default=1.0, ge=0.0, le=1.0)
        stop_sequences: list[str] | None = None
        metadata: dict[str, Any] | None = None

    app = FastAPI()

    def sse(event: str, data: dict[str, Any]) -> str:
        return f"event: {event}\ndata: {json.dumps(data)}\n\n"

    def text_of(content: str | list[TextBlock]) -> str:
        return content if isinstance(content, str) else "".join(b.text for b in content)

    async def generate(ids: list[int], req: MessagesRequest) -> Any:
        """(text piece | None at the end, stop reason, tokens produced), one per token."""
        loop = asyncio.get_running_loop()
        async with lock:
            tokens = session.stream(ids, req.max_tokens, eos=eos, temperature=req.temperature, top_p=req.top_p,
                                    seed=secrets.randbits(63))
            decoder = tokenizer.stream_decoder()
            produced = 0
            while True:
                tok = await loop.run_in_executor(model_thread, next, tokens, None)
                if tok is None:
                    break
                produced += 1
                if tok in eos:
                    yield decoder.flush(), "end_turn", produced
                    return
                yield decoder.feed(tok), None, produced
            yield decoder.flush(), "max_tokens", produced

    async def messages(req: MessagesRequest) -> Any:
        if req.model != bundle.name:
            raise HTTPException(404, f"model: {req.model} not found")
        chat = ([{"role": "system", "content": req.system}] if req.system else [])
        chat += [{"role": m.role, "content": text_of(m.content)} for m in req.messages]
        ids = tokenizer.encode_chat(chat)
        msg_id = "msg_" + secrets.token_hex(12)
        usage = {"input_tokens": len(ids), "output_tokens": 0}

        if not req.stream:
            text, reason, produced = "", "max_tokens", 0
            async for piece, why, n in generate(ids, req):
                text += piece
                reason, produced = why or reason, n
            return JSONResponse({"id": msg_id, "type": "message", "role": "assistant", "model": req.model,
                                 "content": [{"type": "text", "text": text}], "stop_reason": reason,
                                 "stop_sequence": None, "usage": {**usage, "output_tokens": produced}})

        async def events() -> Any:
            yield sse("message_start", {"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": req.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage}})
            yield sse("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "text", "text": ""}})
            yield sse("ping", {"type": "ping"})
            reason, produced = "max_tokens", 0
            async for piece, why, n in generate(ids, req):
                if piece:
                    yield sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                      "delta": {"type": "text_delta", "text": piece}})
                reason, produced = why or reason, n
            yield sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            yield sse("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": reason, "stop_sequence": None},
                                        "usage": {"output_tokens": produced}})
            yield sse("message_stop", {"type": "message_stop"})

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    # (as `@app.post(...)`; this file's `from __future__ import annotations` leaves the annotation a
    # string that FastAPI would look up in the module's globals, where this local model is not)
    messages.__annotations__["req"] = MessagesRequest
    app.post("/v1/messages")(messages)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections queue until uvicorn accepts
    # keep-alive 60 s as zlc's (uvicorn's default, 5 s, would close the connection while other paths run)
    config = uvicorn.Config(app, loop="uvloop", http="httptools", access_log=False, log_level="warning",
                            lifespan="off", timeout_keep_alive=60)
    print(json.dumps({"event": "listening", "http": [host, sock.getsockname()[1]]}), flush=True)
    uvicorn.Server(config).run(sockets=[sock])


def run_echo(host: str, port: int) -> None:
    """The loopback floor: a uvloop server that answers every request frame with a fixed result
    frame at once (no parsing, no engine): what a round trip costs here before any work."""
    import asyncio

    import uvloop

    from zlc.runtime.serve.ingress import frames

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:  # one frame per read (the client waits for each)
            self.transport.write(frames.encode_result(int.from_bytes(data[8:16], "little"), 0, frames.FrameFlag.LAST))

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Echo, host, port)
        print(json.dumps({"event": "listening", "frames_tcp": [host, server.sockets[0].getsockname()[1]]}),
              flush=True)
        await server.serve_forever()

    uvloop.run(serve())


# --------------------------------------------------------------------------------------------------
# server subprocesses


class Child:
    """A server subprocess in its own process group; its stdout's first line is a JSON "listening"
    event; stderr goes to a log file (a pipe nobody reads could block it)."""

    live: list[Child] = []

    def __init__(self, name: str, cmd: list[str], log: Path, startup_s: float = 300.0):
        self.name, self.log = name, log
        self.log_file = open(log, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log_file, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        Child.live.append(self)
        self.info = self._wait_listening(startup_s)

    def _wait_listening(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                self.stop()
                raise RuntimeError(f"{self.name} did not start in {timeout_s:.0f} s; log: {self.log}")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                self.stop()
                raise RuntimeError(f"{self.name} exited at start:\n{self.log.read_text()[-3000:]}")
            line += chunk
        return dict(json.loads(line.splitlines()[0]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.log_file.close()
        if self in Child.live:
            Child.live.remove(self)

    @classmethod
    def stop_all(cls) -> None:
        for c in list(cls.live):
            c.stop()


def _on_sigterm(*_: Any) -> None:
    raise SystemExit(143)


# --------------------------------------------------------------------------------------------------
# clients: plain blocking sockets, nothing between the timer and the syscalls


class HttpClient:
    """One keep-alive HTTP/1.1 connection; `request()` sends the prepared bytes and reads the whole
    chunked response, returning (first byte, first content_block_delta, end) in ns after the send."""

    DELTA = b"event: content_block_delta"

    def __init__(self, host: str, port: int, body: bytes):
        self.address = (host, port)
        self.sock = self._connect()
        self.closed_by_server: list[str] = []  # what happened when the server closed the connection
        self.t_last = time.monotonic()
        self.payload = (f"POST /v1/messages HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
                        f"anthropic-version: 2023-06-01\r\naccept: text/event-stream\r\n"
                        f"content-length: {len(body)}\r\n\r\n").encode() + body
        self.last_body = b""

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(30.0)
        return sock

    def request(self) -> tuple[int, int, int]:
        """A server that closes the keep-alive connection (it should not) is noted, and the request
        is sent again on a new connection."""
        try:
            out = self._request()
        except (ConnectionError, TimeoutError) as e:
            self.closed_by_server.append(f"{type(e).__name__}: {e} ({time.monotonic() - self.t_last:.3f} s after "
                                         "the previous response)")
            self.sock.close()
            self.sock = self._connect()
            out = self._request()
        self.t_last = time.monotonic()
        return out

    def _request(self) -> tuple[int, int, int]:
        sock, delta = self.sock, self.DELTA
        buf = bytearray()
        t_delta = -1
        t0 = time.perf_counter_ns()
        sock.sendall(self.payload)
        data = sock.recv(65536)
        t_first = time.perf_counter_ns()
        head_end = -1
        pos = 0  # next chunk-size line in buf, once the head is parsed
        chunks: list[bytes] = []
        while True:
            if not data:
                raise ConnectionError("the server closed the connection")
            scan = max(0, len(buf) - len(delta))
            buf += data
            if t_delta < 0 and buf.find(delta, scan) >= 0:
                t_delta = time.perf_counter_ns()
            if head_end < 0:
                head_end = buf.find(b"\r\n\r\n")
                if head_end >= 0:
                    status = bytes(buf[:12])
                    if not status.startswith(b"HTTP/1.1 200"):
                        raise RuntimeError(f"HTTP error: {bytes(buf[:600]).decode(errors='replace')}")
                    if b"transfer-encoding: chunked" not in bytes(buf[:head_end]).lower():
                        raise RuntimeError("expected a chunked SSE response")
                    pos = head_end + 4
            if head_end >= 0:
                while True:  # whole chunks
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        break
                    size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
                    end = eol + 2 + size + 2
                    if len(buf) < end:
                        break
                    if size == 0:
                        if t_delta < 0:
                            raise RuntimeError(f"no content_block_delta in the response: {bytes(buf)!r}")
                        self.last_body = b"".join(chunks)
                        return t_first - t0, t_delta - t0, time.perf_counter_ns() - t0
                    chunks.append(bytes(buf[eol + 2:eol + 2 + size]))
                    pos = end
            data = sock.recv(65536)

    def close(self) -> None:
        self.sock.close()


class FrameClient:
    """Binary request frames over one TCP connection or a connected UDP socket; `request()` returns
    ns from the send to the first result frame (and to the LAST one)."""

    def __init__(self, host: str, port: int, udp: bool, tokens: list[int]):
        from zlc.runtime.serve.ingress import frames

        self.frames = frames
        self.udp = udp
        if udp:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.sock.connect((host, port))
        else:
            self.sock = socket.create_connection((host, port))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(5.0)
        self.tokens = tokens
        self.next_id = 1
        self.buf = bytearray()
        self.lost = 0
        self.last_tokens: list[int] = []

    def request(self) -> tuple[int, int, int]:
        fr = self.frames
        rid = self.next_id
        self.next_id += 1
        msg = fr.encode_request(rid, self.tokens, 1)
        sock, buf = self.sock, self.buf
        t_first = -1
        t0 = time.perf_counter_ns()
        sock.send(msg) if self.udp else sock.sendall(msg)
        while True:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                if not self.udp:
                    raise
                self.lost += 1  # a lost datagram: send again under a new id
                return self.request()
            t = time.perf_counter_ns()
            if not data:
                raise ConnectionError("the server closed the frame connection")
            buf += data
            for f in fr.decode_results(buf):
                if f.request_id != rid:
                    continue  # a late answer to a retried datagram
                if f.flags & fr.FrameFlag.ERROR:
                    raise RuntimeError(f"frame error code {f.tokens}")
                if t_first < 0:
                    t_first = t - t0
                    self.last_tokens = list(f.tokens)
                if f.flags & fr.FrameFlag.LAST:
                    return t_first, t_first, t - t0

    def close(self) -> None:
        self.sock.close()


class ComputeProbe:
    """The executor alone: what the engine runs for a max_tokens=1 request (a session stream up to
    its first token), timed in this process; back to back, or after sleeping `idle_s` (untimed) as
    a server's executor sleeps between sequential requests."""

    def __init__(self, bundle: Any, device: str, ids: list[int], idle_s: float = 0.0):
        self.session = bundle.session(device)
        self.eos = bundle.eos_token_ids
        self.ids = ids
        self.idle_s = idle_s
        self.last_tokens: list[int] = []

    def request(self) -> tuple[int, int, int]:
        if self.idle_s:
            time.sleep(self.idle_s)
        t0 = time.perf_counter_ns()
        tok = next(self.session.stream(list(self.ids), 1, eos=self.eos, temperature=0.0, top_p=1.0, seed=0))
        dt = time.perf_counter_ns() - t0
        self.last_tokens = [tok]
        return dt, dt, dt

    def close(self) -> None:
        self.session.close()


# --------------------------------------------------------------------------------------------------
# measurement


def pct(xs: Sequence[int], q: float) -> float:
    """Nearest-rank percentile of ns values, in µs."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * len(s))) - 1))] / 1e3


class Lane:
    def __init__(self, name: str, kind: str, client: Any):
        self.name, self.kind, self.client = name, kind, client
        self.first_byte: list[int] = []
        self.first_token: list[int] = []
        self.total: list[int] = []

    def run(self, n: int, record: bool = True) -> None:
        req = self.client.request
        fb, ft, tot = self.first_byte, self.first_token, self.total
        for _ in range(n):
            a, b, c = req()
            if record:
                fb.append(a)
                ft.append(b)
                tot.append(c)


def _delta_text(sse: bytes) -> str:
    """The text of the content_block_delta events of an SSE body, as a repr."""
    text = ""
    for event in sse.split(b"\n\n"):
        if event.startswith(b"event: content_block_delta\ndata: "):
            text += json.loads(event.split(b"\ndata: ", 1)[1])["delta"]["text"]
    return repr(text)


def _fmt(us: float) -> str:
    return f"{us:,.0f} µs" if us >= 100 else f"{us:.1f} µs"


def _ratio(a: float, b: float) -> float:
    """a / b, NaN when b is not positive (an 'added' below zero means the compute median of a
    noisy run exceeded a server's first-token median: no meaningful ratio)."""
    return a / b if b > 0 else float("nan")


def report(paths: list[Lane], peer: str, zlc_names: list[str], args: argparse.Namespace,
           elapsed_s: float) -> tuple[str, dict[str, Any]]:
    compute = {p.kind: pct(p.first_token, 0.5) for p in paths if p.kind.startswith("compute")}
    hot, idle = compute["compute"], compute.get("compute-idle")
    rows: dict[str, dict[str, float]] = {}
    for p in paths:
        r = {"n": len(p.first_token),
             "first_byte_p50": pct(p.first_byte, 0.5), "first_byte_p99": pct(p.first_byte, 0.99),
             "first_token_p50": pct(p.first_token, 0.5), "first_token_p99": pct(p.first_token, 0.99)}
        if p.kind not in ("compute", "compute-idle", "echo"):
            r["added_p50"] = r["first_token_p50"] - hot
            r["added_p99"] = r["first_token_p99"] - hot
            if idle is not None:
                r["added_vs_idle_p50"] = r["first_token_p50"] - idle
                r["added_vs_idle_p99"] = r["first_token_p99"] - idle
        rows[p.name] = r

    def pair(r: dict[str, float], key: str) -> str:
        return f"{_fmt(r[key + '_p50'])} / {_fmt(r[key + '_p99'])}" if key + "_p50" in r else "–"

    idle_col = idle is not None
    lines = ["| path | n | first byte p50 / p99 | first token p50 / p99 | added p50 / p99"
             + (" | added vs asleep compute p50 / p99 |" if idle_col else " |"),
             "|---|---|---|---|---|" + ("---|" if idle_col else "")]
    for p in paths:
        r = rows[p.name]
        fb = pair(r, "first_byte") if p.kind == "http" else "–"
        lines.append(f"| {p.name} | {r['n']:,} | {fb} | {pair(r, 'first_token')} | {pair(r, 'added')} |"
                     + (f" {pair(r, 'added_vs_idle')} |" if idle_col else ""))
    ratios: dict[str, dict[str, float]] = {}
    aims: dict[str, bool] = {}
    lines.append("")
    for z in zlc_names:
        a, b = rows[peer], rows[z]
        ratios[f"{peer} / {z}"] = d = {
            "first_token_p50": a["first_token_p50"] / b["first_token_p50"],
            "first_token_p99": a["first_token_p99"] / b["first_token_p99"],
            "added_p50": _ratio(a["added_p50"], b["added_p50"]),
            "added_p99": _ratio(a["added_p99"], b["added_p99"])}
        lines.append(f"- {peer} / {z}: first token {d['first_token_p50']:.2f}x at p50, "
                     f"{d['first_token_p99']:.2f}x at p99; added {d['added_p50']:.2f}x at p50, "
                     f"{d['added_p99']:.2f}x at p99")
        aims[f"{z}: added p50 <= 100 us"] = 0 < b["added_p50"] <= 100
        aims[f"{z}: >= 5x below {peer} (added, p50 and p99)"] = d["added_p50"] >= 5 and d["added_p99"] >= 5
    for p in paths:
        if p.kind in ("tcp", "udp"):
            http = p.name.split(" frames")[0] + " HTTP"
            if http in rows:
                a, b = rows[http], rows[p.name]
                ratios[f"{http} / {p.name}"] = d = {
                    "first_token_p50": a["first_token_p50"] / b["first_token_p50"],
                    "added_p50": _ratio(a["added_p50"], b["added_p50"]),
                    "added_p99": _ratio(a["added_p99"], b["added_p99"])}
                lines.append(f"- {http} / {p.name}: added {d['added_p50']:.2f}x at p50, {d['added_p99']:.2f}x at p99")
            aims[f"{p.name}: added p50 <= 30 us"] = 0 < rows[p.name]["added_p50"] <= 30
    lines.append(f"\nadded = first-token latency - the executor's median compute back to back ({_fmt(hot)}, "
                 "this run)" + (f"; vs asleep: - its median after sleeping {args.idle_us:g} µs ({_fmt(idle)})"
                                if idle is not None else "") + ". Ratios are peer / zlc (> 1: zlc is faster).")
    if any(r.get("added_p50", 1.0) <= 0 for r in rows.values()):
        lines.append("WARNING: the executor's median compute exceeds a server's first-token median: the machine "
                     "was too busy for this run to mean anything; run it again")
    lines.append("aims: " + "; ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in aims.items()))
    result = {"rows": rows, "ratios": ratios, "aims": aims, "compute_p50_us": compute, "elapsed_s": elapsed_s,
              "config": {k: v for k, v in vars(args).items() if k not in ("peer_server", "peer_port")},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(), "load_avg_at_end": os.getloadavg()},
              "command": " ".join([Path(sys.executable).name, *sys.argv])}
    return "\n".join(lines), result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=10_000, help="timed requests per path")
    ap.add_argument("--warmup", type=int, default=500, help="untimed requests per path first")
    ap.add_argument("--block", type=int, default=100, help="requests per path per interleaved round")
    ap.add_argument("--device", default="reference", help="executor for both servers and the compute probe")
    ap.add_argument("--spin-us", default="50", help="zlc serve --spin-us values, comma-separated: one zlc "
                    "server each (e.g. 50,0)")
    ap.add_argument("--idle-us", type=float, default=500.0, help="also time the executor after sleeping this "
                    "long before each call (0: skip); the servers' executors run after such idle gaps")
    ap.add_argument("--torch-threads", type=int, default=None, help="OMP_NUM_THREADS for the servers and "
                    "torch.set_num_threads here (default: torch's own, one per core)")
    ap.add_argument("--no-frames", action="store_true", help="skip the binary frame paths")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the bundle and logs here (reused)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here (with p50/p99 per round)")
    ap.add_argument("--raw", action="store_true", help="with --json: every first-token time, in ns")
    ap.add_argument("--peer-server", metavar="BUNDLE", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peer-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.peer_server:
        run_peer(args.peer_server, args.device, "127.0.0.1", args.peer_port)
        return 0
    if args.echo_server:
        run_echo("127.0.0.1", args.peer_port)
        return 0

    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C stops the servers even if inherited ignored
    atexit.register(Child.stop_all)
    if args.workdir is None:
        tmp = tempfile.mkdtemp(prefix="zlc-serve-bench-")
        workdir = Path(tmp)
        atexit.register(shutil.rmtree, tmp, True)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    spins = [float(s) for s in args.spin_us.split(",") if s.strip()]

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.torch_threads:  # the servers inherit it (zlc's engine from zlc serve)
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    t_start = time.monotonic()
    say(f"bundle: compiling the no-layer model into {workdir} (reused if there) …")
    bundle_path = build_bundle(workdir)
    import zlc

    bundle = zlc.load(bundle_path)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    tok = bundle.tokenizer
    probe_session = bundle.session(args.device)
    prompt, ids, first = "", [], -1
    for prompt in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        first = next(probe_session.stream(ids, 1, eos=bundle.eos_token_ids))
        if 32 <= first < 127:
            break
    else:
        raise SystemExit("no candidate prompt starts its reply with a printable ASCII token")
    probe_session.close()
    body = json.dumps({"model": MODEL_NAME, "max_tokens": 1, "stream": True,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    say(f"prompt {prompt!r}: {len(ids)} tokens; greedy first token {first} ({tok.decode([first])!r})")

    paths: list[Lane] = []
    zlc_names: list[str] = []
    try:
        for spin in spins:
            name = f"zlc (spin {spin:g} µs)" if len(spins) > 1 else "zlc"
            say(f"starting {name}: zlc serve --device {args.device} --spin-us {spin:g} …")
            c = Child(name, [sys.executable, "-m", "zlc.cli", "serve", str(bundle_path), "--port", "0",
                             "--frame-port", "0", "--udp-port", "0", "--device", args.device,
                             "--spin-us", f"{spin:g}"], workdir / f"zlc-serve-spin{spin:g}.log")
            host, port = c.info["http"]
            paths.append(Lane(f"{name} HTTP", "http", HttpClient(host, port, body)))
            zlc_names.append(f"{name} HTTP")
            if not args.no_frames:
                paths.append(Lane(f"{name} frames TCP", "tcp", FrameClient(host, c.info["frames_tcp"][1], False, ids)))
                paths.append(Lane(f"{name} frames UDP", "udp", FrameClient(host, c.info["frames_udp"][1], True, ids)))
        peer = "FastAPI + uvicorn"
        say(f"starting {peer} (httptools, uvloop) …")
        pc = Child(peer, [sys.executable, str(Path(__file__).resolve()), "--peer-server", str(bundle_path),
                          "--device", args.device], workdir / "fastapi.log")
        peer_host, peer_port = pc.info["http"]
        paths.append(Lane(peer, "http", HttpClient(peer_host, peer_port, body)))
        if not args.no_frames:
            ec = Child("echo", [sys.executable, str(Path(__file__).resolve()), "--echo-server"], workdir / "echo.log")
            paths.append(Lane("floor: uvloop echo of a frame over TCP", "echo",
                              FrameClient("127.0.0.1", ec.info["frames_tcp"][1], False, ids)))
        paths.append(Lane("executor alone, back to back", "compute", ComputeProbe(bundle, args.device, ids)))
        if args.idle_us:
            paths.append(Lane(f"executor alone, {args.idle_us:g} µs asleep before each", "compute-idle",
                              ComputeProbe(bundle, args.device, ids, idle_s=args.idle_us * 1e-6)))

        say(f"warm-up: {args.warmup} requests per path")
        for p in paths:
            p.run(args.warmup, record=False)
        # every path must have answered with the same first token
        for p in paths:
            c_ = p.client
            if p.kind == "echo":
                continue
            got = _delta_text(c_.last_body) if isinstance(c_, HttpClient) else str(c_.last_tokens)
            want = repr(tok.decode([first])) if isinstance(c_, HttpClient) else str([first])
            if got != want:
                raise SystemExit(f"{p.name} answered {got}, expected {want}")
        say(f"  all paths answer the greedy first token {first}")

        rounds = max(1, -(-args.requests // max(1, args.block)))
        per = [args.requests // rounds + (1 if i < args.requests % rounds else 0) for i in range(rounds)]
        say(f"measuring: {args.requests:,} requests per path in {rounds} interleaved rounds")
        loads: list[float] = []  # 1-minute load average after each round: how busy the machine was
        for r, n in enumerate(per):
            order = paths[r % len(paths):] + paths[:r % len(paths)]
            gc.collect()
            gc.disable()
            t = time.monotonic()
            try:
                for p in order:
                    p.run(n)
            finally:
                gc.enable()
            medians = ", ".join(f"{p.name} {pct(p.first_token[-n:], 0.5):.0f}" for p in paths)
            loads.append(os.getloadavg()[0])
            if (r + 1) % max(1, rounds // 20) == 0 or r + 1 == rounds:
                say(f"  round {r + 1}/{rounds} ({time.monotonic() - t:.2f} s, load {os.getloadavg()[0]:.1f}): "
                    f"first-token medians µs: {medians}")
        table, result = report(paths, peer, zlc_names, args, time.monotonic() - t_start)
        result["per_round"] = {p.name: [[pct(p.first_token[i:i + n], q) for q in (0.5, 0.99)]
                                        for i, n in zip(itertools.accumulate([0, *per]), per, strict=False)]
                               for p in paths}
        if args.raw:
            result["raw_first_token_ns"] = {p.name: p.first_token for p in paths}
        result["prompt"] = {"text": prompt, "tokens": len(ids)}
        result["load_avg_per_round"] = loads
        result["udp_lost"] = {p.name: p.client.lost for p in paths if p.kind == "udp"}
        result["closed_by_server"] = {p.name: p.client.closed_by_server for p in paths if p.kind == "http"}
        for name, events in result["closed_by_server"].items():
            for e in events:
                say(f"WARNING: {name}: the server closed the keep-alive connection: {e}")
        for name, lost in result["udp_lost"].items():
            if lost:
                say(f"WARNING: {name}: {lost} datagrams lost (sent again)")
    finally:
        for p in paths:
            p.client.close()
        Child.stop_all()
    print(table)
    say(f"({result['elapsed_s']:.0f} s; load average at the end {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs)")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
