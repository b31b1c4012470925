"""HTTP/1.1 on asyncio with httptools (the llhttp parser Node.js uses, in C; uvicorn uses it too):
keep-alive, pipelining (requests on one connection answered in order), chunked streaming for SSE,
and the limits a public endpoint needs: header size, body size (413), a deadline for a request to
arrive completely (slowloris: 408 and close), and an idle keep-alive timeout.

What RFC 9110/9112 ask of a server that llhttp leaves to its user: ``Expect: 100-continue`` gets
its ``100 Continue`` (once the earlier responses on the connection are out), any other expectation
417; a transfer coding other than a lone ``chunked`` gets 501; an ``Upgrade`` request is served as
if it had no Upgrade header (a server may ignore it) and the connection then closes, since llhttp
hands over the bytes after its head as another protocol's. ``drain()`` lets a connection finish
what it is answering and close instead of waiting for another request (graceful shutdown).

The application sees an ``HttpRequest`` and answers through the ``HttpConnection``: ``respond()``
for a whole body, or ``write_stream()`` calls for a stream (the last with ``end=True``). Exactly one
response per request; the next pipelined request is dispatched when it ends. A handler that has not
answered yet when it returns hands back what to call if the client goes away first (its request's
cancel); the connection keeps it until the response ends and is the only one to call or drop it.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httptools

REASONS = {100: b"Continue", 200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden",
           404: b"Not Found", 405: b"Method Not Allowed", 408: b"Request Timeout", 413: b"Payload Too Large",
           417: b"Expectation Failed", 431: b"Request Header Fields Too Large", 429: b"Too Many Requests",
           500: b"Internal Server Error", 501: b"Not Implemented", 503: b"Service Unavailable", 529: b"Overloaded"}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@dataclass
class HttpLimits:
    max_header_bytes: int = 32 * 1024
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 10.0  # from a request's first byte to its last
    keepalive_timeout_s: float = 60.0  # idle connection between requests
    max_pipelined: int = 16  # parsed requests waiting behind an active one before reading pauses


@dataclass(slots=True)
class HttpRequest:
    method: bytes
    path: bytes
    headers: dict[bytes, bytes]  # lower-case names; a repeated header keeps the last value
    body: bytes
    keep_alive: bool
    http10: bool
    t_ns: int  # time.monotonic_ns() when the request was complete


# handler(request, connection) -> what to call if the client goes away before the answer is complete
Handler = Callable[[HttpRequest, "HttpConnection"], Callable[[], None] | None]


class HttpConnection(asyncio.Protocol):
    """One client connection. ``handler(request, connection)`` is called once per request; it
    returns the request's cancel, or None."""

    def __init__(self, handler: Handler, limits: HttpLimits,
                 extra_headers: bytes = b"", on_close: Callable[[HttpConnection], None] | None = None):
        self.handler = handler
        self.limits = limits
        self.extra_headers = extra_headers
        self.on_close = on_close
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.loop = asyncio.get_running_loop()
        self.queue: collections.deque[HttpRequest] = collections.deque()
        self.active: HttpRequest | None = None
        self.streaming = False
        self.closed = False
        self._cancel: Callable[[], None] | None = None  # the active request's, while its answer runs
        self._timer: asyncio.TimerHandle | None = None
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._in_message = False
        self._paused = False
        self._in_head = False  # between a message's first byte and its headers' end
        self._head_raw = 0  # bytes received for that head (after the read it began in)
        self._error_after: tuple[int, bytes] | None = None  # a parse error owed after earlier answers
        self._codings: list[bytes] = []  # Transfer-Encoding values of the message being parsed
        self._continue_owed = False  # Expect: 100-continue, to send once earlier answers are out
        self._upgrade = False  # the message asked for an Upgrade: answered as plain HTTP, then closed
        self._upgrade_req: HttpRequest | None = None  # an Upgrade request whose body is still arriving
        self._upgrade_need = 0
        self.draining = False

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not an asyncio subclass)
        self._arm(self.limits.keepalive_timeout_s, self._idle_timeout)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self._error_after is not None:
            return
        if self._upgrade:  # past an Upgrade request's head: only its body is still ours
            self._upgrade_body(data)
            return
        i, piece = 0, data
        try:
            # httptools buffers a header line until it ends, unseen by on_header: bound the bytes of
            # a head still arriving here (fed in slices, so a big read is counted to within a slice)
            step = 16 * 1024
            for i in range(0, len(data), step):
                piece = data[i:i + step] if len(data) > step else data
                self.parser.feed_data(piece)
                if self._in_head:
                    self._head_raw += len(piece)
                    if self._head_raw > 2 * self.limits.max_header_bytes + step:
                        self._fail_and_close(431, b"request headers are too large")
                        return
                if self.closed or self._error_after is not None:
                    return
        except httptools.HttpParserUpgrade as e:
            self._upgrade_body(data[i + int(e.args[0]):])
        except httptools.HttpParserError as e:
            if not self.closed:
                self._fail_and_close(400, f"malformed HTTP request: {e}".encode())

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        if self._cancel is not None:
            cancel, self._cancel = self._cancel, None
            cancel()
        if self.on_close is not None:
            self.on_close(self)

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self._in_message = True
        self._in_head, self._head_raw = True, 0
        self._url, self._headers, self._header_bytes = b"", {}, 0
        self._body, self._body_bytes = [], 0
        if self.active is None and not self.queue:
            self._arm(self.limits.request_timeout_s, self._request_timeout)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_header(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header(len(name) + len(value))
        lower = name.lower()
        self._headers[lower] = value
        if lower == b"transfer-encoding":
            self._codings += [c.strip().lower() for c in value.split(b",") if c.strip()]

    def _count_header(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self.limits.max_header_bytes:
            self._fail_and_close(431, b"request headers are too large")
            raise httptools.HttpParserError("headers too large")  # stop parsing this buffer

    def on_body(self, body: bytes) -> None:
        self._continue_owed = False  # the client did not wait for it
        self._body_bytes += len(body)
        if self._body_bytes > self.limits.max_body_bytes:
            self._fail_and_close(413, f"request body exceeds {self.limits.max_body_bytes} bytes".encode())
            raise httptools.HttpParserError("body too large")
        self._body.append(body)

    def on_headers_complete(self) -> None:
        self._in_head = False
        codings, self._codings = self._codings, []
        if codings and codings != [b"chunked"]:
            self._fail_and_close(501, b"transfer coding " + b", ".join(codings)
                                 + b" is not supported (only chunked)")
            raise httptools.HttpParserError("unsupported transfer coding")
        length = self._headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            self._fail_and_close(413, f"request body exceeds {self.limits.max_body_bytes} bytes".encode())
            raise httptools.HttpParserError("body too large")
        if self.parser.should_upgrade():
            self._upgrade = True
            if codings:
                self._fail_and_close(400, b"an Upgrade request with a chunked body is not supported")
                raise httptools.HttpParserError("chunked upgrade")
            self._upgrade_need = int(length) if length is not None and length.isdigit() else 0
        expect = self._headers.get(b"expect")
        if expect is not None:
            if expect.strip().lower() != b"100-continue":
                self._fail_and_close(417, b"the only expectation supported is 100-continue")
                raise httptools.HttpParserError("expectation failed")
            if self.parser.get_http_version() != "1.0":
                self._continue_owed = True
                self._send_continue()

    def on_message_complete(self) -> None:
        self._in_message = False
        self._continue_owed = False
        req = HttpRequest(self.parser.get_method(), self._url.split(b"?", 1)[0], self._headers,
                          b"".join(self._body), self.parser.should_keep_alive() and not self._upgrade,
                          self.parser.get_http_version() == "1.0", time.monotonic_ns())
        if self._upgrade and self._upgrade_need:  # llhttp stops at the head: the body comes to _upgrade_body
            self._upgrade_req = req
            return
        self._accept(req)

    def _accept(self, req: HttpRequest) -> None:
        if self.active is None:
            self._disarm()
            self._dispatch(req)
        else:
            self.queue.append(req)
            if len(self.queue) >= self.limits.max_pipelined and not self._paused and self.transport:
                self.transport.pause_reading()
                self._paused = True

    def _upgrade_body(self, data: bytes) -> None:
        """Bytes after an Upgrade request's head: its Content-Length body, then nothing we read."""
        req = self._upgrade_req
        if req is None:
            return
        take = data[:self._upgrade_need - len(req.body)]
        req.body += take
        if len(req.body) >= self._upgrade_need:
            self._upgrade_req = None
            req.t_ns = time.monotonic_ns()
            self._accept(req)

    def _send_continue(self) -> None:
        """100 Continue for the message being received, unless answers to earlier ones are still
        going out (then _finish sends it when they are)."""
        if self._continue_owed and self.active is None and not self.queue and self.transport is not None:
            self._continue_owed = False
            self.transport.write(CONTINUE)

    def drain(self) -> None:
        """Graceful shutdown: an idle connection closes now; a busy one after its current answers."""
        self.draining = True
        if self.active is None and not self.queue and not self._in_message:
            self.close()

    # -- dispatch and responses

    def _dispatch(self, req: HttpRequest) -> None:
        self.active = req
        try:
            cancel = self.handler(req, self)
        except Exception as e:  # a bug in a handler must not kill the connection silently
            import traceback

            traceback.print_exc()
            if self.active is req and not self.streaming:
                self.respond(500, b'{"type":"error","error":{"type":"api_error","message":"internal error: '
                             + type(e).__name__.encode() + b'"}}')
            return
        if self.active is req:  # not answered yet (an answer may already have dispatched the next request)
            self._cancel = cancel

    def _head(self, status: int, content_type: bytes, keep_alive: bool, length: int | None) -> bytes:
        h = [b"HTTP/1.1 ", str(status).encode(), b" ", REASONS.get(status, b"Unknown"), b"\r\ncontent-type: ",
             content_type, b"\r\n", self.extra_headers]
        if length is not None:
            h += [b"content-length: ", str(length).encode(), b"\r\n"]
        if not keep_alive:
            h.append(b"connection: close\r\n")
        return b"".join(h)

    def respond(self, status: int, body: bytes, content_type: bytes = b"application/json",
                headers: bytes = b"") -> None:
        """The whole response to the active request."""
        req = self.active
        if req is None or self.transport is None or self.closed:
            return
        keep = self._keep(req)
        self.transport.write(self._head(status, content_type, keep, len(body)) + headers + b"\r\n" + body)
        self._finish(keep)

    def write_stream(self, data: bytes, *, end: bool = False, headers: bytes = b"") -> None:
        """`data` on the active request's SSE stream in one transport write: the response head
        (200, `headers` added) goes in front of the first, the terminating chunk after the last
        (end=True)."""
        req = self.active
        if req is None or self.transport is None or self.closed:
            return
        out = b""
        if not self.streaming:
            self.streaming = True
            out = self._head(200, b"text/event-stream", self._keep(req) and not req.http10, None)
            out += b"cache-control: no-cache\r\n" + headers
            out += b"\r\n" if req.http10 else b"transfer-encoding: chunked\r\n\r\n"
        if data:
            out += self._chunk(data)
        if end:
            if not req.http10:
                out += b"0\r\n\r\n"
            self.transport.write(out)
            self.streaming = False
            self._finish(self._keep(req) and not req.http10)
        else:
            self.transport.write(out)

    def _keep(self, req: HttpRequest) -> bool:
        """Keep the connection after this response? Not when draining, unless requests that came
        in before the drain still wait behind it (they are answered, the last with a close)."""
        return req.keep_alive and (not self.draining or bool(self.queue))

    def _chunk(self, data: bytes) -> bytes:
        assert self.active is not None
        if self.active.http10:
            return data
        return b"%x\r\n%b\r\n" % (len(data), data)

    def _finish(self, keep_alive: bool) -> None:
        self.active = None
        self._cancel = None
        if not keep_alive:
            self.close()
            return
        if self.queue:
            self._dispatch(self.queue.popleft())
            return
        if self._error_after is not None:
            self._write_error_and_close(*self._error_after)
            return
        if self.draining and not self._in_message:
            self.close()
            return
        self._send_continue()
        if self._paused and self.transport is not None:
            self.transport.resume_reading()
            self._paused = False
        if self._in_message:
            self._arm(self.limits.request_timeout_s, self._request_timeout)
        else:
            self._arm(self.limits.keepalive_timeout_s, self._idle_timeout)

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self._disarm()
            self.transport.close()

    # -- errors and timers

    def _fail_and_close(self, status: int, message: bytes) -> None:
        """An error for a request that cannot be parsed or accepted; the connection then closes
        (the stream position is no longer trustworthy)."""
        if self.closed or self.transport is None or self._error_after is not None:
            return
        if self.active is not None:  # answers owed to earlier requests go first; read no more
            self._error_after = (status, message)
            if not self._paused:
                self.transport.pause_reading()
                self._paused = True
            return
        self._write_error_and_close(status, message)

    def _write_error_and_close(self, status: int, message: bytes) -> None:
        assert self.transport is not None
        kind = {400: b"invalid_request_error", 408: b"timeout_error", 413: b"request_too_large",
                431: b"request_too_large"}.get(status, b"invalid_request_error")
        body = b'{"type":"error","error":{"type":"' + kind + b'","message":' + _json_str(message) + b"}}"
        self.transport.write(self._head(status, b"application/json", False, len(body)) + b"\r\n" + body)
        self.close()

    def _arm(self, seconds: float, fn: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, fn)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _request_timeout(self) -> None:
        self._timer = None
        if self.active is None:
            self._fail_and_close(408, b"the request did not arrive completely in time")

    def _idle_timeout(self) -> None:
        self._timer = None
        if self.active is None and not self._in_message:
            self.close()


def _json_str(message: bytes) -> bytes:
    import orjson

    return orjson.dumps(message.decode("utf-8", "replace"))


def serve_http(loop: asyncio.AbstractEventLoop, handler: Handler, host: str, port: int, limits: HttpLimits,
               extra_headers: bytes = b"", connections: set[HttpConnection] | None = None) -> Any:
    """``loop.create_server`` for HttpConnection (a coroutine to await)."""

    def factory() -> HttpConnection:
        conn = HttpConnection(handler, limits, extra_headers,
                              on_close=(connections.discard if connections is not None else None))
        if connections is not None:
            connections.add(conn)
        return conn

    return loop.create_server(factory, host, port, reuse_address=True, backlog=1024)
