"""`zlc run` and `zlc serve` on a GPU, end to end, against the same bundle on the native CPU kernel.

Prepared here (CPU machine), run on a lent GPU machine (no package registry; zlc installed there
with --no-deps from this checkout, its two missing wheels carried in .whl/):

    python bench/device_serve_check.py --prepare          # here: a tiny chat GGUF -> bench/device_inputs/chat.zlc
    python bench/device_serve_check.py --out "$OUT"       # there: the checks, a report in $OUT/serve_check.md

The bundle is the tiny byte-level chat Llama of the tests (random weights, a tokenizer and the
default chat template from its GGUF), compiled for `cpu` and `h200`: weights are a few MB, so the
real bundle travels (the device bench's models have to make theirs on the device). Its text is
noise; what is checked is that every path gives the same greedy tokens as the native CPU kernel,
which the CPU tests hold to the reference executor:

1. `zlc run --device cuda` and `--device cpu`: the same text for the same prompt.
2. `zlc serve --device cuda`: N concurrent streaming OpenAI chat requests (real HTTP clients, one
   thread each) each get the text `zlc serve --device cpu` gives the same request.
3. `zlc serve --devices cuda:0`: the same, through the engine pool.
Exit 0 when all agree, 1 when one differs or fails (the report says which).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / "bench" / "device_inputs" / "chat.zlc"
PROMPTS = ["Hello there", "What is the capital of France?", "Tell me a story", "abc", "The quick brown fox",
           "1 2 3 4", "zlc on a GPU", "one more"]
MAX_TOKENS = 24


def prepare() -> None:
    from zlc.testing.families import hf_model
    from zlc.testing.gguf_files import write_gguf

    BUNDLE.parent.mkdir(parents=True, exist_ok=True)
    gguf = write_gguf(hf_model("llama-chat"), BUNDLE.parent / "chat.gguf", tokenizer=True)
    subprocess.run([sys.executable, "-m", "zlc.cli", "compile", str(gguf), "--target", "cpu", "--target", "h200",
                    "--max-seq", "256", "-o", str(BUNDLE)], check=True)
    print(f"wrote {BUNDLE}: carry bench/device_inputs/chat.zlc and .whl (httptools, orjson for cp312)")


def zlc_run(device: str, prompt: str) -> str:
    r = subprocess.run([sys.executable, "-m", "zlc.cli", "run", str(BUNDLE), "--device", device, "--prompt", prompt,
                        "--max-new-tokens", str(MAX_TOKENS)], capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise RuntimeError(f"zlc run --device {device}: exit {r.returncode}: {r.stderr.strip()[-400:]}")
    return r.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat(port: int, model: str, prompt: str) -> str:
    """One streaming OpenAI chat request; the concatenated content deltas."""
    body = json.dumps({"model": model, "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


def served(args: list[str], prompts: list[str]) -> tuple[list[str], float]:
    """Starts `zlc serve BUNDLE *args`, sends every prompt at once, returns the texts and the wall time."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "zlc.cli", "serve", str(BUNDLE), "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read() if proc.stdout else ""
                raise RuntimeError(f"zlc serve {' '.join(args)} did not come up: {out.strip()[-600:]}")
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        t = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda p: chat(port, model, p), prompts))
        return texts, time.perf_counter() - t
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def check(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# zlc run / zlc serve on the GPU against the native CPU kernel", ""]
    ok = True

    def note(name: str, good: bool, detail: str) -> None:
        nonlocal ok
        ok &= good
        lines.append(f"- {'ok' if good else 'DIFFERS'}: {name}: {detail}")
        print(lines[-1], flush=True)

    for prompt in PROMPTS[:2]:
        try:
            a, b = zlc_run("cuda", prompt), zlc_run("cpu", prompt)
            note(f"zlc run {prompt!r}", a == b, f"cuda {a.strip()[-80:]!r}; cpu {b.strip()[-80:]!r}")
        except Exception as exc:  # noqa: BLE001 - reported, the other checks still run
            note(f"zlc run {prompt!r}", False, f"{type(exc).__name__}: {exc}")
    try:
        want, t_cpu = served(["--device", "cpu", "--threads", "2"], PROMPTS)
        lines.append(f"- cpu server: {len(PROMPTS)} concurrent streams in {t_cpu:.2f} s; characters per answer "
                     f"{[len(w) for w in want]}; the first: {want[0][:60]!r}")
        if not all(want):
            note("zlc serve --device cpu (the expected texts)", False, "an empty answer: nothing to compare")
        for args in (["--device", "cuda"], ["--devices", "cuda:0"]):
            try:
                got, t = served(args, PROMPTS)
                same = sum(g == w for g, w in zip(got, want, strict=True))
                note(f"zlc serve {' '.join(args)}", same == len(PROMPTS),
                     f"{same}/{len(PROMPTS)} streams equal the cpu server's text; {len(PROMPTS)} concurrent streams "
                     f"in {t:.2f} s")
            except Exception as exc:  # noqa: BLE001
                note(f"zlc serve {' '.join(args)}", False, f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001
        note("zlc serve --device cpu (the expected texts)", False, f"{type(exc).__name__}: {exc}")
    (out / "serve_check.md").write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--prepare", action="store_true", help="build the bundle here (CPU machine)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    a = ap.parse_args()
    if a.prepare:
        prepare()
        return 0
    return check(a.out)


if __name__ == "__main__":
    sys.exit(main())
