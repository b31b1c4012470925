"""`zlc serve`: one asyncio process of ingress (HTTP with the Anthropic and OpenAI APIs, binary token
frames over TCP and UDP, /health, /metrics) in front of the engine process that owns the executor.

    client ─HTTP/frames─▶ ingress: parse (httptools, C) → JSON (orjson, Rust) → tokenize (tokenizers,
    Rust) → request ring (C) ─▶ engine ─▶ result ring (C) → detokenize → SSE/frames ─▶ client

Per request, Python runs only the glue between those compiled parts; nothing else (no framework,
no middleware, no thread hop) sits between the socket and the ring.

This module is the server's life and its routes: start-up (refusing unprotected frame ports),
each request's API object (api_of: picked once, asked by everything after), /health, /metrics,
/v1/models, the chat page at / (chat.html, package data), and the graceful drain on SIGTERM. The generation path is generate.py, binary frames
frame_ingress.py, the engine's supervision supervisor.py.

Drain (SIGTERM/SIGINT): the listening sockets close (new connections are refused), /health and new
requests on open connections answer 503, the requests in flight run on for up to
``drain_timeout_s``; those still running then end with the API's error (event), and the process
exits 0. A second signal ends the wait at once.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from zlc.errors import ZlcError
from zlc.runtime.batch import default_max_batch

from ..constraints import Grammars
from ..protocol import EngineError
from . import frame_auth
from .api_anthropic import ANTHROPIC
from .api_common import Api, ApiError
from .api_completions import COMPLETIONS
from .api_openai import OPENAI
from .devices import Device, parse_devices
from .engine_client import EngineClient
from .frame_ingress import FrameConnection, FrameDatagram
from .generate import error_response, generate
from .http import HttpConnection, HttpLimits, HttpRequest, serve_http
from .metrics import ServerMetrics
from .pool import EnginePool
from .supervisor import EngineSupervisor, RestartPolicy, step_deadline_s

ARCHITECTURE = "zero-layer-v1"
APIS: tuple[Api, ...] = (ANTHROPIC, OPENAI, COMPLETIONS)
# The generation paths, each in its own API; any other path answers in the API its headers name.
GENERATION: dict[bytes, Api] = {b"/v1/messages": ANTHROPIC, b"/v1/chat/completions": OPENAI,
                                b"/v1/completions": COMPLETIONS}
# The chat page's own scripts and styles are inline; it may talk to this server only (no CDN, no
# third-party script even if model text ever reached the DOM as markup).
PAGE_HEADERS = (b"content-security-policy: default-src 'none'; script-src 'unsafe-inline'; "
                b"style-src 'unsafe-inline'; connect-src 'self'; base-uri 'none'; form-action 'none'\r\n"
                b"x-content-type-options: nosniff\r\ncache-control: no-cache\r\n")


@functools.cache
def chat_page() -> bytes:
    """The chat page (GET /): read once from the package."""
    from importlib.resources import files

    return files(__package__).joinpath("chat.html").read_bytes()


def api_of(req: HttpRequest) -> Api:
    """The API a request is answered in, errors included: its generation path's; elsewhere
    Anthropic's when it sends anthropic-version (Anthropic's SDK always does), OpenAI's otherwise."""
    return GENERATION.get(req.path) or (ANTHROPIC if b"anthropic-version" in req.headers else OPENAI)


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None  # default: the bundle's model name
    device: str = "auto"  # cuda when there is a GPU the bundle has a cubin for, else the native CPU kernel
    devices: str | None = None  # several engines, one per device ("cpu:0-1,cpu:2-3"; devices.py); None: one on device
    frame_port: int | None = None  # TCP binary frames (None: off, 0: any free port)
    udp_port: int | None = None  # UDP binary frames
    max_queue: int = 32  # requests waiting in the engine before new ones get "overloaded"
    spin_us: float = 0.0  # the engine polls its ring this long before sleeping (for isolated cores)
    threads: int | None = None  # the executor's CPU threads per engine (None: 1, or a --devices part's core count)
    max_batch: int | None = None  # sequences an engine runs side by side (None: batch.default_max_batch)
    kv_pages: int | None = None  # the engine's KV budget in pages (None: max_batch full contexts)
    prefill_chunk: int = 64  # prompt tokens prefilled per step (TTFT vs inter-token latency)
    prefix_cache_pages: int | None = None  # pages the prefix cache keeps (None: the backend's default; 0: off)
    limits: HttpLimits = field(default_factory=HttpLimits)
    frame_timeout_s: float = 5.0  # a partial TCP frame older than this closes the connection
    xdp: str | None = None  # attach the bundle's XDP program to this interface (needs udp_port)
    drain_timeout_s: float = 30.0  # SIGTERM: how long requests in flight may still run
    step_deadline_s: float | None = None  # None: supervisor.step_deadline_s(device)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    insecure_frames: bool = False  # frame ports beyond loopback without --api-key
    metrics_public: bool = False  # /metrics without the key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    def __init__(self, bundle_path: str, options: ServeOptions | None = None):
        from zlc.runtime.loader import load

        from .prompts import PromptEncoder

        self.options = o = options or ServeOptions()
        self.bundle = load(bundle_path)
        self.model = o.model_name or self.bundle.name
        self.max_seq = self.bundle.max_seq
        self.tokenizer = self.bundle.tokenizer
        self.encoder = (PromptEncoder(self.tokenizer, self.max_seq, self.bundle.vocab) if self.tokenizer is not None
                        else None)
        self.grammars = self._grammars()
        self.frame_key = frame_auth.key_bytes(o.api_key) if o.api_key else None
        self.engine = self._engines(o)
        self.metrics = ServerMetrics(self.engine)
        self.per_api = {api.name: self.metrics.for_api(api.name) for api in APIS}
        self.extra_headers = f"x-zlc-architecture: {ARCHITECTURE}\r\nserver: zlc\r\n".encode()
        self.connections: set[HttpConnection] = set()
        self.frame_connections: set[FrameConnection] = set()
        self.tokenizing: set[Any] = set()  # generate.HttpGeneration: requests whose prompt is being tokenized
        self.servers: list[Any] = []
        self.udp: asyncio.DatagramTransport | None = None
        self.addresses: dict[str, Any] = {}
        self.xdp: Any = None
        self.draining = False
        self.failure: str | None = None  # set when the engine cannot be kept alive: exit non-zero
        self._stop_now: asyncio.Event | None = None
        self._closed: asyncio.Event | None = None

    def _grammars(self) -> Grammars | None:
        """The tokenizer for llguidance, built now (0.7-1.7 s for a 49k vocabulary, holding the GIL: at
        start, not on the first response_format request); None serves without constrained decoding."""
        try:
            return Grammars.of_bundle(self.bundle)
        except Exception as e:
            print(f"zlc serve: no constrained decoding: llguidance cannot load the tokenizer: {e}", file=sys.stderr)
            return None

    def _engines(self, o: ServeOptions) -> EnginePool:
        """One supervised engine per device (--devices), or the one on --device."""
        devices = [Device(o.device)] if o.devices is None else parse_devices(o.devices)
        # a bad --threads or GPU index is refused before any engine starts
        threads = [d.threads(o.threads) for d in devices]
        envs = [d.env() for d in devices]
        supervisors = []
        for i, (d, n, env) in enumerate(zip(devices, threads, envs, strict=True)):
            # "auto" is cuda or cpu: the deadline is the one of the device the engine will run
            kind = self.bundle.resolve_device(d.kind) if d.kind == "auto" else d.kind
            batch = o.max_batch or default_max_batch(self.bundle, kind, prefill_chunk=o.prefill_chunk,
                                                     kv_pages=o.kv_pages)
            supervisors.append(EngineSupervisor(
                functools.partial(EngineClient, str(self.bundle.path), d.kind, max_queue=o.max_queue,
                                  max_prompt=self.max_seq,
                                  spin_us=o.spin_us, threads=n, max_batch=batch, kv_pages=o.kv_pages,
                                  prefill_chunk=o.prefill_chunk, prefix_cache_pages=o.prefix_cache_pages,
                                  cpus=d.cores, env=env),
                step_deadline_s=o.step_deadline_s or step_deadline_s(kind), policy=o.restart,
                on_give_up=self._give_up, on_restart=functools.partial(self._count_restart, i),
                name=d.label if len(devices) > 1 else None))
        return EnginePool(devices, supervisors)

    def _count_restart(self, engine: int, kind: str) -> None:
        self.engine.count_restart(engine, kind)

    # -- lifetime

    def check_exposure(self) -> None:
        o = self.options
        frames_on = o.frame_port is not None or o.udp_port is not None
        exposed = o.xdp is not None or not is_loopback(o.host)
        if frames_on and exposed and not o.api_key and not o.insecure_frames:
            where = f"interface {o.xdp} (XDP)" if o.xdp is not None else o.host
            raise ZlcError(f"frame ports on {where} without --api-key: anyone who reaches them could use the "
                           "model; set --api-key (frames then authenticate with it) or pass --insecure-frames")
        if o.xdp is not None and o.udp_port is None:
            raise ZlcError("--xdp needs --udp-port: frames the program passes on, and all replies, use that "
                           "socket")

    async def start(self) -> None:
        self.check_exposure()
        loop = asyncio.get_running_loop()
        self._stop_now, self._closed = asyncio.Event(), asyncio.Event()
        await self.engine.start()
        o = self.options
        http = await serve_http(loop, self.handle, o.host, o.port, o.limits, self.extra_headers, self.connections)
        self.servers.append(http)
        self.addresses["http"] = http.sockets[0].getsockname()[:2]
        if o.frame_port is not None:
            tcp = await loop.create_server(lambda: FrameConnection(self), o.host, o.frame_port,
                                           reuse_address=True)
            self.servers.append(tcp)
            self.addresses["frames_tcp"] = tcp.sockets[0].getsockname()[:2]
        if o.udp_port is not None:
            transport, proto = await loop.create_datagram_endpoint(lambda: FrameDatagram(self),
                                                                   local_addr=(o.host, o.udp_port))
            self.udp = transport
            self.addresses["frames_udp"] = transport.get_extra_info("sockname")[:2]
            if o.xdp is not None:
                self._attach_xdp(loop, proto, self.addresses["frames_udp"][1])

    def _attach_xdp(self, loop: asyncio.AbstractEventLoop, udp: FrameDatagram, port: int) -> None:
        from .xdp import XdpIngress

        obj = self.bundle.path / "deploy" / "ebpf" / "zlc_xdp.o"
        xdp = XdpIngress(obj, str(self.options.xdp), port, lambda frame, addr: udp.handle(frame, addr, "xdp"))
        self.xdp = xdp
        loop.add_reader(xdp.epoll_fd, xdp.consume)
        self.metrics.watch_xdp(xdp.stats)
        self.addresses["xdp"] = [str(self.options.xdp), port]

    def stop(self) -> None:
        """SIGTERM/SIGINT: the first starts the drain, a second ends its wait."""
        if self._stop_now is None:
            return
        if self.draining:
            self._stop_now.set()
            return
        self.draining = True
        asyncio.get_running_loop().create_task(self._drain())

    def _give_up(self, why: str) -> None:
        self.failure = why
        self.draining = True
        asyncio.get_running_loop().create_task(self._shutdown())

    @property
    def in_flight(self) -> int:
        return self.engine.in_flight + len(self.tokenizing)

    async def _drain(self) -> None:
        t0 = time.monotonic()
        self.engine.restart_enabled = False  # an engine lost now ends its requests; no new one
        for s in self.servers:
            s.close()  # listening sockets: new connections are refused from here on
        for c in list(self.connections):
            c.drain()
        n = self.in_flight
        print(f"zlc serve: shutting down: {n} request(s) in flight get up to {self.options.drain_timeout_s:g} s "
              "to finish (--drain-timeout)", file=sys.stderr, flush=True)
        assert self._stop_now is not None
        deadline = t0 + self.options.drain_timeout_s
        while self.in_flight and not self._stop_now.is_set() and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self._stop_now.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
        ended = len(self.tokenizing)
        for p in list(self.tokenizing):
            p.fail(self.unavailable())
        ended += self.engine.fail_all(EngineError.UNAVAILABLE)
        if ended:
            print(f"zlc serve: {ended} request(s) still running ended with an error", file=sys.stderr, flush=True)
        await self._shutdown()
        print(f"zlc serve: stopped after {time.monotonic() - t0:.2f} s", file=sys.stderr, flush=True)

    async def _shutdown(self) -> None:
        """Closes everything (connections after what they were sent is out) and the engine."""
        for s in self.servers:
            s.close()
        for c in list(self.connections):
            c.close()
        for f in list(self.frame_connections):
            f.close()
        if self.xdp is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.xdp.epoll_fd)
            except RuntimeError:
                pass
            self.xdp.close()  # detaches the program
            self.xdp = None
        await asyncio.sleep(0)  # let the transports flush the last error events
        if self.udp is not None:
            self.udp.close()
        await self.engine.close()
        if self._closed is not None:
            self._closed.set()

    async def wait_closed(self) -> None:
        assert self._closed is not None
        await self._closed.wait()

    # -- what the request paths share

    @property
    def accepting(self) -> bool:
        return self.engine.up and not self.draining

    def unavailable(self) -> ApiError:
        """The 503 for a request the engine cannot take now (or did not finish), saying why."""
        if self.draining:
            return ApiError("api_error", "the server is shutting down; retry on another instance", status=503,
                            retry_after=1)
        return ApiError("api_error", f"the engine is not available ({self.engine.reason}); retry shortly",
                        status=503, retry_after=self.engine.retry_after_s())

    def check_accepting(self) -> None:
        if not self.accepting:
            raise self.unavailable()

    def id_headers(self, reply_id: str) -> bytes:
        return b"request-id: " + reply_id.encode() + b"\r\nx-request-id: " + reply_id.encode() + b"\r\n"

    def authorized(self, req: HttpRequest) -> bool:
        key = self.options.api_key
        if not key:
            return True
        given = req.headers.get(b"x-api-key")
        if given is None:
            auth = req.headers.get(b"authorization", b"")
            given = auth[7:] if auth[:7].lower() == b"bearer " else b""
        return hmac.compare_digest(given, key.encode())

    # -- HTTP routing

    def handle(self, req: HttpRequest, conn: HttpConnection) -> Callable[[], None] | None:
        """Answers `req`, or starts to: then returns the request's cancel (http.Handler)."""
        api = api_of(req)
        try:
            return self._route(req, conn, api)
        except Exception as e:  # a bug: answered in the API's shape, the traceback logged once
            import traceback

            traceback.print_exc()
            if conn.active is req and not conn.streaming:
                error_response(conn, api, ApiError("api_error", f"internal error: {type(e).__name__}"))
            return None

    def _route(self, req: HttpRequest, conn: HttpConnection, api: Api) -> Callable[[], None] | None:
        if req.path not in GENERATION:
            self._answer(req, conn, api)
            return None
        if req.method != b"POST":
            error_response(conn, api, ApiError("invalid_request_error", "use POST", status=405),
                           b"allow: POST\r\n")
            return None
        return generate(self, req, conn, api)

    def _answer(self, req: HttpRequest, conn: HttpConnection, api: Api) -> None:
        """Every route but generation: answered at once."""
        path, method = req.path, req.method
        if path == b"/health":
            return self._health(conn)
        if path == b"/" and method == b"GET":  # no key needed: the page asks for one if /v1/models does
            return conn.respond(200, chat_page(), b"text/html; charset=utf-8", PAGE_HEADERS)
        if path == b"/metrics":
            if not self.options.metrics_public and not self.authorized(req):
                return error_response(conn, api, ApiError("authentication_error", "/metrics needs the API key "
                                                          "(x-api-key or Authorization: Bearer)"))
            return conn.respond(200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
        if path in (b"/v1/models", b"/v1/models/" + self.model.encode()):
            if not self.authorized(req):
                return error_response(conn, api, ApiError("authentication_error", "invalid x-api-key"))
            created = int(os.path.getmtime(self.bundle.path / "manifest.json"))
            single = path != b"/v1/models"
            return conn.respond(200, api.models(self.model, created, self.max_seq, single=single))
        route = f"{method.decode()} {path.decode(errors='replace')}"
        return error_response(conn, api, ApiError("not_found_error", f"no route for {route}"))

    def _health(self, conn: HttpConnection) -> None:
        e = self.engine
        status = ("draining" if self.draining else "ok" if e.up
                  else "engine_failed" if e.state == "failed" else "engine_restarting")
        body: dict[str, Any] = {"status": status, "model": self.model,
                                "device": self.options.devices or self.options.device,
                                "in_flight": self.in_flight, "capacity": e.capacity, "architecture": ARCHITECTURE,
                                "engine_restarts": e.restarts}
        if len(e.engines) > 1:
            body["engines"] = e.engine_health()
        if status != "ok":
            body["reason"] = "the server is shutting down" if self.draining else e.reason
        conn.respond(200 if status == "ok" else 503, orjson.dumps(body),
                     headers=b"" if status == "ok" else b"retry-after: %d\r\n" % e.retry_after_s())


# --------------------------------------------------------------------------------------------------
# entry point


def _warn_exposed(options: ServeOptions) -> None:
    if not is_loopback(options.host) and not options.api_key:
        print(f"zlc serve: WARNING: listening on {options.host} without --api-key: anyone who can reach "
              "this address can use the model", file=sys.stderr)


async def _serve(bundle: str, options: ServeOptions, announce: Any) -> None:
    server = Server(bundle, options)
    server.check_exposure()
    _warn_exposed(options)
    try:
        await server.start()
    except BaseException:
        await server._shutdown()
        raise
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    announce(server)
    await server.wait_closed()
    if server.failure is not None:
        raise ZlcError(f"{server.failure}; exiting so that the service manager restarts zlc serve")


def run(bundle: str, options: ServeOptions, announce: Any = None) -> None:
    """Serves until SIGINT/SIGTERM (then drains). Uses uvloop's event loop when it is installed."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(_serve(bundle, options, announce or (lambda s: None)))
    except OSError as e:
        raise ZlcError(f"cannot listen on {options.host}: {e.strerror or e}") from None
