"""A minimal HTTP/1.1 client over a raw socket for the serve tests (pipelining needs one buffer
across responses), and the request/response helpers the HTTP tests share."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

from serve_helpers import closed_within

MODEL = "llama-chat"
TIMEOUT_S = 10.0  # bound on any single socket wait

PATHS = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions", "completions": "/v1/completions"}
USER = [{"role": "user", "content": "hi"}]


# --------------------------------------------------------------------------------------------------
# a minimal HTTP/1.1 client over a raw socket (pipelining needs one buffer across responses)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Wire:
    """One TCP connection; ``response()`` reads exactly one response (content-length, chunked, or
    close-delimited), leaving what follows in the buffer."""

    def __init__(self, server: Any, timeout: float = TIMEOUT_S):
        self.sock = socket.create_connection((server.host, server.port), timeout=timeout)
        self.buf = bytearray()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("the server closed the connection")
        self.buf += data

    def until(self, sep: bytes) -> bytes:
        """The bytes up to `sep` (consumed with it)."""
        while (i := self.buf.find(sep)) < 0:
            self._more()
        out = bytes(self.buf[:i])
        del self.buf[:i + len(sep)]
        return out

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def response(self) -> Response:
        head = self.until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        version, status, *_ = head[0].split(" ", 2)
        assert version == "HTTP/1.1", head[0]
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            body = self._exact(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            parts = []
            while (size := int(self.until(b"\r\n").split(b";")[0], 16)) > 0:
                parts.append(self._exact(size))
                assert self._exact(2) == b"\r\n"
            self.until(b"\r\n")  # no trailers
            body = b"".join(parts)
        else:
            while True:
                try:
                    self._more()
                except EOFError:
                    break
            body, self.buf = bytes(self.buf), bytearray()
        return Response(int(status), headers, body)

    def closed_within(self, seconds: float) -> bool:
        """True if the server closes the connection within `seconds` (what it sends before is dropped)."""
        return closed_within(self.sock, seconds)


def http_request(method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None, *,
                 chunked: bool = False) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    h = {"content-type": "application/json"} if body is not None else {}
    h.update(headers or {})
    lines += [f"{k}: {v}" for k, v in h.items()]
    if body is not None and chunked:
        lines.append("Transfer-Encoding: chunked")
        step = 1000
        payload = b"".join(b"%x\r\n%b\r\n" % (len(body[i:i + step]), body[i:i + step])
                           for i in range(0, len(body), step)) + b"0\r\n\r\n"
    elif body is not None:
        lines.append(f"Content-Length: {len(body)}")
        payload = body
    else:
        payload = b""
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def post(api: str, body: Any, headers: dict[str, str] | None = None) -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http_request("POST", PATHS[api], raw, headers)


def exchange(server: Any, data: bytes) -> Response:
    with Wire(server) as w:
        w.send(data)
        return w.response()


def good(api: str = "anthropic", **over: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 2, "messages": USER, **over}


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


def check_error(api: str, r: Response, status: int, kind: str = "invalid_request_error",
                mentions: str | None = None) -> dict[str, Any]:
    """The error response of `api`'s shape; returns its error object."""
    assert r.status == status, (r.status, r.body)
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    if api == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == kind, body
        err = body["error"]
    else:
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == kind, err
    assert isinstance(err["message"], str) and err["message"]
    if mentions is not None:
        assert mentions in err["message"], err
    return dict(err)


