"""Peak memory of `zlc compile DIR` on a Hugging Face checkpoint directory (issue 33's aim: peak
RSS <= 1.5x the weights' bytes), and where it goes.

    python bench/hf_dir_memory.py                          # a random bf16 Llama, ~250 MB of weights
    python bench/hf_dir_memory.py --dtype float32 --layers 4

Writes a random-weight Llama-shaped checkpoint (config.json + model.safetensors, written tensor
by tensor with safetensors; no transformers model is built), then compiles it for --target cpu
in a child process (`zlc.compile`, verification included) and reads the child's peak resident
set (getrusage RUSAGE_CHILDREN, ru_maxrss: file-backed pages of the mapped weights count too).
The child also records its resident set (VmRSS) and high-water mark (VmHWM) at the start of
each compile stage, so the table says which stage raised the peak. A second child only imports
zlc, torch and transformers: the interpreter's baseline, which the ratio leaves in. Output is
markdown, ready for docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_checkpoint(d: Path, dtype: str, layers: int, hidden: int, ffn: int, vocab: int, seed: int = 0) -> int:
    """A random Llama checkpoint at `d`; returns the weights' bytes."""
    import torch
    from safetensors.torch import save_file

    heads, kv_heads = hidden // 64, max(1, hidden // 256)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": 64, "vocab_size": vocab, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
           "torch_dtype": dtype}
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)

    def m(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) * k ** -0.5).to(dt)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": m(vocab, hidden), "lm_head.weight": m(vocab, hidden),
                                  "model.norm.weight": torch.ones(hidden, dtype=dt)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": m(heads * 64, hidden), p + "self_attn.k_proj.weight": m(kv_heads * 64, hidden),
              p + "self_attn.v_proj.weight": m(kv_heads * 64, hidden), p + "self_attn.o_proj.weight": m(hidden, heads * 64),
              p + "mlp.gate_proj.weight": m(ffn, hidden), p + "mlp.up_proj.weight": m(ffn, hidden),
              p + "mlp.down_proj.weight": m(hidden, ffn), p + "input_layernorm.weight": torch.ones(hidden, dtype=dt),
              p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dt)}
    save_file(t, str(d / "model.safetensors"))
    return sum(v.numel() * v.element_size() for v in t.values())


def _status() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    f = {k: v for k, _, v in (ln.partition(":") for ln in Path("/proc/self/status").read_text().splitlines())}
    return int(f["VmRSS"].split()[0]) * 1024, int(f["VmHWM"].split()[0]) * 1024


def child(model: str, out: str, wdtype: str) -> None:
    import zlc

    marks: list[tuple[str, int, int]] = []
    seen: set[str] = set()

    def progress(stage: str, detail: str) -> None:
        if stage not in seen:
            seen.add(stage)
            marks.append((stage, *_status()))

    res = zlc.compile(model, targets=["cpu"], out=out, dtype=wdtype, max_seq=256, progress=progress, force=True)
    marks.append(("end", *_status()))
    print(json.dumps({"marks": marks, "verification": res.manifest["verification"]["status"],
                      "seconds": round(sum(res.seconds.values()) - res.seconds.get("total", 0), 1)}))


def _peak_of(cmd: list[str]) -> tuple[int, str]:
    """Run `cmd` as the only child so far of a fresh helper; its peak RSS in bytes and stdout."""
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stderr.write(r.stderr[-3000:]); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
             "print(r.stdout, end='')")
    r = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, check=True)
    first, _, rest = r.stdout.partition("\n")
    if not rest.strip():
        raise SystemExit(f"child failed:\n{r.stderr}")
    return int(first) * 1024, rest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--wdtype", default="auto", help="zlc compile --dtype (auto, fp32, bf16)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--child", nargs=3, metavar=("DIR", "OUT", "WDTYPE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "ckpt"
        nbytes = write_checkpoint(d, a.dtype, a.layers, a.hidden, a.ffn, a.vocab)
        base, _ = _peak_of([sys.executable, "-c", "import zlc, zlc.build, torch, transformers, safetensors; print(1)"])
        t = time.perf_counter()
        peak, out = _peak_of([sys.executable, __file__, "--child", str(d), str(Path(tmp) / "b.zlc"), a.wdtype])
        wall = time.perf_counter() - t
    rep = json.loads(out.strip().splitlines()[-1])
    mb = 1 / 2**20
    print(f"Llama-shaped random checkpoint, {a.dtype}: {a.layers} layers, hidden {a.hidden}, ffn {a.ffn}, "
          f"vocab {a.vocab}; weights {nbytes * mb:.0f} MiB; `zlc.compile(DIR, targets=['cpu'], dtype="
          f"'{a.wdtype}', max_seq=256)`; verification {rep['verification']}; {wall:.0f} s wall; "
          f"{platform.processor() or platform.machine()}\n")
    print(f"peak RSS of the compile: **{peak * mb:.0f} MiB = {peak / nbytes:.2f}x the weights** "
          f"(interpreter + imports alone: {base * mb:.0f} MiB)\n")
    print("| stage starts | RSS (MiB) | peak so far (MiB) |\n|---|---:|---:|")
    for stage, rss, hwm in rep["marks"]:
        print(f"| {stage} | {rss * mb:.0f} | {hwm * mb:.0f} |")


if __name__ == "__main__":
    main()
