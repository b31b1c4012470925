"""`zlc serve`: a compiled bundle behind the Anthropic Messages and OpenAI chat APIs, plus binary
token frames over TCP/UDP (and XDP); the server itself is zlc.runtime.serve."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from .common import cli, err_console


@cli.command()
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path), metavar="BUNDLE")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (elsewhere than loopback: set --api-key).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="HTTP port (0: any free port, printed at start).")
@click.option("--api-key", envvar="ZLC_API_KEY", default=None,
              help="Require this key (x-api-key or Authorization: Bearer). Env: ZLC_API_KEY.")
@click.option("--model-name", default=None, help="The name clients must send as `model` "
              "(default: the bundle's model name).")
@click.option("--device", type=click.Choice(["auto", "cpu", "interpret", "cuda", "reference"]), default="auto",
              show_default=True,
              help="Executor: auto = cuda when there is a GPU the bundle has a cubin for, else cpu; cpu = the "
              "native C megakernel; interpret = the Triton kernel in Triton's interpreter; cuda = its cubin; "
              "reference = the bundle's IR with torch on the CPU.")
@click.option("--devices", "devices", metavar="SPEC", default=None,
              help="Run one engine per device behind this one server, each request routed to the least "
              "loaded engine, preferring the one that last served its prompt's prefix: cpu:0-1,cpu:2-3 (native "
              "engines on those cores), cuda:0,cuda:1 (one per GPU), reference:0,reference:1. --max-batch, "
              "--kv-pages, --threads... apply to each engine [default: one engine on --device].")
@click.option("--frame-port", type=click.IntRange(0, 65535), default=None,
              help="Also accept binary token frames over TCP on this port (docs/frames.md).")
@click.option("--udp-port", type=click.IntRange(0, 65535), default=None,
              help="Also accept binary token frames over UDP on this port.")
@click.option("--xdp", "xdp", metavar="IFACE", default=None,
              help="Attach the bundle's XDP program (deploy/ebpf/zlc_xdp.o) to IFACE: UDP frames to "
              "--udp-port go through a BPF ring buffer; root needed (docs/deployment.md).")
@click.option("--max-queue", type=click.IntRange(min=1), default=32, show_default=True,
              help="Requests waiting beyond the batch: an engine takes --max-batch + --max-queue requests in flight, "
              "and answers one more at once with an overload error (529 / 429, Retry-After).")
@click.option("--max-body", type=click.IntRange(min=1024), default=4 * 1024 * 1024, show_default=True,
              help="Largest request body in bytes (413 beyond).")
@click.option("--request-timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds a request may take to arrive completely (408 and close beyond).")
@click.option("--spin-us", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Microseconds the engine polls the request ring before it sleeps: lower wake-up "
              "latency for a core that does nothing else (an isolated serving core); 0 sleeps at once.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads of each engine's executor (reference/cpu devices): raise for big models on many "
              "cores; 1 keeps small models' latency steady [default: 1; with --devices, each part's core count].")
@click.option("--max-batch", type=click.IntRange(min=1), default=None,
              help="Requests the engine runs side by side (continuous batching): each step gives every "
              "running one its next token. More shortens the wait under load and, on cpu (the native kernel's "
              "batched step: one launch for all rows), raises throughput; each step gets longer. Executors "
              "without a batched step (interpret, reference, cuda) hold a session per running request "
              "[default: per executor, measured with bench/serve_load.py: on cpu the kernel's rows per step "
              "less a prefill chunk (64 for max_seq >= 128), elsewhere 8; at most --kv-pages].")
@click.option("--kv-pages", type=click.IntRange(min=1), default=None,
              help="The engine's KV cache budget in pages of 16 tokens; when a step needs more, the youngest request is preempted and recomputed "
              "later [default: --max-batch full contexts of the bundle's max_seq].")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=64, show_default=True,
              help="Prompt tokens prefilled per step, between the running requests' tokens: larger gives a "
              "new request its first token sooner, smaller keeps the running ones' inter-token time steady.")
@click.option("--prefix-cache-pages", type=click.IntRange(min=0), default=None,
              help="The most KV pages (of 16 tokens) the shared-prefix cache keeps after their requests end, "
              "evicted least recently used; a prompt starting with cached pages prefills only the rest. "
              "0 turns prefix reuse off (executors without a batched step reuse per session, any other "
              "value keeps that on) [default on cpu: 256 MiB of pages].")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM: seconds requests in flight may still run (no new connections, /health 503) "
              "before the rest end with an error and the server exits 0.")
@click.option("--step-deadline", type=click.FloatRange(min=0.1), default=None,
              help="Seconds one engine step (a prefill or a token) may take before the engine counts as hung: "
              "its requests end with an error and it is restarted [default: 30 on cuda, 300 on cpu and "
              "reference, 600 on interpret].")
@click.option("--restart-limit", type=click.IntRange(min=1), default=5, show_default=True,
              help="Engine failures (exits, hangs, failed restarts) within --restart-window after which the "
              "server gives up and exits 1, for systemd / Kubernetes to replace it.")
@click.option("--restart-window", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds over which --restart-limit counts failures.")
@click.option("--insecure-frames", is_flag=True,
              help="Allow frame ports (--frame-port/--udp-port/--xdp) beyond loopback without --api-key.")
@click.option("--metrics-public", is_flag=True, help="Serve /metrics without the API key when --api-key is set.")
def serve(bundle: Path, host: str, port: int, api_key: str | None, model_name: str | None, device: str,
          devices: str | None, frame_port: int | None, udp_port: int | None, xdp: str | None, max_queue: int,
          max_body: int, request_timeout: float, spin_us: float, threads: int | None, max_batch: int | None,
          kv_pages: int | None, prefill_chunk: int, prefix_cache_pages: int | None, drain_timeout: float,
          step_deadline: float | None,
          restart_limit: int, restart_window: float, insecure_frames: bool, metrics_public: bool) -> None:
    """Serve a compiled BUNDLE: the Anthropic Messages API (POST /v1/messages) and OpenAI's chat
    completions (POST /v1/chat/completions), both with SSE streaming; GET /v1/models, /health,
    /metrics (Prometheus); binary token frames over TCP/UDP with --frame-port/--udp-port.

    Runs until Ctrl-C / SIGTERM, then drains (--drain-timeout). The engine (one process owning the
    executor) and this ingress talk through shared-memory rings; an engine that exits or hangs is
    restarted (docs/serving.md). With --api-key, frames authenticate too (docs/frames.md)."""
    from zlc.runtime.serve.ingress.devices import parse_devices
    from zlc.runtime.serve.ingress.http import HttpLimits
    from zlc.runtime.serve.ingress.server import ServeOptions
    from zlc.runtime.serve.ingress.server import run as run_server
    from zlc.runtime.serve.ingress.supervisor import RestartPolicy

    if devices is not None:
        if click.get_current_context().get_parameter_source("device") != click.core.ParameterSource.DEFAULT:
            raise click.UsageError("give --device or --devices, not both")
        for d in parse_devices(devices):  # a bad SPEC (or --threads for it) is refused before loading
            d.threads(threads)
            d.env()
    opts = ServeOptions(host=host, port=port, api_key=api_key or None, model_name=model_name, device=device,
                        devices=devices,
                        frame_port=frame_port, udp_port=udp_port, xdp=xdp, max_queue=max_queue, spin_us=spin_us,
                        threads=threads, max_batch=max_batch, kv_pages=kv_pages, prefill_chunk=prefill_chunk,
                        prefix_cache_pages=prefix_cache_pages,
                        limits=HttpLimits(max_body_bytes=max_body, request_timeout_s=request_timeout),
                        drain_timeout_s=drain_timeout, step_deadline_s=step_deadline,
                        restart=RestartPolicy(limit=restart_limit, window_s=restart_window),
                        insecure_frames=insecure_frames, metrics_public=metrics_public)
    err = err_console()
    on = devices or device
    err.print(f"[dim]zlc serve: loading {escape(str(bundle))} on {escape(on)}…[/]")

    def announce(server: Any) -> None:
        a = server.addresses
        http_host, http_port = a["http"]
        parts = [f"http://{http_host}:{http_port}"]
        if "frames_tcp" in a:
            parts.append(f"frames tcp {a['frames_tcp'][1]}")
        if "frames_udp" in a:
            parts.append(f"frames udp {a['frames_udp'][1]}")
        if "xdp" in a:
            parts.append(f"XDP on {a['xdp'][0]}")
        # one machine-readable line on stdout (scripts and tests wait for it), the rest on stderr
        click.echo(json.dumps({"event": "listening", "model": server.model, "device": on,
                               **{k: list(v) for k, v in a.items()}}), nl=True)
        sys.stdout.flush()
        clients = [e.client for e in server.engine.engines if e.client is not None]
        if clients:  # the batch the default chose (per executor), and what admission takes
            parts.append(f"batch {clients[0].max_batch}, capacity {server.engine.capacity} requests")
        err.print(f"zlc serve: {escape(server.model)} on {escape(on)}: " + ", ".join(parts))

    run_server(str(bundle), opts, announce)
