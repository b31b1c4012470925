"""CPU batch-1 latency of zlc's native megakernel against its peers, same machine, same run:
time to first token (TTFT) for a 37-token chat prompt and decode speed over 64 tokens, for
SmolLM2-135M-Instruct, greedy, one request at a time.

    python bench/cpu_decode.py                       # every engine, 5 timed rounds each (a few minutes)
    python bench/cpu_decode.py --rounds 9 --threads 2 --json out.json --markdown

Engines, each in its own child process, measured interleaved: after one warm-up round each,
--rounds rounds of every engine in an order that rotates each round, --pause seconds apart (so the
previous engine's threads have stopped spinning), so that the load of a shared machine falls on all
of them alike. A peer whose package is missing is skipped and the table says so:
- zlc native f32 / bf16: bundles compiled here by `zlc compile --dtype fp32|bf16 --tokenizer GGUF`
  (cached in --workdir), run by the native C kernel (`session("cpu", threads=N)`);
- zlc native int8 / int4 / int4:q4_1: the same with `--dtype bf16 --quantize int8|int4|int4:q4_1`
  (Linear matrices and the LM head's copy in GGUF Q8_0 / Q4_0 / Q4_1 blocks, the embedding bf16);
- zlc native gguf: `zlc compile SmolLM2-135M-Instruct.Q4_1.gguf --dtype bf16`, the file's own
  blocks (Q4_1 matrices, the tied head streaming the Q8_0 embedding's blocks, the embedding bf16);
  zlc-gguf-q8_0 the same on SmolLM2-135M-Instruct.Q8_0.gguf, written once into --workdir from the
  Q4_1 file (zlc.testing.gguf_files.requantize_gguf: every block tensor dequantized by gguf and
  quantized to Q8_0 by gguf's quantizer, the metadata copied; the same weights, one file that zlc
  and llama.cpp both read);
- zlc native gguf fast / gguf-q8_0 fast: the same two files compiled with `--numerics fast` (8-bit
  activations, integer dot products; bench/cpu_numerics.py sets exact and fast side by side at
  pp512 / tg128 with their greedy agreement);
- zlc native nbits4: `zlc compile --dtype bf16` of onnxruntime-genai's `-p int4` build of the same
  weights (its MatMulNBits int4 blocks of 32 kept packed as nbits4_b32, the embedding bf16);
- transformers fp32: the GGUF dequantized to an fp32 torch model (zlc.testing.zoo.load_smollm2),
  eager attention, `torch.set_num_threads(N)`, a manual KV-cache loop (no `generate` overhead);
- onnxruntime-genai fp32 / int4: its model builder run offline on the same weights (the dequantized
  model saved as a Hugging Face folder; `-p fp32` / `-p int4`: MatMulNBits, block 32, its CPU
  default accuracy_level 4), CPU provider, intra-op threads N;
- llama.cpp: llama-cpp-python (built from source, see docs/performance.md) on the GGUF itself
  (Q4_1: the file the other engines' weights were dequantized from), n_threads N; llama.cpp-q8_0
  on the Q8_0 file zlc-gguf-q8_0 reads; zlc-gguf-q4_k_m / llama.cpp-q4_k_m on the Q4_K_M file
  llama.cpp's quantizer makes (gguf_file: mostly Q5_0, SmolLM2's widths being no K-quant's).

Every engine gets the same prompt ids (the bundle's chat template) and decodes 64 tokens past EOS
(onnxruntime-genai with min_length, the others by feeding tokens back); "answer = zlc f32" says
whether an engine's greedy tokens begin with zlc f32's answer (its tokens before the end of turn). TTFT is the prompt's
forward pass through the first greedy token; decode tok/s is 64 / the time of the 64 steps after
it. The table shows medians over the rounds.

The floor: bytes one decode step must read (weights in the engine's dtype, from the bundle's
roofline, plus the f32 KV cache at ~70 positions; llama.cpp: the GGUF's size) over this machine's
read bandwidth, measured here with a small C reader (one thread, and --threads threads; before and
after the engines, the better of the two: a busy neighbour only ever lowers it). "of floor"
is the engine's tok/s over the floor's tok/s at the --threads bandwidth. Ratios are peer / zlc bf16
(TTFT: > 1 means zlc is faster; tok/s: < 1 means zlc is faster). With --markdown a second table
sets zlc beside llama.cpp on each GGUF file both ran: zlc's tok/s over llama.cpp's (> 1: zlc
decodes faster), llama.cpp's TTFT over zlc's (> 1: zlc answers sooner), the session start (zlc:
`session()`; llama.cpp: `Llama()`, the file loaded), the resident set after the rounds (VmRSS:
weights mapped from the file count once touched), and the compile time from the GGUF when this
run compiled the bundle.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NEW_TOKENS = 64
ENGINES = ("zlc-f32", "zlc-bf16", "zlc-int8", "zlc-int4", "zlc-q4_1", "zlc-gguf", "zlc-gguf-q8_0", "zlc-gguf-q4_k_m",
           "zlc-gguf-fast", "zlc-gguf-q8_0-fast", "zlc-nbits4", "transformers", "ort-genai", "ort-genai-int4", "llama.cpp", "llama.cpp-q8_0",
           "llama.cpp-q4_k_m")
# zlc engine -> (weight dtype, --quantize; "gguf:FORMAT": the GGUF file of that format itself, "gguf:FORMAT:fast"
# compiled with --numerics fast: 8-bit activations and integer dot products, bench/cpu_numerics.py)
ZLC = {"zlc-f32": ("fp32", None), "zlc-bf16": ("bf16", None), "zlc-int8": ("bf16", "int8"),
       "zlc-int4": ("bf16", "int4"), "zlc-q4_1": ("bf16", "int4:q4_1"), "zlc-gguf": ("bf16", "gguf:q4_1"),
       "zlc-gguf-q8_0": ("bf16", "gguf:q8_0"), "zlc-gguf-q4_k_m": ("bf16", "gguf:q4_k_m"),
       "zlc-gguf-fast": ("bf16", "gguf:q4_1:fast"), "zlc-gguf-q8_0-fast": ("bf16", "gguf:q8_0:fast"),
       "zlc-nbits4": ("bf16", "nbits4")}
# the engines that read a GGUF file, by the file's format; zlc and llama.cpp on one file are compared
GGUF_ENGINES = {"zlc-gguf": "q4_1", "zlc-gguf-q8_0": "q8_0", "zlc-gguf-q4_k_m": "q4_k_m", "llama.cpp": "q4_1",
                "llama.cpp-q8_0": "q8_0", "llama.cpp-q4_k_m": "q4_k_m"}


# ---- machine bandwidth -----------------------------------------------------------------------------

_BW_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
typedef float v __attribute__((vector_size(32)));
static size_t N; static float *buf; static int NT;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void *rd(void *a) {
    long i = (long)a; size_t lo = N * i / NT / 32 * 32, hi = N * (i + 1) / NT / 32 * 32;
    v s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (size_t k = lo; k < hi; k += 32) {
        s0 += *(v *)(buf + k); s1 += *(v *)(buf + k + 8); s2 += *(v *)(buf + k + 16); s3 += *(v *)(buf + k + 24);
    }
    v s = s0 + s1 + s2 + s3;
    return (void *)(long)(s[0] == 12345.0f);
}
int main(int argc, char **argv) {
    NT = atoi(argv[1]); N = (size_t)atol(argv[2]) / 4;
    buf = aligned_alloc(1 << 21, N * 4);
    madvise(buf, N * 4, MADV_HUGEPAGE); /* as zlc's weights: 4 KiB pages cost bandwidth in TLB misses */
    memset(buf, 1, N * 4);
    double best = 0;
    for (int rep = 0; rep < atoi(argv[3]); rep++) {
        pthread_t th[256]; double t = now();
        for (long i = 0; i < NT; i++) pthread_create(&th[i], 0, rd, (void *)i);
        for (int i = 0; i < NT; i++) pthread_join(th[i], 0);
        double gbs = N * 4 / (now() - t) / 1e9; if (gbs > best) best = gbs;
    }
    printf("%.2f\n", best);
    return 0;
}
"""


def read_bandwidth(threads: int, nbytes: int = 1 << 29, reps: int = 7) -> float | None:
    """Best read bandwidth (GB/s) of `threads` threads streaming a 512 MiB buffer, or None (no cc)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "bw.c", Path(d) / "bw"
        src.write_text(_BW_C)
        subprocess.run([cc, "-O2", "-march=native", "-pthread", str(src), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe), str(threads), str(nbytes), str(reps)], capture_output=True, text=True,
                             check=True).stdout
    return float(out.strip())


# ---- the engines (each runs in a child: `--engine NAME`) --------------------------------------------
# An engine is set up once in its child (model load, session) as two calls: prefill() runs the
# prompt and returns the first greedy token, step(token) one decode step. The child then answers
# "round" lines on stdin with one timed round each, so the parent can interleave the engines.

Engine = tuple[Callable[[], int], Callable[[int], int], dict[str, Any]]


def gguf_file(workdir: Path, fmt: str) -> Path:
    """SmolLM2's GGUF in `fmt`: the shipped Q4_1 file, the Q8_0 file requantized from it by gguf, or
    the Q4_K_M file llama.cpp's own quantizer makes from its f32 twin (llama_model_quantize; SmolLM2's
    576 columns are not whole 256-value super-blocks, so llama.cpp falls back for most matrices:
    166 Q5_0, 16 Q4_K, 14 Q6_K, 15 Q8_0). Made once into `workdir` (under a temporary name, then
    renamed: a half-written file never counts)."""
    import gguf

    from zlc.testing import zoo
    from zlc.testing.gguf_files import requantize_gguf

    src = zoo.smollm2_gguf_path()
    if fmt == "q4_1":
        return src
    out = workdir / src.name.replace(".Q4_1.", f".{fmt.upper()}.")
    if out.is_file():
        return out
    tmp = out.with_suffix(".part")
    if fmt == "q4_k_m":
        import ctypes

        import llama_cpp

        f32 = requantize_gguf(src, workdir / "f32.part", gguf.GGMLQuantizationType.F32)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 2
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp's quantizer failed on {f32}")
        f32.unlink()
    else:
        requantize_gguf(src, tmp, gguf.GGMLQuantizationType[fmt.upper()])
    tmp.rename(out)
    return out


def _bundle(workdir: Path, dtype: str, quantize: str | None = None) -> Path:
    import zlc
    from zlc.testing import zoo

    out = workdir / (f"smollm2-{dtype}.zlc" if quantize is None else f"smollm2-{quantize.replace(':', '-')}.zlc")
    if (out / "manifest.json").is_file():
        return out
    t0 = time.perf_counter()
    if quantize is not None and quantize.startswith("gguf:"):  # the file itself: its blocks
        _, fmt, *num = quantize.split(":")
        zlc.compile(gguf_file(workdir, fmt), targets=["cpu"], dtype=dtype, max_seq=512, out=out, verify=False,
                    name="smollm2", numerics=num[0] if num else "exact")
    elif quantize == "nbits4":  # genai's MatMulNBits blocks
        zlc.compile(_genai_model(workdir, "int4") / "model.onnx", targets=["cpu"], dtype=dtype, max_seq=512,
                    tokenizer=zoo.smollm2_gguf_path(), out=out, verify=False, name="smollm2")
    else:
        zlc.compile(zoo.cached_smollm2(), targets=["cpu"], dtype=dtype, max_seq=512,
                    tokenizer=zoo.smollm2_gguf_path(), out=out, verify=False, name="smollm2", quantize=quantize)
    times = workdir / "compile_s.json"  # read back by the table (a later run finds the bundle cached)
    done = json.loads(times.read_text()) if times.is_file() else {}
    done[out.name] = round(time.perf_counter() - t0, 1)
    times.write_text(json.dumps(done, indent=1))
    return out


def prompt_ids(workdir: Path) -> list[int]:
    """The chat prompt's ids by the GGUF's tokenizer and chat template, as every bundle holds them
    (a folder written once, so that no engine needs another engine's bundle for its prompt)."""
    from zlc.runtime.tokenizer import BundleTokenizer, bundle_tokenizer
    from zlc.testing import zoo

    folder = workdir / "tokenizer"
    if not (folder / "tokenizer_config.json").is_file():
        bundle_tokenizer(zoo.smollm2_gguf_path(), folder)
    return list(BundleTokenizer(folder).encode_chat(zoo.SMOLLM2_PROMPT))


def setup_zlc(workdir: Path, engine: str, ids: list[int], threads: int) -> Engine:
    import zlc

    b = zlc.load(_bundle(workdir, *ZLC[engine]))
    t0 = time.perf_counter()
    s = b.session("cpu", threads=threads)
    roof = b.manifest["targets"]["cpu"]["roofline"]

    def prefill() -> int:
        s.reset()
        return s.prefill(ids)[0]

    return prefill, lambda t: s.step(t)[0], {
        "session_start_s": round(time.perf_counter() - t0, 3), "level": s.backend.level,
        "weight_bytes": roof["weight_bytes"], "kv_bytes_per_token": roof["kv_bytes_per_token"]}


def setup_transformers(workdir: Path, ids: list[int], threads: int) -> Engine:
    import torch

    from zlc.testing.smollm2 import load_smollm2

    torch.set_num_threads(threads)
    model, _ = load_smollm2()
    x = torch.tensor([ids])
    state: dict[str, Any] = {}

    @torch.inference_mode()
    def prefill() -> int:
        out = model(x, use_cache=True)
        state["past"] = out.past_key_values
        return int(out.logits[0, -1].argmax())

    @torch.inference_mode()
    def step(tok: int) -> int:
        out = model(torch.tensor([[tok]]), past_key_values=state["past"], use_cache=True)
        state["past"] = out.past_key_values
        return int(out.logits[0, -1].argmax())

    return prefill, step, {}


_GENAI_BUILD = r"""
import sys
hf_dir, out_dir, cache_dir, precision = sys.argv[1:5]
import onnxruntime_genai.models.builder as B
extra = B.parse_extra_options(None, hf_dir, out_dir, precision, "cpu", cache_dir, [])
B.create_model(None, hf_dir, out_dir, precision, "cpu", cache_dir, **extra)
"""


def _save_plain(model: Any, out: Path) -> None:
    """A GGUF-loaded model refuses save_pretrained (it remembers its quantization); the same
    dequantized weights in a fresh model of the same config save as a plain HF folder."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True, strict=False)
    plain.tie_weights()
    plain.save_pretrained(out)


def _genai_model(workdir: Path, precision: str = "fp32") -> Path:
    out = workdir / f"genai-{precision}"
    if (out / "genai_config.json").is_file():
        return out
    from zlc.testing.smollm2 import load_smollm2

    model, tok = load_smollm2()
    with tempfile.TemporaryDirectory() as d:
        hf = Path(d) / "hf"
        _save_plain(model, hf)
        tok.save_pretrained(hf)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        # absolute: the builder runs in the temporary directory, where a relative --workdir (the
        # default) would put the model, deleted with it
        subprocess.run([sys.executable, "-c", _GENAI_BUILD, str(hf), str(out.resolve()), str(Path(d) / "cache"),
                        precision], env=env, check=True, capture_output=True, cwd=d)
    if not (out / "genai_config.json").is_file():
        raise RuntimeError(f"onnxruntime-genai's builder left no genai_config.json in {out}")
    return out


def setup_genai(workdir: Path, ids: list[int], threads: int, precision: str = "fp32") -> Engine:
    import onnxruntime_genai as og

    path = _genai_model(workdir, precision)
    cfg_path = path / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    so = cfg["model"]["decoder"].setdefault("session_options", {})
    so["intra_op_num_threads"], so["inter_op_num_threads"] = threads, 1
    cfg_path.write_text(json.dumps(cfg, indent=1))
    model = og.Model(str(path))
    state: dict[str, Any] = {}

    def nxt() -> int:
        g = state["g"]
        g.generate_next_token()
        return int(g.get_next_tokens()[0])

    def prefill() -> int:
        params = og.GeneratorParams(model)
        n = len(ids) + NEW_TOKENS + 1
        params.set_search_options(do_sample=False, max_length=n, min_length=n)  # past EOS, like the others
        state["g"] = og.Generator(model, params)
        state["g"].append_tokens(ids)  # the prompt's forward pass
        return nxt()  # its greedy token

    # the generator feeds its own last token back; int4 reads its own bytes (the f32 build: zlc f32's)
    info = {"weight_bytes": sum(f.stat().st_size for f in path.glob("model.onnx*"))} if precision != "fp32" else {}
    return prefill, lambda tok: nxt(), info


def setup_llama_cpp(workdir: Path, engine: str, ids: list[int], threads: int) -> Engine:
    from llama_cpp import Llama

    gguf = gguf_file(workdir, GGUF_ENGINES[engine])
    t0 = time.perf_counter()
    llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)
    start = time.perf_counter() - t0
    state: dict[str, Any] = {}

    def prefill() -> int:
        llm.reset()  # else generate() keeps the cached prompt prefix and evaluates one token
        state["gen"] = llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True)
        return int(next(state["gen"]))

    return prefill, lambda tok: int(next(state["gen"])), {"weight_bytes": gguf.stat().st_size,
                                                          "session_start_s": round(start, 3)}


def setup(engine: str, workdir: Path, threads: int) -> Engine:
    ids = prompt_ids(workdir)
    if engine in ZLC:
        return setup_zlc(workdir, engine, ids, threads)
    if engine == "ort-genai-int4":
        return setup_genai(workdir, ids, threads, "int4")
    if engine.startswith("llama.cpp"):
        return setup_llama_cpp(workdir, engine, ids, threads)
    return {"transformers": setup_transformers, "ort-genai": setup_genai}[engine](workdir, ids, threads)


def rss_mb() -> float:
    """This process's resident set now (VmRSS), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1e3
    return 0.0


def child(engine: str, workdir: Path, threads: int) -> None:
    """Sets the engine up, says "ready" (with its facts), then one timed round per "round" line."""
    prefill, step, info = setup(engine, workdir, threads)
    print(json.dumps({"ready": True, **info}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            return
        t0 = time.perf_counter()
        seq = [prefill()]
        t1 = time.perf_counter()
        for _ in range(NEW_TOKENS):
            seq.append(step(seq[-1]))
        t2 = time.perf_counter()
        print(json.dumps({"ttft_ms": round((t1 - t0) * 1e3, 2), "tok_s": round(NEW_TOKENS / (t2 - t1), 2),
                          "tokens": seq[:16], "rss_mb": round(rss_mb(), 1)}), flush=True)


_NEEDS = {"transformers": "transformers", "ort-genai": "onnxruntime_genai", "ort-genai-int4": "onnxruntime_genai",
          "zlc-nbits4": "onnxruntime_genai", "llama.cpp": "llama_cpp", "llama.cpp-q8_0": "llama_cpp",
          "llama.cpp-q4_k_m": "llama_cpp", "zlc-gguf-q4_k_m": "llama_cpp"}  # its file is llama.cpp's quantizer's


class Child:
    """One engine's child process (None when its package is missing or it failed to start)."""

    def __init__(self, engine: str, workdir: Path, threads: int):
        import importlib.util

        self.engine = engine
        self.proc: subprocess.Popen[str] | None = None
        self.result: dict[str, Any] = {}
        mod = _NEEDS.get(engine)
        if mod and importlib.util.find_spec(mod) is None:
            self.result = {"skipped": f"{mod} is not installed"}
            return
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen([sys.executable, __file__, "--engine", engine, "--workdir", str(workdir),
                                      "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        ready = self._line()
        if ready is None:
            self.result = {"skipped": f"failed: {self._error()}"}
            return
        self.result = {k: v for k, v in ready.items() if k != "ready"}
        self.result.update(ttft_ms=[], tok_s=[])

    def _line(self) -> dict[str, Any] | None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return dict(json.loads(line))
        return None

    def _error(self) -> str:
        assert self.proc is not None and self.proc.stderr is not None
        self.proc.wait()
        lines = self.proc.stderr.read().strip().splitlines()
        self.proc = None
        return lines[-1] if lines else "no output"

    def round(self, timed: bool) -> None:
        if self.proc is None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        r = self._line()
        if r is None:
            self.result = {"skipped": f"failed: {self._error()}"}
        elif timed:
            self.result["ttft_ms"].append(r["ttft_ms"])
            self.result["tok_s"].append(r["tok_s"])
            self.result["tokens"] = r["tokens"]
            self.result["rss_mb"] = r["rss_mb"]

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(60)


def measure(engines: list[str], workdir: Path, threads: int, rounds: int, pause_s: float) -> dict[str, Any]:
    """Every engine set up in its child, one warm-up round each, then `rounds` rounds of all of
    them in an order that rotates, `pause_s` apart (an engine's idle threads stop spinning)."""
    children = []
    for name in engines:
        print(f"starting {name} ...", file=sys.stderr)
        children.append(Child(name, workdir, threads))
    try:
        for r in range(rounds + 1):
            k = r % len(children)
            for c in children[k:] + children[:k]:
                time.sleep(pause_s)
                c.round(timed=r > 0)
            print(f"round {r}/{rounds} done", file=sys.stderr)
    finally:
        for c in children:
            c.close()
    return {c.engine: c.result for c in children}


# ---- the table -------------------------------------------------------------------------------------

def _same_answer(tokens: list[int] | None, ref: list[int] | None) -> bool:
    """Whether `tokens` begin with the reference's greedy answer: its tokens before the first end of
    turn (<|im_end|>, id 2); after it every engine continues differently (onnxruntime-genai masks
    EOS to reach 64 tokens)."""
    if not tokens or not ref:
        return False
    answer = ref[:ref.index(2)] if 2 in ref else ref
    return tokens[:len(answer)] == answer


def table(results: dict[str, Any], bw: dict[str, float | None], threads: int) -> str:
    """The docs table: medians, the bandwidth floor, ratios to zlc bf16, token agreement."""
    z = results.get("zlc-bf16", {})
    f32 = results.get("zlc-f32", {})
    kv = int(z.get("kv_bytes_per_token") or f32.get("kv_bytes_per_token") or 0) * 70  # ~70 positions
    bwn = bw.get(f"threads_{threads}") or 0.0
    wdt = {"zlc-f32": "f32", "zlc-bf16": "bf16", "zlc-int8": "Q8_0", "zlc-int4": "Q4_0", "zlc-q4_1": "Q4_1",
           "zlc-gguf": "the GGUF's Q4_1 (+ Q8_0 head)", "zlc-gguf-q8_0": "the Q8_0 GGUF's Q8_0",
           "zlc-gguf-fast": "the GGUF's Q4_1, numerics fast", "zlc-gguf-q8_0-fast": "the Q8_0 GGUF, numerics fast",
           "zlc-nbits4": "genai's int4 (nbits4_b32)", "transformers": "f32", "ort-genai": "f32",
           "ort-genai-int4": "int4 (MatMulNBits b32)", "llama.cpp": "Q4_1", "llama.cpp-q8_0": "Q8_0",
           "zlc-gguf-q4_k_m": "llama.cpp's Q4_K_M mix", "llama.cpp-q4_k_m": "Q4_K_M mix"}
    zt = statistics.median(z["ttft_ms"]) if "ttft_ms" in z else None
    zs = statistics.median(z["tok_s"]) if "tok_s" in z else None
    rows = ["| engine | weights | TTFT p50 | decode p50 | bytes/token | floor | of floor p50 (best) "
            "| TTFT p50 / zlc bf16 | tok/s p50 / zlc bf16 | answer = zlc f32 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in (e for e in ENGINES if e in results):  # the engines this run asked for
        r = results[name]
        if "skipped" in r:
            rows.append(f"| {name} | {wdt[name]} | skipped: {r['skipped']} | | | | | | | |")
            continue
        ttft, tps = statistics.median(r["ttft_ms"]), statistics.median(r["tok_s"])
        wb = r.get("weight_bytes") or f32.get("weight_bytes") or 0  # the f32 peers read zlc f32's bytes
        nbytes = wb + kv
        floor = bwn * 1e9 / nbytes if nbytes and bwn else 0.0
        best = max(r["tok_s"])
        cells = [f"{name}" + (f" ({r['level']})" if r.get("level") else ""), wdt[name],
                 f"{ttft:.1f} ms (best {min(r['ttft_ms']):.1f})", f"{tps:.1f} tok/s (best {best:.1f})",
                 f"{nbytes / 1e6:.0f} MB" if nbytes else "-",
                 f"{floor:.0f} tok/s" if floor else "-", f"{tps / floor:.0%} ({best / floor:.0%})" if floor else "-",
                 f"{ttft / zt:.2f}" if zt else "-", f"{tps / zs:.2f}" if zs else "-",
                 ("yes" if _same_answer(r.get("tokens"), f32.get("tokens")) else "no") if f32.get("tokens") else "-"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def same_file_table(results: dict[str, Any], bw: dict[str, float | None], threads: int,
                    compile_s: dict[str, float]) -> str:
    """zlc beside llama.cpp on each GGUF file both ran: medians, their ratios, bytes per step and the
    floor (each engine's own bytes: zlc's from its roofline, llama.cpp's the file), session start,
    resident set, zlc's compile time from the file (when this workdir compiled it)."""
    bwn = bw.get(f"threads_{threads}") or 0.0
    kv = int(next((r.get("kv_bytes_per_token") for r in results.values() if r.get("kv_bytes_per_token")), 0)) * 70
    rows = ["| file | engine | TTFT p50 | decode p50 | zlc / llama.cpp tok/s | llama.cpp / zlc TTFT | bytes/step "
            "| floor | of floor | session start | RSS | compile from GGUF |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for fmt in ("q4_1", "q8_0", "q4_k_m"):
        z = results.get(next(e for e, f in GGUF_ENGINES.items() if f == fmt and e in ZLC)) or {}
        ll = results.get(next(e for e, f in GGUF_ENGINES.items() if f == fmt and e not in ZLC)) or {}
        if "tok_s" not in z or "tok_s" not in ll:
            continue
        zt, zs = statistics.median(z["ttft_ms"]), statistics.median(z["tok_s"])
        lt, ls = statistics.median(ll["ttft_ms"]), statistics.median(ll["tok_s"])
        bundle = f"smollm2-gguf-{fmt}.zlc"
        for name, r, ttft, tps in (("zlc", z, zt, zs), ("llama.cpp", ll, lt, ls)):
            nbytes = int(r.get("weight_bytes") or 0) + kv
            floor = bwn * 1e9 / nbytes if nbytes and bwn else 0.0
            comp = compile_s.get(bundle) if name == "zlc" else None
            rows.append("| " + " | ".join([
                f"SmolLM2 {fmt.upper()}", name + (f" ({r['level']})" if r.get("level") else ""),
                f"{ttft:.1f} ms", f"{tps:.1f} tok/s", f"{zs / ls:.2f}x" if name == "zlc" else "",
                f"{lt / zt:.2f}" if name == "zlc" else "", f"{nbytes / 1e6:.0f} MB",
                f"{floor:.0f} tok/s" if floor else "-", f"{tps / floor:.0%}" if floor else "-",
                f"{r['session_start_s']:.2f} s" if "session_start_s" in r else "-",
                f"{r['rss_mb']:.0f} MB" if "rss_mb" in r else "-", f"{comp:.0f} s" if comp else "-"]) + " |")
    return "\n".join(rows) if len(rows) > 2 else "(no GGUF file ran on both zlc and llama.cpp)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds between two engines' rounds")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("ZLC_BENCH_DIR", "out/bench-cpu")))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", action="store_true", help="print the docs table")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    if a.engine:
        child(a.engine, a.workdir, a.threads)
        return
    import importlib.util

    for name in a.engines.split(","):
        if name in ZLC and (name not in _NEEDS or importlib.util.find_spec(_NEEDS[name]) is not None):
            _bundle(a.workdir, *ZLC[name])  # compiled before anything is timed
    prompt_ids(a.workdir)  # the tokenizer folder, before the children read it
    bw = {"threads_1": read_bandwidth(1), f"threads_{a.threads}": read_bandwidth(a.threads)}
    print(f"read bandwidth: {bw}", file=sys.stderr)
    load_start = os.getloadavg()  # a shared host: the table's figures are read with these
    results = measure(a.engines.split(","), a.workdir, a.threads, a.rounds, a.pause)
    bw_after = {"threads_1": read_bandwidth(1), f"threads_{a.threads}": read_bandwidth(a.threads)}
    bw = {k: max(v or 0.0, bw_after[k] or 0.0) or None for k, v in bw.items()}  # the better of before/after
    print(f"read bandwidth (best of before and after): {bw}", file=sys.stderr)
    times = a.workdir / "compile_s.json"
    compile_s = json.loads(times.read_text()) if times.is_file() else {}
    report = {"threads": a.threads, "rounds": a.rounds, "bandwidth_gbs": bw, "results": results,
              "compile_s": compile_s, "load_average": {"start": load_start, "end": os.getloadavg()},
              "cpu": next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                           if ln.startswith("model name")), "?")}
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    if a.markdown:
        print(f"load average (1/5/15 min) at the start {load_start}, at the end {os.getloadavg()}")
        print(table(results, bw, a.threads))
        print()
        print(same_file_table(results, bw, a.threads, compile_s))
    else:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
