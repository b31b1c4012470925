"""`zlc serve`: one asyncio process of ingress (HTTP with the Anthropic and OpenAI APIs, binary token
frames over TCP and UDP, /health, /metrics) in front of the engine process that owns the executor.

    client ─HTTP/frames─▶ ingress: parse (httptools, C) → JSON (orjson, Rust) → tokenize (tokenizers,
    Rust) → request ring (C) ─▶ engine ─▶ result ring (C) → detokenize → SSE/frames ─▶ client

Per request, Python runs only the glue between those compiled parts; nothing else (no framework,
no middleware, no thread hop) sits between the socket and the ring.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from zlc.errors import ZlcError

from . import api_anthropic, api_openai, frames
from .api_common import ApiError, GenerationSpec, fit_context
from .engine import EngineError
from .engine_client import EngineClient
from .http import HttpConnection, HttpLimits, HttpRequest, serve_http
from .metrics import ServerMetrics
from .rings import Request, ResultFlag
from .textstream import TextStream

ARCHITECTURE = "zero-layer-v1"
UDP_BUFFER_BYTES = 8 << 20  # capped by net.core.rmem_max / wmem_max (deploy/sysctl.d raises those)


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None  # default: the bundle's model name
    device: str = "cpu"
    frame_port: int | None = None  # TCP binary frames (None: off, 0: any free port)
    udp_port: int | None = None  # UDP binary frames
    max_queue: int = 32  # requests waiting in the engine before new ones get "overloaded"
    spin_us: float = 0.0  # the engine polls its ring this long before sleeping (for isolated cores)
    threads: int = 1  # the executor's CPU threads (reference / cpu devices)
    limits: HttpLimits = field(default_factory=HttpLimits)
    frame_timeout_s: float = 5.0  # a partial TCP frame older than this closes the connection
    xdp: str | None = None  # attach the bundle's XDP program to this interface (needs udp_port)


def _engine_error(code: int, queue: int) -> ApiError:
    if code == EngineError.OVERLOADED:
        return ApiError("overloaded_error", f"the server is overloaded ({queue} requests waiting); retry later")
    if code == EngineError.BAD_REQUEST:
        return ApiError("invalid_request_error", "the model refused the prompt (see the server log)")
    return ApiError("api_error", "the engine failed while generating (see the server log)")


class HttpReply:
    """One generation request on its way back to an HTTP client."""

    __slots__ = ("server", "conn", "api", "reply", "spec", "text", "rid", "t0", "t_last", "produced", "started",
                 "done", "headers")

    def __init__(self, server: Server, conn: HttpConnection, api: str, reply: Any, spec: GenerationSpec, t0: int):
        self.server, self.conn, self.api, self.reply, self.spec = server, conn, api, reply, spec
        self.text = TextStream(server.tokenizer, spec.stop_sequences)
        self.rid = 0
        self.t0 = self.t_last = t0
        self.produced = 0
        self.started = False
        self.done = False
        self.headers = server.id_headers(reply.id)  # sent with the response head

    def cancel(self) -> None:  # the client went away
        if not self.done:
            self.done = True
            self.server.engine.cancel(self.rid)
            self.server.metrics.requests.labels(self.api, "cancelled").inc()

    def on_result(self, token: int, flags: int, t_ns: int) -> None:
        if self.done:
            return
        server, conn = self.server, self.conn
        if flags & ResultFlag.ERROR:
            self.fail(_engine_error(token, server.engine.in_flight))
            return
        now = time.monotonic_ns()
        m = server.metrics
        mc = server.per_api[self.api]
        if self.produced == 0:
            mc.ttft.observe((now - self.t0) * 1e-9)
        else:
            mc.itl.observe((now - self.t_last) * 1e-9)
        self.t_last = now
        self.produced += 1
        m.tokens.inc()
        m.rate.add()
        piece = "" if flags & ResultFlag.EOS else self.text.feed(token)
        stream = self.spec.stream
        # Streams: the headers and message_start go out with the first token, in one write (one
        # syscall, one packet), and every later token in one write of its own.
        head = b""
        if stream and not self.started:
            self.started = True
            head = self.reply.stream_head()
        if self.text.stopped is not None:
            reason = "stop_sequence"
            if not flags & ResultFlag.LAST:
                server.engine.cancel(self.rid)
        elif flags & ResultFlag.LAST:
            reason = "eos" if flags & ResultFlag.EOS else "max_tokens"
            piece += self.text.finish()
            if self.text.stopped is not None:
                reason = "stop_sequence"
        else:
            if stream and (piece or head):
                conn.write_stream(head + (self.reply.stream_delta(piece) if piece else b""),
                                  headers=self.headers)
            return
        self.done = True
        conn.cancel_active = None
        mc.ok.inc()
        if stream:
            tail = self.reply.stream_delta(piece) if piece else b""
            conn.write_stream(head + tail + self.reply.stream_end(reason, self.text.stopped, self.produced),
                              end=True, headers=self.headers)
        else:
            conn.respond(200, self.reply.body(self.text.text, reason, self.text.stopped, self.produced),
                         headers=self.headers)

    def fail(self, e: ApiError) -> None:
        self.done = True
        self.conn.cancel_active = None
        self.server.metrics.requests.labels(self.api, e.kind).inc()
        mod = api_openai if self.api == "openai" else api_anthropic
        if self.started:  # headers are out: the error goes in the stream
            self.conn.write_stream(self.reply.stream_error(e), end=True)
        else:
            status = api_openai.status_of(e) if self.api == "openai" else e.status
            self.conn.respond(status, mod.error_body(e))


class FrameReply:
    """One binary-frame request: each result goes straight back as a frame."""

    __slots__ = ("send", "client_id", "rid", "owner", "key")

    def __init__(self, send: Any, client_id: int, rid: int, owner: dict[Any, int] | None, key: Any = None):
        self.send, self.client_id, self.rid, self.owner, self.key = send, client_id, rid, owner, key

    def on_result(self, token: int, flags: int, t_ns: int) -> None:
        self.send(frames.encode_result(self.client_id, token, flags))
        if flags & ResultFlag.LAST and self.owner is not None:
            self.owner.pop(self.key, None)


class Server:
    def __init__(self, bundle_path: str, options: ServeOptions | None = None):
        from zlc.runtime.loader import load

        self.options = o = options or ServeOptions()
        self.bundle = load(bundle_path)
        self.model = o.model_name or self.bundle.name
        self.max_seq = self.bundle.max_seq
        self.tokenizer = self.bundle.tokenizer
        self.engine = EngineClient(str(self.bundle.path), o.device, max_queue=o.max_queue, spin_us=o.spin_us,
                                   threads=o.threads)
        self.metrics = ServerMetrics(lambda: self.engine.in_flight, self.engine.region.requests.occupancy,
                                     self.engine.region.results.occupancy)
        self.per_api = {api: self.metrics.for_api(api) for api in ("anthropic", "openai")}
        self.extra_headers = f"x-zlc-architecture: {ARCHITECTURE}\r\nserver: zlc\r\n".encode()
        self.connections: set[HttpConnection] = set()
        self.servers: list[Any] = []
        self.udp: asyncio.DatagramTransport | None = None
        self.addresses: dict[str, Any] = {}
        self.xdp: Any = None
        self._stopped: asyncio.Event | None = None

    # -- lifetime

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        await loop.run_in_executor(None, self.engine.start)
        self.engine.attach(loop, on_dead=lambda: None)
        o = self.options
        http = await serve_http(loop, self.handle, o.host, o.port, o.limits, self.extra_headers, self.connections)
        self.servers.append(http)
        self.addresses["http"] = http.sockets[0].getsockname()[:2]
        if o.frame_port is not None:
            tcp = await loop.create_server(lambda: FrameConnection(self), o.host, o.frame_port, reuse_address=True)
            self.servers.append(tcp)
            self.addresses["frames_tcp"] = tcp.sockets[0].getsockname()[:2]
        if o.udp_port is not None:
            transport, proto = await loop.create_datagram_endpoint(lambda: FrameDatagram(self),
                                                                   local_addr=(o.host, o.udp_port))
            self.udp = transport
            self.addresses["frames_udp"] = transport.get_extra_info("sockname")[:2]
            if o.xdp is not None:
                self._attach_xdp(loop, proto, self.addresses["frames_udp"][1])
        elif o.xdp is not None:
            raise ZlcError("--xdp needs --udp-port: frames the program passes on, and all replies, use that socket")

    def _attach_xdp(self, loop: asyncio.AbstractEventLoop, udp: FrameDatagram, port: int) -> None:
        from .xdp import XdpIngress

        obj = self.bundle.path / "deploy" / "ebpf" / "zlc_xdp.o"
        xdp = XdpIngress(obj, str(self.options.xdp), port, lambda frame, addr: udp.handle(frame, addr, "xdp"))
        self.xdp = xdp
        loop.add_reader(xdp.epoll_fd, xdp.consume)
        self.metrics.watch_xdp(xdp.stats)
        self.addresses["xdp"] = [str(self.options.xdp), port]

    def close(self) -> None:
        for s in self.servers:
            s.close()
        for c in list(self.connections):
            c.close()
        if self.udp is not None:
            self.udp.close()
        if self.xdp is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.xdp.epoll_fd)
            except RuntimeError:
                pass
            self.xdp.close()  # detaches the program
            self.xdp = None
        self.engine.close()
        if self._stopped is not None:
            self._stopped.set()

    async def wait_closed(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()

    def id_headers(self, reply_id: str) -> bytes:
        return b"request-id: " + reply_id.encode() + b"\r\nx-request-id: " + reply_id.encode() + b"\r\n"

    # -- HTTP routing

    def handle(self, req: HttpRequest, conn: HttpConnection) -> None:
        path, method = req.path, req.method
        if path == b"/v1/messages":
            if method != b"POST":
                return self._error(conn, "anthropic", ApiError("invalid_request_error", "use POST", status=405),
                                   b"allow: POST\r\n")
            return self._generate(req, conn, "anthropic")
        if path == b"/v1/chat/completions":
            if method != b"POST":
                return self._error(conn, "openai", ApiError("invalid_request_error", "use POST", status=405),
                                   b"allow: POST\r\n")
            return self._generate(req, conn, "openai")
        api = "anthropic" if b"anthropic-version" in req.headers else "openai"
        if path == b"/health":
            return self._health(conn)
        if path == b"/metrics":
            return conn.respond(200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
        if path in (b"/v1/models", b"/v1/models/" + self.model.encode()):
            if not self._authorized(req):
                return self._error(conn, api, ApiError("authentication_error", "invalid x-api-key"))
            return self._models(conn, api, single=path != b"/v1/models")
        return self._error(conn, api, ApiError("not_found_error", f"no route for {method.decode()} {path.decode()}"))

    def _error(self, conn: HttpConnection, api: str, e: ApiError, headers: bytes = b"") -> None:
        if api == "openai":
            conn.respond(api_openai.status_of(e), api_openai.error_body(e), headers=headers)
        else:
            conn.respond(e.status, api_anthropic.error_body(e), headers=headers)

    def _authorized(self, req: HttpRequest) -> bool:
        key = self.options.api_key
        if not key:
            return True
        given = req.headers.get(b"x-api-key")
        if given is None:
            auth = req.headers.get(b"authorization", b"")
            given = auth[7:] if auth[:7].lower() == b"bearer " else b""
        return hmac.compare_digest(given, key.encode())

    def _health(self, conn: HttpConnection) -> None:
        ok = not self.engine.dead
        body = {"status": "ok" if ok else "engine_down", "model": self.model, "device": self.options.device,
                "in_flight": self.engine.in_flight, "architecture": ARCHITECTURE}
        conn.respond(200 if ok else 503, orjson.dumps(body))

    def _models(self, conn: HttpConnection, api: str, single: bool) -> None:
        created = int(os.path.getmtime(self.bundle.path / "manifest.json"))
        if api == "anthropic":
            entry: dict[str, Any] = {"type": "model", "id": self.model, "display_name": self.model,
                                     "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                                     "max_input_tokens": self.max_seq, "max_tokens": self.max_seq}
            body = entry if single else {"data": [entry], "has_more": False, "first_id": self.model,
                                         "last_id": self.model}
        else:
            entry = {"id": self.model, "object": "model", "created": created, "owned_by": "zlc"}
            body = entry if single else {"object": "list", "data": [entry]}
        conn.respond(200, orjson.dumps(body))

    def _generate(self, req: HttpRequest, conn: HttpConnection, api: str) -> None:
        try:
            if not self._authorized(req):
                raise ApiError("authentication_error", "invalid x-api-key" if api == "anthropic"
                               else "Incorrect API key provided")
            if self.engine.dead:
                raise ApiError("api_error", "the engine is not running", status=503)
            if self.tokenizer is None:
                raise ApiError("invalid_request_error", "this bundle has no tokenizer (compile with --tokenizer); "
                               "send token ids as binary frames instead")
            try:
                body = orjson.loads(req.body)
            except orjson.JSONDecodeError as e:
                raise ApiError("invalid_request_error", f"the request body is not valid JSON: {e}") from None
            if api == "openai":
                spec = api_openai.parse(body, self.tokenizer, self.model, self.max_seq)
                reply: Any = api_openai.Reply(self.model, len(spec.prompt_ids), spec.include_usage)
            else:
                spec = api_anthropic.parse(body, self.tokenizer, self.model)
                reply = api_anthropic.Reply(self.model, len(spec.prompt_ids))
            fit_context(spec, self.max_seq)
        except ApiError as e:
            self.metrics.requests.labels(api, e.kind).inc()
            return self._error(conn, api, e)
        handler = HttpReply(self, conn, api, reply, spec, req.t_ns)
        rid = handler.rid = self.engine.new_id()
        request = Request(rid, spec.prompt_ids, spec.max_tokens, spec.temperature, spec.top_p, spec.seed)
        self.metrics.prompt_tokens.inc(len(spec.prompt_ids))
        if not self.engine.submit(request, handler):
            return handler.fail(ApiError("overloaded_error", "the server is overloaded (request ring full); "
                                         "retry later"))
        conn.cancel_active = handler.cancel


# --------------------------------------------------------------------------------------------------
# binary frames


class _FrameSubmitter:
    """What TCP and UDP frames share: validation against the bundle and submission."""

    def __init__(self, server: Server, transport_name: str):
        self.server = server
        self.name = transport_name
        self.inflight: dict[Any, int] = {}  # client request id -> engine request id

    def submit(self, header: frames.FrameHeader, tokens: Any, send: Any, key: Any, via: str | None = None) -> None:
        server = self.server
        m = server.metrics.frames
        name = via or self.name
        if header.flags & frames.FrameFlag.CANCEL:
            rid = self.inflight.pop(key, None)
            if rid is not None:
                server.engine.cancel(rid)
                send(frames.encode_result(header.request_id, frames.FrameErrorCode.CANCELLED,
                                          frames.FrameFlag.ERROR | frames.FrameFlag.LAST))
            m.labels(name, "cancel").inc()
            return
        n = len(tokens)
        if key in self.inflight or n > server.max_seq:
            m.labels(name, "refused").inc()
            send(frames.encode_result(header.request_id, frames.FrameErrorCode.BAD_REQUEST,
                                      frames.FrameFlag.ERROR | frames.FrameFlag.LAST))
            return
        max_tokens = min(header.max_tokens, server.max_seq - n + 1)
        rid = server.engine.new_id()
        reply = FrameReply(send, header.request_id, rid, None, key)
        if not server.engine.submit(Request(rid, tokens, max_tokens), reply):
            m.labels(name, "overloaded").inc()
            send(frames.encode_result(header.request_id, frames.FrameErrorCode.OVERLOADED,
                                      frames.FrameFlag.ERROR | frames.FrameFlag.LAST))
            return
        self.inflight[key] = rid
        reply.owner = self.inflight
        reply.client_id = header.request_id
        m.labels(name, "accepted").inc()
        server.metrics.prompt_tokens.inc(n)


class FrameConnection(asyncio.Protocol):
    """Binary frames over TCP: any malformed frame closes the connection (its byte stream can no
    longer be trusted); a frame that stays incomplete longer than frame_timeout_s does too."""

    def __init__(self, server: Server):
        self.server = server
        self.sub = _FrameSubmitter(server, "tcp")
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        # the framing bound (the longest prompt the ring can carry); longer than the context is
        # answered BAD_REQUEST in submit() instead of closing the connection
        self.limit = server.engine.region.requests.max_prompt_tokens

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not an asyncio subclass)

    def _send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        consumed = False
        while len(buf) >= frames.HEADER_SIZE:
            try:
                h = frames.parse_header(buf, self.limit)
            except frames.FrameError as e:
                self._malformed(str(e))
                return
            end = frames.HEADER_SIZE + 4 * h.n_tokens
            if len(buf) < end:
                break
            tokens = frames.tokens_from(memoryview(buf)[frames.HEADER_SIZE:end])
            del buf[:end]
            consumed = True
            # client ids are per connection, so the id alone is the key
            self.sub.submit(h, tokens, self._send, h.request_id)
        self._watch_partial(consumed)

    def _watch_partial(self, new_frame: bool) -> None:
        """The deadline runs from a partial frame's first byte: bytes trickling in do not extend it."""
        if self.timer is not None and (new_frame or not self.buf):
            self.timer.cancel()
            self.timer = None
        if self.buf and self.timer is None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(self.server.options.frame_timeout_s, self._malformed,
                                         "an incomplete frame timed out (does its n_tokens lie?)")

    def _malformed(self, why: str) -> None:
        self.server.metrics.frames.labels("tcp", "malformed").inc()
        print(f"zlc serve: frames/tcp: closing a connection: {why}", file=sys.stderr)
        self.buf.clear()
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for rid in self.sub.inflight.values():
            self.server.engine.cancel(rid)
        self.sub.inflight.clear()


class FrameDatagram(asyncio.DatagramProtocol):
    """Binary frames over UDP: one frame per datagram, its length exactly 24 + 4 * n_tokens. A
    datagram without the magic is counted and dropped (it may not be ours); any other malformed
    frame is answered with an ERROR frame (code MALFORMED)."""

    def __init__(self, server: Server):
        self.server = server
        self.sub = _FrameSubmitter(server, "udp")
        self.transport: asyncio.DatagramTransport | None = None
        self.limit = frames.MAX_UDP_TOKENS  # longer than max_seq: BAD_REQUEST in submit()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not an asyncio subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # room for bursts (and for what XDP passes on when its ring is full)
            for force, opt in ((33, socket.SO_RCVBUF), (32, socket.SO_SNDBUF)):  # SO_*BUFFORCE: root only
                try:
                    sock.setsockopt(socket.SOL_SOCKET, force, UDP_BUFFER_BYTES)
                except OSError:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, opt, UDP_BUFFER_BYTES)
                    except OSError:
                        pass

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.handle(data, addr, "udp")

    def handle(self, data: bytes, addr: Any, via: str) -> None:
        """One frame from `addr`, received on the socket ("udp") or taken from the XDP ring ("xdp",
        validated by the program and checked again here); replies leave through the socket."""
        m = self.server.metrics.frames
        transport = self.transport
        assert transport is not None

        def send(out: bytes) -> None:
            transport.sendto(out, addr)

        if len(data) < frames.HEADER_SIZE or int.from_bytes(data[:4], "little") != frames.MAGIC:
            m.labels(via, "malformed").inc()
            return
        try:
            h = frames.parse_header(data, self.limit)
            if len(data) != frames.HEADER_SIZE + 4 * h.n_tokens:
                raise frames.FrameError(f"datagram is {len(data)} bytes; n_tokens {h.n_tokens} says "
                                        f"{frames.HEADER_SIZE + 4 * h.n_tokens}")
        except frames.FrameError:
            m.labels(via, "malformed").inc()
            rid = int.from_bytes(data[8:16], "little")
            send(frames.encode_result(rid, frames.FrameErrorCode.MALFORMED, frames.FrameFlag.ERROR | frames.FrameFlag.LAST))
            return
        self.sub.submit(h, frames.tokens_from(memoryview(data)[frames.HEADER_SIZE:]), send, (addr, h.request_id), via)

    def error_received(self, exc: Exception) -> None:  # e.g. ICMP port unreachable from a gone client
        pass


# --------------------------------------------------------------------------------------------------
# entry point


def _warn_exposed(options: ServeOptions) -> None:
    if options.host not in ("127.0.0.1", "localhost", "::1") and not options.api_key:
        print(f"zlc serve: WARNING: listening on {options.host} without --api-key: anyone who can reach "
              "this address can use the model", file=sys.stderr)


async def _serve(bundle: str, options: ServeOptions, announce: Any) -> None:
    server = Server(bundle, options)
    _warn_exposed(options)
    try:
        await server.start()
    except BaseException:
        server.close()
        raise
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.close)
    announce(server)
    try:
        await server.wait_closed()
    finally:
        server.close()


def run(bundle: str, options: ServeOptions, announce: Any = None) -> None:
    """Serves until SIGINT/SIGTERM. Uses uvloop's event loop when it is installed."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(_serve(bundle, options, announce or (lambda s: None)))
    except OSError as e:
        raise ZlcError(f"cannot listen on {options.host}: {e.strerror or e}") from None
