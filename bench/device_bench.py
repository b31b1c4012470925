"""zlc's CUDA executor against PyTorch on one GPU: correctness first, then latency.

Two halves, one file:

    python bench/device_bench.py --prepare            # HERE (CPU-only machine with the zlc venv)
    python bench/device_bench.py --out "$OUT"         # ON THE DEVICE (bench/device_check.sh)

`--prepare` on a 2-core machine: tiny ~20 s, smollm2-135m ~2.5 min, llama-1b-shape ~4.5 min and
12 GB peak memory (the fp32 module, lowering, packing); it writes ~33 MB in all (every kernel in
its release, debug and trace builds, each with Triton's CUDA 13 cubin and the CUDA 12.9 one).

Why the weights are generated on the device (the simplest honest scheme)
-------------------------------------------------------------------------
Only ~64 MiB travel to the device machine, and it cannot reach a package registry or a model hub.
SmolLM2-135M's bf16 weights are 270 MB (the smallest GGUF of it, Q4_1, is 98 MB) and a model of
Llama-3.2-1B's shape is 2.5 GB in bf16: neither can be carried. So every model here has RANDOM
weights with the real models' SHAPES, defined by a plain-torch Llama (`Llama` below) and a seeded
initialiser (`init_weights`):

- `--prepare` (here) builds each model on the CPU, compiles it with `zlc.compile(module, ...)`
  (the torch.export frontend; cubin for `h200`), then writes a slim copy of the bundle without
  `weights.safetensors` into bench/device_inputs/<model>.zlc/ plus `bench_model.json`: the model
  config, the seed, and a ROLE MAP saying which module parameter (and whether transposed) each
  entry of the manifest's `weights.placement` holds. The role map is found by value matching
  against the freshly packed arenas, so it is exact, not guessed from names. Arena entries that are
  no parameter (rotary tables, folded constants) are carried as `extra.safetensors` (small).
- on the device the same `Llama` is built and `init_weights` fills it with the same seed on the
  GPU; the W/P arenas are assembled from its parameters through the role map, and `CudaBackend`
  receives them directly (`weights=`), skipping the bundle checksums that cover the dropped file.
  The reference and the baselines run that very module, so all of them see identical weights.
  The same-seed weights are not equal to the ones the bundle was compiled with here (CPU vs CUDA
  generators); they need not be: the compiled kernel does not depend on weight values.

What "SmolLM2-135M" means in the table: SmolLM2-135M's architecture (30 layers, hidden 576,
9 heads / 3 KV heads, MLP 1536, vocab 49152, tied embeddings, rope theta 1e5) with random bf16
weights. Latency does not depend on weight values; correctness is checked on these models against
the fp32 reference. "Llama-1B-shape": hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192,
vocab 128256, tied, rope theta 5e5 without Llama-3's rope scaling.

What is measured (on the device, one GPU, one process)
------------------------------------------------------
0. The driver and the cubins, before anything runs: cuDriverGetVersion, and for every cubin the
   bundles carry (decode and prefill kernels; release, debug and trace builds; Triton's CUDA 13
   ptxas and the wheel's CUDA 12.9 one) whether cuModuleLoadData takes it. The executor then
   loads, per kernel, the first cubin the driver takes (the manifest's order) and says which.
   The bundles are compiled with `--debug-waits`, so the first launch of each kernel runs its
   debug build with a host-side deadline (FIRST_LAUNCH_DEADLINE_S): a launch that never finishes
   is reported (which task waits for which event) and the run stops there, instead of hanging
   until the device time is gone.
1. Correctness (before any timing): a 128-token seeded random prompt, prefill + 32 greedy steps.
   Reference: the module in fp32 (weights rounded to bf16 as zlc stores them, fp32 compute, TF32
   off). zlc is teacher-forced with the reference's tokens, so every step's logits are compared:
   `tokens_equal` (zlc's argmax == reference's at every step), the first differing step and the
   reference's top-1/top-2 margin there, and the max abs logit error.
2. Latency: TTFT of the 128-token prompt (wall clock from the call until the greedy token is on the
   host, median of repeats) and per-token decode latency (wall clock per step with the token read
   back, median and p99 over >= 200 steps after the prompt), for
   - zlc: `session.step` per token (one launch + one stream sync per token; CTRL in mapped pinned
     memory), the same with CTRL in device memory (two small copies per step), and `decode_chain`
     (queued launches with kernel-side auto-advance, one sync for all) plus its CUDA-graph variant;
   - PyTorch eager in bf16 with a static KV cache;
   - `torch.compile(mode="reduce-overhead")` (CUDA graphs) of the same step;
   - ONNX Runtime's CUDA provider: reported as unavailable when the installed onnxruntime lacks it
     (the device image's onnxruntime is the CPU build).
2b. Batch sweep (`batch_sweep`): decode steps of B = 1, 4, 16, 64 sequences in one launch
   (runtime/batch.py's TritonBatch on the cuda executor: the prefill kernel over the rows, each
   with its own position and page table over a paged KV cache). Every row is checked against the
   same sequence run alone (prompt + SWEEP_CHECK greedy steps on zlc's single-sequence session,
   the batch teacher-forced with its tokens: logits and argmax per row and step); then the step's
   wall time (median, p99), aggregate tok/s = B / step, the ratio to batch 1 (the issue's aim:
   <= 1.3x at 16, <= 2x at 64 on an H200) and the step with every row's logits copied back.
3. HBM floor: the bytes one zlc decode step reads (manifest roofline: bf16 weights + f32 KV cache at
   the mean context of the timed steps) divided by the device-to-device copy bandwidth measured
   here (bytes read + written / time), and each engine's median / floor.
4. Where the time goes: one warm decode step (and the prompt's prefill) run with the trace build:
   per task its SM and %globaltimer start/end, analysed by zlc.runtime.trace into time per op
   kind, idle time per SM and the critical path (printed, and in device_bench.md), so that a slow
   run explains itself.

The device half needs torch, numpy and NVIDIA's `cuda.bindings` (all in the device image), plus
this repository: zlc is imported from the checkout through a small import shim (no install).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
INPUTS = REPO / "bench" / "device_inputs"
PROMPT_LEN = 128
DECODE_STEPS = 256  # timed decode steps (>= 200)
CHECK_STEPS = 32  # teacher-forced steps compared with the fp32 reference
MAX_SEQ = 512  # PROMPT_LEN + DECODE_STEPS + warm-up fits
SEED = 1234
FIRST_LAUNCH_DEADLINE_S = 20.0  # the debug build's first launch per kernel; its waits time out after 2 s
# every other launch of the untimed phases (correctness, trace): a release build that hangs where
# the debug build did not (a race) is reported too. Timed launches block in cuStreamSynchronize
# (polling would add its sleeps to the latency); there the script's hard limit is the bound.
UNTIMED_DEADLINE_S = 10.0


# ---- the model ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    tied: bool
    rope_theta: float
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @staticmethod
    def named(name: str) -> Config:
        return MODELS[name.split("+")[0]]  # "smollm2-135m+t64k64": the model under a tiling variant


# Tiling variants for a sweep on the device: `--models smollm2-135m+t64k64` prepares the same model
# with these fields of its GPU Tiling replaced (codegen/schedule.tiling_for). Prefill (and batched
# rows) run their Linear as tl.dot tiles of block_t rows x block_n columns x block_kd; the first
# H200 run measured 248 µs per prefill Linear task at 16 x 32 x 32, latency-bound on its ~144
# dependent load rounds, so the sweep tries fewer, larger tiles.
VARIANTS: dict[str, dict[str, int]] = {
    "t32": {"block_t": 32},
    "t64": {"block_t": 64},
    "t32k64": {"block_t": 32, "block_kd": 64},
    "t64k64": {"block_t": 64, "block_kd": 64},  # 2,484 spill stores in the prefill kernel (sm_90)
}


def variant_of(name: str) -> dict[str, int]:
    if "+" not in name:
        return {}
    tag = name.split("+", 1)[1]
    if tag not in VARIANTS:
        raise SystemExit(f"unknown tiling variant '{tag}' in '{name}' (known: {', '.join(VARIANTS)})")
    return VARIANTS[tag]


def model_order(name: str) -> tuple[int, str]:
    return list(MODELS).index(name.split("+")[0]), name


MODELS = {c.name: c for c in (
    Config("tiny", vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, tied=False, rope_theta=10000.0),
    Config("smollm2-135m", vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, mlp=1536, tied=True,
           rope_theta=100000.0),
    Config("llama-1b-shape", vocab=128256, hidden=2048, layers=16, heads=32, kv_heads=8, mlp=8192, tied=True,
           rope_theta=500000.0),
)}


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        d = c.head_dim
        self.input_layernorm = RMSNorm(c.hidden, c.eps)
        self.q_proj = nn.Linear(c.hidden, c.heads * d, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.heads * d, c.hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.eps)
        self.gate_proj = nn.Linear(c.hidden, c.mlp, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.mlp, bias=False)
        self.down_proj = nn.Linear(c.mlp, c.hidden, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c, (B, T, _) = self.c, x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, T, c.heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = attn.shape
        x = x + self.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Stateless (what zlc compiles): HF-style eager attention over the prompt itself."""
        c = self.c
        q, k, v = self.qkv(x, cos, sin)
        rep = c.heads // c.kv_heads
        B, _, T, D = k.shape
        k = k[:, :, None].expand(B, c.kv_heads, rep, T, D).reshape(B, c.heads, T, D)
        v = v[:, :, None].expand(B, c.kv_heads, rep, T, D).reshape(B, c.heads, T, D)
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(D) + mask
        w = torch.softmax(w.float(), dim=-1).to(q.dtype)
        return self.finish(x, torch.matmul(w, v))


class Llama(nn.Module):
    """A minimal Llama: `forward(ids)` is the stateless graph zlc compiles; `run(ids, pos, cache)`
    is the static-KV-cache step the PyTorch baselines and the fp32 reference use."""

    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.eps)
        self.lm_head = None if c.tied else nn.Linear(c.hidden, c.vocab, bias=False)

    def rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=pos.device).float() / c.head_dim))
        f = pos.float()[:, None] * inv[None, :]
        emb = torch.cat((f, f), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)

    def blocks(self) -> list[Block]:
        return list(self.layers)  # type: ignore[arg-type]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        x = self.embed_tokens(ids)
        cos, sin = self.rope(torch.arange(T, device=ids.device), x.dtype)
        mask = torch.full((T, T), float("-inf"), device=ids.device).triu(1).to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.head(x)

    # -- static KV cache (baselines and reference)
    def new_cache(self, max_seq: int, dtype: torch.dtype, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        shape = (c.layers, 1, c.kv_heads, max_seq, c.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def run(self, ids: torch.Tensor, pos: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """ids [1, T] at positions pos [T] (device tensor): writes the cache, returns [T, vocab]."""
        c = self.c
        x = self.embed_tokens(ids)
        cos, sin = self.rope(pos, x.dtype)
        S = kc.shape[3]
        allowed = torch.arange(S, device=ids.device)[None, :] <= pos[:, None]  # [T, S]
        for i, layer in enumerate(self.blocks()):
            q, k, v = layer.qkv(x, cos, sin)
            kc[i].index_copy_(2, pos, k)
            vc[i].index_copy_(2, pos, v)
            a = F.scaled_dot_product_attention(q, kc[i], vc[i], attn_mask=allowed, enable_gqa=c.heads != c.kv_heads)
            x = layer.finish(x, a)
        return self.head(x)[0]


def init_weights(model: Llama, seed: int, device: Any) -> None:
    """Deterministic random weights: N(0, 0.02) matrices and embedding, norms 1 + N(0, 0.1) (not all
    ones, so every parameter is distinguishable by value when the role map is built)."""
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            t = torch.empty(p.shape, dtype=torch.float32, device=device)
            if name.endswith("layernorm.weight") or name == "norm.weight":
                t.normal_(0.0, 0.1, generator=g).add_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=g)
            p.data = t.to(p.dtype)


# ---- zlc from the checkout ---------------------------------------------------------------------------


def import_zlc() -> Any:
    """`import zlc`, or, where the package is not installed (the device machine), the same package
    mapping pyproject declares (compiler/ -> zlc, runtime/ -> zlc.runtime, ...) set up in memory."""
    try:
        import zlc

        return zlc
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location(
        "zlc", REPO / "compiler" / "__init__.py",
        submodule_search_locations=[str(REPO / "compiler"), str(REPO)])  # zlc.ir in compiler/, zlc.runtime at the root
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["zlc"] = mod
    spec.loader.exec_module(mod)
    return mod


# ---- --prepare (the CPU machine) ----------------------------------------------------------------------

SLIM_FILES = ("manifest.json", "tables/gpu.safetensors", "tables/gpu.json")  # plus the target's cubins


def target_cubins(entry: dict[str, Any]) -> list[str]:
    """Every cubin a manifest target carries: decode and prefill kernels, release / debug / trace
    builds, each toolkit's (what the device run may load)."""
    out: list[str] = []
    for kernel in (entry, entry.get("prefill", {})):
        for build in (kernel, kernel.get("debug", {}), kernel.get("trace", {})):
            out += [c["cubin"] for c in build.get("cubins", [])] or ([build["cubin"]] if build.get("cubin") else [])
    return list(dict.fromkeys(out))


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def role_map(model: Llama, placement: list[dict[str, Any]], W: torch.Tensor,
             P: torch.Tensor) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """For each placed constant: the module parameter it holds (as is or transposed), found by
    comparing values with the packed arenas; constants that are no parameter go to `extras`."""
    probe = 64  # a prefix of each layout's values finds the candidate; a full compare confirms it
    index: dict[tuple[str, bytes], list[tuple[str, bool]]] = {}
    params = {n: p.detach() for n, p in model.named_parameters()}
    for n, p in params.items():
        for dt in (W.dtype, P.dtype):
            q = p.to(dt)
            index.setdefault((str(dt), _raw(q.reshape(-1)[:probe])), []).append((n, False))
            if q.dim() == 2:
                index.setdefault((str(dt), _raw(q.t().reshape(-1)[:probe])), []).append((n, True))
    roles, extras = [], {}
    for pl in placement:
        arena = W if pl["arena"] == "W" else P
        n = math.prod(pl["shape"])
        got = arena[pl["offset"]:pl["offset"] + n]
        hit = None
        for name, tr in index.get((str(arena.dtype), _raw(got[:probe])), []):
            q = params[name].to(arena.dtype)
            q = q.t() if tr else q
            if list(q.shape) == pl["shape"] and torch.equal(q.reshape(-1), got):
                hit = (name, tr)
                break
        role = dict(pl)
        if hit is None:
            extras[pl["value"]] = got.clone()
            role["param"] = None
        else:
            role["param"], role["transpose"] = hit
        roles.append(role)
    return roles, extras


def calibrated_prediction(bundle: Path, target: str, context: int) -> dict[str, Any] | None:
    """The calibrated latency model's decode step for this bundle (zlc.kernelmodel, on the CPU at
    --prepare: the device has no zlc), printed beside the measurement; None for a CPU-only bundle."""
    from zlc.bundle import read_manifest
    from zlc.kernelmodel.calibration import calibration
    from zlc.kernelmodel.latency import predict
    from zlc.kernelmodel.sass_map import KernelCode
    from zlc.kernelmodel.task_tables import table_facts
    from zlc.kernelmodel.triton_source import KernelSource

    man = read_manifest(bundle)
    if "cubin" not in man["targets"].get(target, {}):
        return None
    src = KernelSource((bundle / man["kernel"]["source"]).read_text(), man["kernel"]["entry"])
    tf = table_facts(bundle, man["targets"][target]["tiling"], src, man, context)
    p = predict(KernelCode(bundle, target, man, src, kernel="decode"), tf, man, context)
    cal = calibration()
    return {"decode_us": p.us, "context": context, "calibrated": cal is not None,
            "calibration": None if cal is None else vars(cal)}


def prepare(names: list[str], out: Path, max_seq: int, target: str) -> None:
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    zlc = import_zlc()
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"target": target, "max_seq": max_seq, "seed": SEED, "prompt_len": PROMPT_LEN,
                             "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "models": []}
    if (out / "index.json").exists():  # keep models prepared earlier with the same settings
        old = json.loads((out / "index.json").read_text())
        if all(old.get(k) == index[k] for k in ("target", "max_seq", "seed", "prompt_len")):
            index["models"] = [m for m in old["models"] if m["name"] not in names and (out / m["dir"]).is_dir()]
    import dataclasses

    import zlc.codegen.schedule as sched

    plain_tiling = sched.tiling_for
    for name in names:
        cfg = Config.named(name)
        t0 = time.perf_counter()
        overrides = variant_of(name)

        def tiling_for(*args: Any, _o: dict[str, int] = overrides, **kw: Any) -> Any:
            t = plain_tiling(*args, **kw)
            return dataclasses.replace(t, **_o) if _o and t.grid > 0 and t.num_warps > 1 else t  # GPU tilings only

        sched.tiling_for = tiling_for  # build.py imports it at call time
        model = Llama(cfg)
        init_weights(model, SEED, "cpu")
        model.eval()
        example = (torch.randint(0, cfg.vocab, (1, 8), generator=torch.Generator().manual_seed(SEED)),)
        with tempfile.TemporaryDirectory(prefix="zlc-prep-") as tmp:
            full = Path(tmp) / f"{name}.zlc"
            # --debug-waits: the debug and trace builds travel too (the first launches, the trace)
            res = zlc.compile(model, example_inputs=example, targets=[target], out=full, max_seq=max_seq,
                              dtype="bf16", name=name, verify=True, debug_waits=True,
                              progress=lambda st, d, n=name: print(f"  [{n}] {st}: {d}", flush=True))
            man = res.manifest
            tgt = man["targets"][target]
            for kernel in (tgt, tgt["prefill"]):
                for b in (kernel, kernel["debug"], kernel["trace"]):
                    if b.get("fallback_skipped") or (tgt["arch"] >= "sm_90" and len(b["cubins"]) < 2):
                        print(f"  [{name}] WARNING: {b['cubin']} has no CUDA 12 cubin beside it: "
                              f"{b.get('fallback_skipped', 'none built')}", flush=True)
            w = load_file(str(full / man["weights"]["file"]))
            roles, extras = role_map(model, man["weights"]["placement"], w["W"], w["P"])
            missing = [r["value"] for r in roles if r["param"] is None and r["arena"] == "W"]
            slim = out / f"{name}.zlc"
            if slim.exists():
                shutil.rmtree(slim)
            for rel in (*SLIM_FILES, *target_cubins(tgt)):
                (slim / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(full / rel, slim / rel)
        if extras:
            save_file({k: v.contiguous() for k, v in extras.items()}, str(slim / "extra.safetensors"))
            predicted = calibrated_prediction(full, target, int(PROMPT_LEN + WARM_STEPS + DECODE_STEPS / 2))
        info = {"config": asdict(cfg), "seed": SEED, "target": target, "roles": roles,
                "extras": sorted(extras), "verification": man["verification"],
                "roofline": man["targets"][target]["roofline"], "compile_seconds": man["compile_seconds"],
                "predicted": predicted}
        (slim / "bench_model.json").write_text(json.dumps(info, indent=1) + "\n")
        size = sum(p.stat().st_size for p in slim.rglob("*") if p.is_file())
        index["models"].append({"name": name, "dir": slim.name, "bytes": size})
        index["models"].sort(key=lambda m: model_order(m["name"]))
        res_pre = tgt["prefill"].get("resources", {})
        print(f"{name}: prefill kernel {res_pre.get('registers')} registers, {res_pre.get('spill_stores')} spill stores;"
              f" tiling overrides {overrides or 'none'}", flush=True)
        print(f"{name}: {len(roles)} constants, {len(roles) - len(extras)} parameters, extras "
              f"{sorted(extras)} (W entries without a parameter: {missing or 'none'}); "
              f"{size / 1e6:.2f} MB carried; {time.perf_counter() - t0:.0f} s", flush=True)
        del model, w
        (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    sched.tiling_for = plain_tiling
    total = sum(m["bytes"] for m in index["models"])
    if total > 60 * 2 ** 20:
        print(f"WARNING: {total / 2 ** 20:.1f} MiB; the run tool carries 64 MiB in all (prepare fewer models)")
    print(f"wrote {out} ({total / 1e6:.2f} MB): carry it to the device (run's carry: ['bench/device_inputs'])")


# ---- the device half ------------------------------------------------------------------------------------

WARM_STEPS = 8
TTFT_REPS = 10
# The batch sweep (TritonBatch on the cuda executor: one launch of the prefill kernel per step over
# rows of B sequences, a paged KV cache; docs/megakernel.md "Batched steps and the paged KV cache")
BATCH_SIZES = (1, 4, 16, 64)
SWEEP_PROMPT = 64  # tokens of each row's own prompt
SWEEP_CHECK = 4  # decode steps per row compared with the same sequence run alone
SWEEP_STEPS = 32  # timed batched decode steps per batch size (and as many again with every row's logits)
SWEEP_TIE = 1e-3  # an argmax that differs where the alone run's top-2 margin is below this is a tie, not a failure


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def copy_bandwidth(dev: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        dst.copy_(src)
    b.record()
    b.synchronize()
    sec = a.elapsed_time(b) / 1e3 / reps
    del src, dst
    return 2 * nbytes / sec


class Stepper(nn.Module):
    """The model with its static KV cache as buffers (static addresses for CUDA graphs)."""

    kc: torch.Tensor
    vc: torch.Tensor

    def __init__(self, model: Llama, max_seq: int, dtype: torch.dtype, dev: torch.device):
        super().__init__()
        self.model = model
        kc, vc = model.new_cache(max_seq, dtype, dev)
        self.register_buffer("kc", kc)
        self.register_buffer("vc", vc)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.model.run(ids, pos, self.kc, self.vc)[-1]


@dataclass
class Loaded:
    cfg: Config
    info: dict[str, Any]
    manifest: dict[str, Any]
    ref: Llama  # fp32, weights rounded to bf16
    base: Llama  # the same weights in bf16 (the PyTorch baselines)
    sess: Any  # MegakernelSession over CudaBackend
    seconds: float
    slim: Path
    host: dict[str, Any]  # the W/P arenas as host arrays (a second backend reuses them)


def build_models(cfg: Config, seed: int, dev: torch.device) -> tuple[Llama, Llama]:
    """(fp32 reference, bf16 copy) with the seeded weights rounded to bf16, as zlc stores them."""
    import copy

    with torch.device(dev):
        ref = Llama(cfg)
    init_weights(ref, seed, dev)
    with torch.no_grad():
        for p in ref.parameters():
            p.data = p.data.to(torch.bfloat16).float()
    ref.eval()
    return ref, copy.deepcopy(ref).to(torch.bfloat16).eval()


def assemble_arenas(slim: Path, info: dict[str, Any], manifest: dict[str, Any], ref: Llama,
                    dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The W (bf16) and P (f32) arenas from the module's parameters through the role map, plus the
    carried extras (rotary tables); every element must be written exactly once."""
    import numpy as np

    from zlc.runtime.cuda_launch import read_safetensors

    W = torch.zeros(int(manifest["weights"]["W"]["elements"]), dtype=torch.bfloat16, device=dev)
    P = torch.zeros(int(manifest["weights"]["P"]["elements"]), dtype=torch.float32, device=dev)
    params = dict(ref.named_parameters())
    extras: dict[str, torch.Tensor] = {}
    if (slim / "extra.safetensors").exists():
        for k, (dt, arr) in read_safetensors(slim / "extra.safetensors").items():
            t = torch.from_numpy(np.array(arr))
            extras[k] = t.view(torch.bfloat16) if dt == "BF16" else t
    covered = {"W": 0, "P": 0}
    seen: set[tuple[str, int]] = set()
    with torch.no_grad():
        for r in info["roles"]:
            if (r["arena"], r["offset"]) in seen:  # a tied weight: every name is listed at one offset
                continue
            seen.add((r["arena"], r["offset"]))
            arena = W if r["arena"] == "W" else P
            n = math.prod(r["shape"])
            if r["param"] is not None:
                t = params[r["param"]]
                t = t.t() if r["transpose"] else t
            else:
                t = extras[r["value"]].reshape(r["shape"])  # carried flat, as sliced from the arena
            if list(t.shape) != list(r["shape"]):
                raise RuntimeError(f"{slim.name}: {r['value']} is {list(t.shape)}, the placement says {r['shape']}")
            arena[r["offset"]:r["offset"] + n] = t.reshape(-1).to(device=dev, dtype=arena.dtype)
            covered[r["arena"]] += n
    for k, arena in (("W", W), ("P", P)):
        if covered[k] != arena.numel():
            raise RuntimeError(f"{slim.name}: the role map covers {covered[k]} of {arena.numel()} {k} elements")
    return W, P


def load_model(slim: Path, dev: torch.device) -> Loaded:
    t0 = time.perf_counter()
    info = json.loads((slim / "bench_model.json").read_text())
    manifest = json.loads((slim / "manifest.json").read_text())  # no checksums: weights.safetensors was dropped
    cfg = Config(**info["config"])
    ref, base = build_models(cfg, int(info["seed"]), dev)
    W, P = assemble_arenas(slim, info, manifest, ref, dev)
    host = {"W": W.view(torch.int16).cpu().numpy(), "P": P.cpu().numpy()}
    del W, P
    sess = zlc_session(slim, manifest, host, dev, ctrl="mapped")
    torch.cuda.synchronize()
    return Loaded(cfg, info, manifest, ref, base, sess, time.perf_counter() - t0, slim, host)


def zlc_session(slim: Path, manifest: dict[str, Any], host: dict[str, Any], dev: torch.device, ctrl: str) -> Any:
    from zlc.runtime.cuda import CudaBackend
    from zlc.runtime.megakernel import MegakernelSession

    backend = CudaBackend(slim, manifest, device=dev.index or 0, weights=host, ctrl=ctrl,
                          first_launch_deadline_s=FIRST_LAUNCH_DEADLINE_S, deadline_s=UNTIMED_DEADLINE_S)
    return MegakernelSession(backend, chunk=backend.chunk, max_seq=int(manifest["model"]["max_seq"]),
                             vocab=int(manifest["model"]["vocab"]))


def probe_cubins(inputs: Path, index: dict[str, Any], device: int) -> dict[str, Any]:
    """The driver's version and, for every cubin the inputs carry, whether cuModuleLoadData takes
    it (loaded and unloaded again; milliseconds each)."""
    from zlc.runtime.cuda_driver import CudaDriver
    from zlc.runtime.cuda_launch import CudaError, CudaLoadError, cuda_version

    drv = CudaDriver()
    info = drv.open(device)
    out: dict[str, Any] = {"driver_version": drv.driver_version(), "gpu": info.name, "cc": info.cc, "cubins": {}}
    out["driver_cuda"] = cuda_version(out["driver_version"])
    try:
        for m in index["models"]:
            slim = inputs / m["dir"]
            man = json.loads((slim / "manifest.json").read_text())
            t = man["targets"][index["target"]]
            entries = {c["cubin"]: c for kernel in (t, t["prefill"])
                       for b in (kernel, kernel.get("debug", {}), kernel.get("trace", {})) for c in b.get("cubins", [])}
            for rel in target_cubins(t):
                key = f"{m['name']}:{rel}"
                c = entries.get(rel, {})
                try:
                    drv.load_function((slim / rel).read_bytes(), t["metadata"]["name"], 0)
                    res = "loads"
                except CudaLoadError as e:
                    res = e.name
                except (CudaError, OSError) as e:
                    res = f"{type(e).__name__}: {e}"
                out["cubins"][key] = {"result": res, "toolkit": c.get("toolkit"), "ptx_isa": c.get("ptx_isa"),
                                      "min_driver": c.get("min_driver")}
    finally:
        drv.close()
    return out


def trace_step(m: Loaded, prompt: list[int]) -> dict[str, Any]:
    """One warm decode step and the prompt's prefill with the trace build, analysed."""
    from zlc.bundle import MODE_DECODE, MODE_PREFILL
    from zlc.runtime import trace as tr

    be = m.sess.backend
    labels = {}
    try:
        readable = json.loads((m.slim / "tables" / "gpu.json").read_text())
        labels = {mode: tr.readable_labels(readable, mode)[0] for mode in (MODE_PREFILL, MODE_DECODE)}
    except (OSError, ValueError):
        pass
    m.sess.reset()
    tok, _ = m.sess.prefill(prompt)
    for _ in range(3):  # warm: the same step (same token, same position) rewrites the same cache row
        want, _ = be.launch(MODE_DECODE, [tok], len(prompt), False, False)
    got, trace = be.trace_launch(MODE_DECODE, [tok], len(prompt))
    table = tr.table_tasks(be.tasks, MODE_DECODE)
    dec = tr.analyze(table, trace, labels.get(MODE_DECODE))
    _, ptrace = be.trace_launch(MODE_PREFILL, prompt[:be.chunk], 0)
    pre = tr.analyze(tr.table_tasks(be.tasks, MODE_PREFILL), ptrace, labels.get(MODE_PREFILL))
    m.sess.reset()
    from zlc.runtime.trace_terms import format_terms

    return {"token_equal": got == want,
            # the launch's report, then each task's time by term (claim, descriptor, wait, body, signal)
            "decode_report": tr.format_report(dec) + "\n\n" + format_terms(table, trace),
            "prefill_report": tr.format_report(pre, path_rows=8) + "\n\n"
            + format_terms(tr.table_tasks(be.tasks, MODE_PREFILL), ptrace),
            "decode_span_us": dec.span / 1e3, "prefill_span_us": pre.span / 1e3,
            "decode_ops": {k: vars(v) for k, v in dec.ops.items()},
            "decode_idle_us_median": median_or_zero([x.idle for x in dec.sms]) / 1e3,
            "decode_critical_path": {"tasks": len(dec.path),
                                     "dependency_steps": sum(p.after == "dependency" for p in dec.path),
                                     "busy_us": sum(p.busy for p in dec.path) / 1e3,
                                     "by_op_us": {k: v / 1e3 for k, v in dec.path_ops.items()}}}


def median_or_zero(xs: list[int]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


@torch.no_grad()
def check_correctness(m: Loaded, prompt: list[int], steps: int, dev: torch.device) -> dict[str, Any]:
    """Teacher-forced: both see the reference's greedy tokens; every step's logits are compared."""
    kc, vc = m.ref.new_cache(int(m.manifest["model"]["max_seq"]), torch.float32, dev)
    ref_lg = m.ref.run(torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev), kc, vc)[-1]
    m.sess.reset()
    tok, lg = m.sess.prefill(prompt, want_logits=True)
    rows = [(ref_lg.float().cpu(), torch.from_numpy(lg[-1]), tok)]
    for s in range(steps):
        t = int(ref_lg.argmax())
        pos = torch.tensor([len(prompt) + s], device=dev)
        ref_lg = m.ref.run(torch.tensor([[t]], device=dev), pos, kc, vc)[-1]
        tok, lg = m.sess.step(t, want_logits=True)
        rows.append((ref_lg.float().cpu(), torch.from_numpy(lg[-1]), tok))
    max_abs, max_ref, first_diff, margin, self_argmax = 0.0, 0.0, None, None, True
    for i, (r, z, tok) in enumerate(rows):
        max_abs = max(max_abs, float((r - z).abs().max()))
        max_ref = max(max_ref, float(r.abs().max()))
        self_argmax &= int(z.argmax()) == tok
        if first_diff is None and int(r.argmax()) != tok:
            top = r.topk(2).values
            first_diff, margin = i, float(top[0] - top[1])
    return {"steps": len(rows), "tokens_equal": first_diff is None, "first_diff": first_diff,
            "ref_margin_at_diff": margin, "max_abs": max_abs, "max_abs_ref": max_ref,
            "kernel_argmax_matches_its_logits": self_argmax}


def time_zlc(sess: Any, prompt: list[int], n: int, chain: bool = True) -> dict[str, Any]:
    be = sess.backend
    # timed launches block in cuStreamSynchronize; a kernel's first launch (its debug build, in the
    # warm-up below) keeps its own deadline
    be.deadline_s = None
    for _ in range(3):
        sess.reset()
        sess.prefill(prompt)
    ttft = []
    for _ in range(TTFT_REPS):
        sess.reset()
        t = time.perf_counter()
        sess.prefill(prompt)
        ttft.append(time.perf_counter() - t)
    sess.reset()
    tok, _ = sess.prefill(prompt)
    first = tok
    stepped = []
    for _ in range(WARM_STEPS):
        tok, _ = sess.step(tok)
        stepped.append(tok)
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        tok, _ = sess.step(tok)
        lat.append(time.perf_counter() - t)
        stepped.append(tok)
    out: dict[str, Any] = {"ttft": ttft, "decode": lat, "tokens": stepped}
    if not chain:
        return out
    total = WARM_STEPS + n
    t = time.perf_counter()
    chain = be.decode_chain(first, len(prompt), total)
    out["chain_per_token"] = (time.perf_counter() - t) / total
    be.decode_chain(first, len(prompt), total, graph=True)  # capture + first replay
    t = time.perf_counter()
    graph = be.decode_chain(first, len(prompt), total, graph=True)
    out["graph_per_token"] = (time.perf_counter() - t) / total
    out["chain_tokens_equal"] = chain == stepped and graph == stepped
    return out


def time_torch(fn: Any, prompt: list[int], n: int, dev: torch.device, graphs: bool) -> dict[str, Any]:
    """Greedy with the token read back to the host every step (what zlc's step does)."""
    mark = torch.compiler.cudagraph_mark_step_begin if graphs else (lambda: None)
    ids = torch.tensor([prompt], device=dev)
    pos = torch.arange(len(prompt), device=dev)
    one = torch.zeros((1, 1), dtype=torch.long, device=dev)
    p1 = torch.zeros(1, dtype=torch.long, device=dev)
    with torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(3):  # warm-up (and, compiled, the compiles and graph captures)
            mark()
            tok = int(fn(ids, pos).argmax())
            for i in range(3):
                one.fill_(tok)
                p1.fill_(len(prompt) + i)
                mark()
                tok = int(fn(one, p1).argmax())
        warm = time.perf_counter() - t0
        ttft = []
        for _ in range(TTFT_REPS):
            t = time.perf_counter()
            mark()
            tok = int(fn(ids, pos).argmax())
            ttft.append(time.perf_counter() - t)
        lat, toks = [], []
        for i in range(WARM_STEPS + n):
            t = time.perf_counter()
            one.fill_(tok)
            p1.fill_(len(prompt) + i)
            mark()
            tok = int(fn(one, p1).argmax())
            if i >= WARM_STEPS:
                lat.append(time.perf_counter() - t)
            toks.append(tok)
    return {"ttft": ttft, "decode": lat, "tokens": toks, "warmup_seconds": warm}


@torch.no_grad()
def batch_sweep(m: Loaded, dev: torch.device, g: torch.Generator, sizes: tuple[int, ...]) -> dict[str, Any]:
    """Decode steps of B sequences in one launch (TritonBatch over CudaBackend, the prefill kernel)
    for each B in `sizes`: first every row against the same sequence run alone on zlc's
    single-sequence session (its prompt, then SWEEP_CHECK greedy steps, the batch fed the alone
    run's tokens: logits compared per row and step), then the step's wall time (launch, the
    batch block's copy, the kernel, the sync; median and p99 over SWEEP_STEPS steps) without
    logits and with every row's logits copied back (what a serving engine that samples on the
    host pays), and aggregate tokens/s = B / median step."""
    from zlc.runtime.batch import TritonBatch, pages_for

    vocab = m.cfg.vocab
    prompts = [torch.randint(0, vocab, (SWEEP_PROMPT,), generator=g).tolist() for _ in range(max(sizes))]
    alone: list[tuple[list[Any], list[int]]] = []  # per row: logits after the prompt and each step, greedy tokens
    for p in prompts:
        m.sess.reset()
        _, lg = m.sess.prefill(p, want_logits=True)
        lgs, toks = [lg[-1]], []
        for _ in range(SWEEP_CHECK):
            toks.append(int(lgs[-1].argmax()))
            _, lg = m.sess.step(toks[-1], want_logits=True)
            lgs.append(lg[-1])
        alone.append((lgs, toks))
    m.sess.reset()
    ctx = SWEEP_PROMPT + SWEEP_CHECK + WARM_STEPS + 2 * SWEEP_STEPS
    tb = TritonBatch(m.slim, m.manifest, device=f"cuda:{dev.index or 0}", pages=max(sizes) * pages_for(ctx, 16),
                     weights=m.host, first_launch_deadline_s=FIRST_LAUNCH_DEADLINE_S, deadline_s=UNTIMED_DEADLINE_S)
    out: dict[str, Any] = {"max_rows": tb.max_rows, "prompt": SWEEP_PROMPT, "sizes": {}}
    try:
        for b in sizes:
            seqs = [tb.open() for _ in range(b)]
            err, ties = 0.0, 0
            ok_rows = [True] * b

            def check(r: int, got: Any, want: Any, ok_rows: list[bool] = ok_rows) -> None:
                nonlocal err, ties
                e, same, tie = _row_diff(got, want)
                err = max(err, e)
                ties += tie
                ok_rows[r] &= same or tie

            # the prompts, as many whole ones per launch as its rows hold (several sequences' prefill rows)
            r = 0
            while r < b:
                k = max(1, min(b - r, tb.max_rows // SWEEP_PROMPT))
                got = tb.step([(seqs[r + i], prompts[r + i]) for i in range(k)], [True] * k)
                for i in range(k):
                    check(r + i, got[i], alone[r + i][0][0])
                r += k
            for s in range(SWEEP_CHECK):
                got = tb.step([(seqs[r], [alone[r][1][s]]) for r in range(b)], [True] * b)
                for r in range(b):
                    check(r, got[r], alone[r][0][s + 1])
            rows_equal = sum(ok_rows)
            tb.nb.deadline_s = None  # timed steps block in cuStreamSynchronize
            feed = [(seqs[r], [alone[r][1][-1]]) for r in range(b)]
            for _ in range(WARM_STEPS):
                tb.step(feed, [False] * b)
            times: dict[str, list[float]] = {"none": [], "all": []}
            for want in ("none", "all"):
                for _ in range(SWEEP_STEPS):
                    t = time.perf_counter()
                    tb.step(feed, [want == "all"] * b)
                    times[want].append(time.perf_counter() - t)
            tb.nb.deadline_s = UNTIMED_DEADLINE_S
            med = statistics.median(times["none"])
            out["sizes"][str(b)] = {"step_us_median": med * 1e6, "step_us_p99": pct(times["none"], 99) * 1e6,
                                    "tok_s": b / med, "step_us_with_logits": statistics.median(times["all"]) * 1e6,
                                    "rows_equal_alone": rows_equal, "rows": b, "argmax_ties": ties,
                                    "max_abs_logit_err": err}
            print(f"{m.cfg.name} batch {b}: {out['sizes'][str(b)]}", flush=True)
            for q in seqs:
                tb.close(q)
            tb.check_pages()
    finally:
        tb.close_all()
    base = out["sizes"].get("1", {}).get("step_us_median")
    for v in out["sizes"].values():
        v["step_vs_batch1"] = v["step_us_median"] / base if base else None
    out["ok"] = all(v["rows_equal_alone"] == v["rows"] for v in out["sizes"].values())
    return out


def _row_diff(got: Any, want: Any) -> tuple[float, bool, bool]:
    """(max abs logit error, argmax equal, a tie: differs where want's top-2 margin < SWEEP_TIE)."""
    import numpy as np

    e = float(np.abs(got - want).max())
    if int(np.argmax(got)) == int(np.argmax(want)):
        return e, True, False
    top = np.sort(want)[-2:]
    return e, False, bool(top[1] - top[0] < SWEEP_TIE)


def ort_status() -> str:
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    provs = ort.get_available_providers()
    if "CUDAExecutionProvider" not in provs:
        return f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (has {', '.join(provs)})"
    return (f"onnxruntime {ort.__version__} has the CUDA provider, but this script builds no KV-cache "
            "ONNX model for it: not measured")


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    if r.get("ttft"):
        s["ttft_ms"] = statistics.median(r["ttft"]) * 1e3
    if r.get("decode"):
        s["decode_us_median"] = statistics.median(r["decode"]) * 1e6
        s["decode_us_p99"] = pct(r["decode"], 99) * 1e6
        s["decode_us_mean"] = statistics.fmean(r["decode"]) * 1e6
        s["steps"] = len(r["decode"])
    return s


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def write_report(out: Path, res: dict[str, Any]) -> str:
    lines = [f"# zlc on {res['env'].get('gpu', '?')}", ""]
    for key, what in (("stuck", "STOPPED: a launch overran its deadline"), ("killed", "STOPPED at the time limit")):
        if res.get(key):
            lines += [f"**{what}**: {res[key]}", ""]
    env = res["env"]
    lines += [f"torch {env.get('torch')}, CUDA {env.get('cuda')}, {env.get('sms')} SMs, "
              f"copy bandwidth {env.get('copy_gbs', 0):.0f} GB/s (read+write), "
              f"prompt {PROMPT_LEN} tokens, {DECODE_STEPS} timed decode steps after {WARM_STEPS} warm-up", ""]
    lines += ["## Correctness (fp32 reference, teacher-forced)", "",
              "| model | steps | greedy tokens equal | first diff (ref margin) | max abs logit err | max abs logit | kernel argmax = its logits |",
              "|---|---|---|---|---|---|---|"]
    for name, m in res["models"].items():
        c = m.get("correctness")
        if c is None:
            lines.append(f"| {name} | - | {m.get('error', 'not run')} | | | | |")
            continue
        diff = "-" if c["first_diff"] is None else f"{c['first_diff']} ({c['ref_margin_at_diff']:.3g})"
        lines.append(f"| {name} | {c['steps']} | {'yes' if c['tokens_equal'] else 'NO'} | {diff} | "
                     f"{c['max_abs']:.3g} | {c['max_abs_ref']:.3g} | {c['kernel_argmax_matches_its_logits']} |")
    lines += ["", "## Latency", "",
              "| model | engine | TTFT ms (median) | decode µs median | p99 | mean | HBM floor µs | median / floor "
              "| predicted µs (calibrated model, central) | measured / predicted |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in res["models"].items():
        floor = m.get("floor_us")
        pred = ((m.get("predicted") or {}).get("decode_us") or {}).get("central")
        for eng, e in m.get("engines", {}).items():
            if "skipped" in e:
                lines.append(f"| {name} | {eng} | {e['skipped']} | | | | | | | |")
                continue
            med = e.get("decode_us_median") or e.get("per_token_us")
            ratio = f"{med / floor:.2f}" if med and floor else "-"
            # the model prices zlc's decode step (launch and sync included), not the peers
            p = pred if eng.startswith("zlc") else None
            lines.append(f"| {name} | {eng} | {_fmt(e.get('ttft_ms'), '.3f')} | {_fmt(med, '.1f')} | "
                         f"{_fmt(e.get('decode_us_p99'), '.1f')} | {_fmt(e.get('decode_us_mean', med), '.1f')} | "
                         f"{_fmt(floor, '.1f')} | {ratio} | {_fmt(p, '.1f')} | "
                         f"{f'{med / p:.2f}' if med and p else '-'} |")
    sweeps = {n: m["batch_sweep"] for n, m in res["models"].items() if m.get("batch_sweep")}
    if sweeps:
        lines += ["", "## Batch sweep (TritonBatch: B sequences' decode rows in one launch, paged KV cache)", "",
                  f"Each row's own prompt of {SWEEP_PROMPT} tokens; every row checked against the same sequence "
                  "run alone (zlc's single-sequence session, teacher-forced); step = wall time of one batched step "
                  f"(batch block copy, launch, sync), median of {SWEEP_STEPS}.", "",
                  "| model | batch | step µs median | p99 | vs batch 1 | tok/s | step µs with every row's logits | "
                  "rows equal alone | max abs logit err |", "|---|---|---|---|---|---|---|---|---|"]
        for name, sw in sweeps.items():
            if "skipped" in sw or "error" in sw:
                lines.append(f"| {name} | {sw.get('skipped') or sw.get('error')} | | | | | | | |")
                continue
            for b, v in sw["sizes"].items():
                ratio = v.get("step_vs_batch1")
                lines.append(f"| {name} | {b} | {v['step_us_median']:.1f} | {v['step_us_p99']:.1f} | "
                             f"{_fmt(ratio, '.2f')} | {v['tok_s']:.0f} | {v['step_us_with_logits']:.1f} | "
                             f"{v['rows_equal_alone']}/{v['rows']}"
                             + (f" ({v['argmax_ties']} ties)" if v["argmax_ties"] else "")
                             + f" | {v['max_abs_logit_err']:.3g} |")
    drv = res.get("driver")
    if drv:
        lines += ["", "## Driver and cubins", "",
                  f"driver for CUDA {drv.get('driver_cuda')} (cuDriverGetVersion {drv.get('driver_version')}), "
                  f"{drv.get('gpu')} sm_{drv.get('cc')}", "",
                  "| cubin | toolkit | PTX ISA | needs driver | cuModuleLoadData |", "|---|---|---|---|---|"]
        for k, c in drv.get("cubins", {}).items():
            lines.append(f"| {k} | {c.get('toolkit')} | {c.get('ptx_isa')} | {c.get('min_driver')} | {c['result']} |")
        for name, m in res["models"].items():
            for kk, c in (m.get("loaded") or {}).items():
                lines.append(f"\n{name} {kk}: loaded {c.get('cubin')} (toolkit {c.get('toolkit')})"
                             + (f", refused first: {'; '.join(c['refused'])}" if c.get("refused") else ""))
    for name, m in res["models"].items():
        t = m.get("trace")
        if t:
            lines += ["", f"## Where the time goes: {name}", "", "```", t["decode_report"], "", t["prefill_report"], "```"]
    lines += ["", f"ONNX Runtime: {res.get('ort')}", ""]
    lines += ["HBM floor: bytes one zlc decode step reads (bf16 weights + f32 KV cache at the mean context of "
              "the timed steps, from the manifest's roofline) / measured copy bandwidth. zlc chain/graph: "
              "per-token mean of queued launches with one sync (no per-step median).", ""]
    for name, m in res["models"].items():
        if m.get("notes"):
            lines += [f"- {name}: " + "; ".join(m["notes"])]
    text = "\n".join(lines) + "\n"
    (out / "device_bench.md").write_text(text)
    (out / "device_bench.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    return text


def stop_if_stuck(exc: BaseException, out: Path, res: dict[str, Any]) -> None:
    """After a launch overran its deadline a kernel may still be running, and nothing else can use
    the GPU: write the report (it says which task waits for which event) and exit 3 at once, with
    no cleanup (synchronising would wait for the stuck kernel)."""
    if type(exc).__name__ != "CudaTimeout":
        return
    res["stuck"] = f"{res['phase']}: {exc}"
    print(write_report(out, res), flush=True)
    sys.stdout.flush()
    os._exit(3)


def run_device(inputs: Path, out: Path, budget_s: float, models: list[str] | None, device: str = "cuda:0",
               peers: bool = True) -> int:
    start = time.perf_counter()

    def left() -> float:
        return budget_s - (time.perf_counter() - start)

    import_zlc()
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch", file=sys.stderr)
        return 2
    dev = torch.device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prop = torch.cuda.get_device_properties(dev)
    index = json.loads((inputs / "index.json").read_text())
    names = [m["name"] for m in index["models"] if models is None or m["name"] in models]
    res: dict[str, Any] = {"env": {"gpu": prop.name, "sms": prop.multi_processor_count, "torch": torch.__version__,
                                   "cuda": torch.version.cuda, "cc": f"{prop.major}.{prop.minor}"},
                           "models": {n: {"engines": {}, "notes": []} for n in names}, "ort": ort_status(),
                           "phase": "driver probe"}

    def on_term(signum: int, frame: Any) -> None:  # device_check.sh's hard limit: say where it stopped
        res["killed"] = f"after {time.perf_counter() - start:.0f} s, during {res['phase']}"
        write_report(out, res)
        print(f"STOPPED at the time limit during {res['phase']}", flush=True)
        os._exit(124)  # no cleanup: a CUDA call may still be waiting for the GPU

    signal.signal(signal.SIGTERM, on_term)
    # phase 0: which cubins this driver loads (before anything runs on the GPU)
    try:
        res["driver"] = probe_cubins(inputs, index, dev.index or 0)
        d = res["driver"]
        print(f"driver for CUDA {d['driver_cuda']} ({d['driver_version']}); cubins: "
              + ", ".join(f"{k} {v['result']}" for k, v in d["cubins"].items()), flush=True)
    except Exception as exc:  # noqa: BLE001 - the backends still choose (and say why) below
        res["driver"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"driver probe FAILED: {res['driver']['error']}", flush=True)
    bw = copy_bandwidth(dev)
    res["env"]["copy_gbs"] = bw / 1e9
    print(f"{prop.name}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    g = torch.Generator().manual_seed(SEED)
    loaded: dict[str, Loaded] = {}
    prompts: dict[str, list[int]] = {}

    # phase 1: load + correctness, every model (a failure here skips that model's timings)
    for name in names:
        r = res["models"][name]
        res["phase"] = f"{name}: load and correctness"
        try:
            m = load_model(inputs / f"{name}.zlc", dev)
            loaded[name] = m
            prompts[name] = torch.randint(0, m.cfg.vocab, (PROMPT_LEN,), generator=g).tolist()
            r["load_seconds"] = m.seconds
            r["correctness"] = check_correctness(m, prompts[name], CHECK_STEPS, dev)
            rf = m.info["roofline"]
            ctx = PROMPT_LEN + WARM_STEPS + DECODE_STEPS / 2
            r["step_bytes"] = rf["weight_bytes"] + rf["kv_bytes_per_token"] * ctx
            r["floor_us"] = r["step_bytes"] / bw * 1e6
            r["predicted"] = m.info.get("predicted")  # the calibrated model's, made at --prepare
            r["loaded"] = m.sess.backend.loaded
            print(f"{name}: loaded in {m.seconds:.1f} s; cubins {r['loaded']}; {r['correctness']}", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported in the table, the other models still run
            r["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name}: FAILED {r['error']}", flush=True)
            stop_if_stuck(exc, out, res)
    write_report(out, res)

    # the trace of one decode step (and of the prefill) per model: where the time goes
    for name, m in loaded.items():
        r = res["models"][name]
        res["phase"] = f"{name}: trace"
        try:
            r["trace"] = trace_step(m, prompts[name])
            print(f"{name}:\n{r['trace']['decode_report']}\n{r['trace']['prefill_report']}", flush=True)
            if not r["trace"]["token_equal"]:
                r["notes"].append("the trace build's token differs from the release build's")
        except Exception as exc:  # noqa: BLE001
            r["notes"].append(f"trace failed: {type(exc).__name__}: {exc}")
            print(f"{name}: trace FAILED {type(exc).__name__}: {exc}", flush=True)
            stop_if_stuck(exc, out, res)
    write_report(out, res)

    # phase 2: zlc latency; phase 3: PyTorch eager; phase 4: torch.compile (CUDA graphs)
    for name, m in loaded.items():
        r = res["models"][name]
        res["phase"] = f"{name}: zlc timing"
        try:
            z = time_zlc(m.sess, prompts[name], DECODE_STEPS)
            r["engines"]["zlc step"] = summarize(z)
            r["engines"]["zlc chain"] = {"per_token_us": z["chain_per_token"] * 1e6}
            r["engines"]["zlc graph"] = {"per_token_us": z["graph_per_token"] * 1e6}
            if not z["chain_tokens_equal"]:
                r["notes"].append("decode_chain tokens differ from step-by-step tokens")
            r["zlc_tokens"] = z["tokens"]
        except Exception as exc:  # noqa: BLE001
            r["engines"]["zlc step"] = {"skipped": f"failed: {type(exc).__name__}: {exc}"}
            stop_if_stuck(exc, out, res)
        try:  # CTRL in device memory, copied in and out each launch, instead of mapped host memory
            s2 = zlc_session(m.slim, m.manifest, m.host, dev, ctrl="device")
            try:
                z2 = time_zlc(s2, prompts[name], DECODE_STEPS, chain=False)
            finally:
                s2.close()
            r["engines"]["zlc step (ctrl in device memory)"] = summarize(z2)
            if r.get("zlc_tokens") and z2["tokens"] != r["zlc_tokens"]:
                r["notes"].append("ctrl=device tokens differ from ctrl=mapped tokens")
        except Exception as exc:  # noqa: BLE001
            r["engines"]["zlc step (ctrl in device memory)"] = {"skipped": f"failed: {type(exc).__name__}: {exc}"}
            stop_if_stuck(exc, out, res)
        print(f"{name}: zlc {r['engines']}", flush=True)
    write_report(out, res)
    # phase 2b: the batch sweep (batched steps of 1..64 sequences, each row checked against it alone)
    for name, m in loaded.items():
        r = res["models"][name]
        if left() < 90:
            r["batch_sweep"] = {"skipped": f"skipped: {left():.0f} s of budget left"}
            continue
        res["phase"] = f"{name}: batch sweep"
        try:
            r["batch_sweep"] = batch_sweep(m, dev, g, BATCH_SIZES)
        except Exception as exc:  # noqa: BLE001
            r["batch_sweep"] = {"error": f"failed: {type(exc).__name__}: {exc}"}
            print(f"{name}: batch sweep FAILED {r['batch_sweep']['error']}", flush=True)
            stop_if_stuck(exc, out, res)
        write_report(out, res)
    for name, m in loaded.items() if peers else ():
        r = res["models"][name]
        res["phase"] = f"{name}: PyTorch eager timing"
        st = Stepper(m.base, int(m.manifest["model"]["max_seq"]), torch.bfloat16, dev)
        try:
            e = time_torch(st, prompts[name], DECODE_STEPS, dev, graphs=False)
            r["engines"]["torch eager bf16"] = summarize(e)
            if r.get("zlc_tokens") and e["tokens"] != r["zlc_tokens"]:
                same = sum(a == b for a, b in zip(e["tokens"], r["zlc_tokens"], strict=False))
                r["notes"].append(f"eager bf16 greedy tokens differ from zlc's ({same}/{len(e['tokens'])} equal; "
                                  "bf16 compute vs zlc's fp32)")
        except Exception as exc:  # noqa: BLE001
            r["engines"]["torch eager bf16"] = {"skipped": f"failed: {type(exc).__name__}: {exc}"}
        del st
        print(f"{name}: eager {r['engines'].get('torch eager bf16')}", flush=True)
    write_report(out, res)
    # torch.compile costs a minute or more per model: the largest first, the smoke-test model never
    for name in sorted((n for n in loaded if n != "tiny" and peers), key=lambda n: -loaded[n].cfg.hidden * loaded[n].cfg.layers):
        m, r = loaded[name], res["models"][name]
        if left() < 150:
            r["engines"]["torch.compile reduce-overhead"] = {"skipped": f"skipped: {left():.0f} s of budget left"}
            continue
        res["phase"] = f"{name}: torch.compile"
        try:
            st = Stepper(m.base, int(m.manifest["model"]["max_seq"]), torch.bfloat16, dev)
            fn = torch.compile(st, mode="reduce-overhead", fullgraph=True, dynamic=False)
            e = time_torch(fn, prompts[name], DECODE_STEPS, dev, graphs=True)
            r["engines"]["torch.compile reduce-overhead"] = summarize(e)
            r["notes"].append(f"torch.compile warm-up (compiles + captures) {e['warmup_seconds']:.0f} s")
            del fn, st
        except Exception as exc:  # noqa: BLE001
            msg = str(exc).splitlines()[0][:200] if str(exc) else ""
            r["engines"]["torch.compile reduce-overhead"] = {"skipped": f"failed: {type(exc).__name__}: {msg}"}
        print(f"{name}: compiled {r['engines'].get('torch.compile reduce-overhead')}", flush=True)
        write_report(out, res)
    res["phase"] = "closing"
    for m in loaded.values():
        m.sess.close()
    res["seconds"] = time.perf_counter() - start
    print(write_report(out, res), flush=True)
    ok = all(res["models"][n].get("correctness", {}).get("tokens_equal") for n in names)
    ok &= all(res["models"][n].get("batch_sweep", {}).get("ok", True) for n in names)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--prepare", action="store_true", help="compile the bundles here (CPU machine)")
    ap.add_argument("--models", nargs="*", default=None, help=f"subset of {', '.join(MODELS)}")
    ap.add_argument("--inputs", type=Path, default=INPUTS)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/out")))
    ap.add_argument("--max-seq", type=int, default=MAX_SEQ)
    ap.add_argument("--target", default="h200")
    ap.add_argument("--budget-s", type=float, default=420.0, help="device run: stop optional work after this")
    ap.add_argument("--no-peers", action="store_true", help="device run: zlc only (no PyTorch eager / torch.compile)")
    a = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # which cubin each kernel loaded
    if a.prepare:
        prepare(a.models or list(MODELS), a.inputs, a.max_seq, a.target)
        return 0
    return run_device(a.inputs, a.out, a.budget_s, a.models, peers=not a.no_peers)


if __name__ == "__main__":
    sys.exit(main())
