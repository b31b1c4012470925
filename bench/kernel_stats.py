"""Megakernel machine-code facts and the predicted decode latency, per model and GPU target.

    python bench/kernel_stats.py                       # build (or reuse) SmolLM2-135M and the Llama-1B shape
    python bench/kernel_stats.py --bundle X.zlc ...    # or read bundles made elsewhere
    python bench/kernel_stats.py --json | --markdown   # machine-readable / the docs table
    python bench/kernel_stats.py --markdown --save-json r.json   # both at once
    python bench/kernel_stats.py --batch 1 4 16 64     # the batched decode step (prefill kernel), per B

Bundles are the shape-faithful random-weight models of `bench/device_bench.py` (`Config`, `MODELS`,
its plain-torch `Llama`), compiled here with `zlc.compile(module, ...)` for a10 (sm_86) and h200
(sm_90) with max_seq 512, once into --cache (default ~/.cache/zlc/kernel-stats/<model>.zlc; the
weights file is dropped: the facts need the manifest, kernel.py, tables and cubins only; a cached
bundle of another zlc version or bundle format is rebuilt, and --rebuild after a kernel change). SmolLM2
takes ~40 s to compile on a 2-core machine, the Llama-1B shape ~2 min and ~12 GB of memory.
Everything printed comes from the cubins and the task tables (`zlc.kernelmodel.static_facts`,
`task_tables`, `task_path`) and the latency model with its stated ranges (`latency`, `event_sim`;
docs/kernel-model.md); no GPU is used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
DEFAULT_MODELS = ("smollm2-135m", "llama-1b-shape")
TARGETS = ("a10", "h200")
MAX_SEQ = 512


def build(name: str, cache: Path, targets: tuple[str, ...], max_seq: int, force: bool = False) -> Path:
    """The model's bundle for `targets` in `cache` (compiled unless a matching one is there)."""
    import shutil

    import torch
    from device_bench import SEED, Config, Llama, init_weights  # the bench's model definitions

    import zlc
    from zlc.bundle import FORMAT_VERSION

    out = cache / f"{name}.zlc"
    man = out / "manifest.json"
    if man.exists() and not force:
        m = json.loads(man.read_text())
        if set(targets) <= set(m.get("targets", {})) and m["model"]["max_seq"] == max_seq \
                and m.get("zlc_version") == zlc.__version__ and m.get("format_version") == FORMAT_VERSION:
            return out
    cfg = Config.named(name)
    torch.manual_seed(SEED)
    model = Llama(cfg)
    init_weights(model, SEED, "cpu")
    model.eval()
    example = (torch.randint(0, cfg.vocab, (1, 8), generator=torch.Generator().manual_seed(SEED)),)
    if out.exists():
        shutil.rmtree(out)
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = zlc.compile(model, example_inputs=example, targets=list(targets), out=out, max_seq=max_seq,
                      dtype="bf16", name=name, verify=False,
                      progress=lambda st, d: print(f"  [{name}] {st}: {d}", file=sys.stderr, flush=True))
    del model
    wfile = out / res.manifest["weights"]["file"]
    wfile.unlink(missing_ok=True)  # 270 MB / 2.5 GB the facts do not need
    print(f"  [{name}] compiled in {time.perf_counter() - t0:.0f} s -> {out}", file=sys.stderr)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS), help="bench models to build")
    ap.add_argument("--bundle", type=Path, action="append", default=[], help="read this bundle instead")
    ap.add_argument("--target", dest="targets", action="append", default=None,
                    help=f"GPU targets (default: {', '.join(TARGETS)})")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("ZLC_CACHE_DIR", Path.home() / ".cache" / "zlc"))
                    / "kernel-stats")
    ap.add_argument("--max-seq", type=int, default=MAX_SEQ)
    ap.add_argument("--context", type=int, default=None, help="decode context for the prediction (default max_seq)")
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--save-json", type=Path, default=None, help="also write the reports as JSON to this file")
    ap.add_argument("--batch", type=int, nargs="*", default=None,
                    help="price batched decode steps of these batch sizes instead (zlc.kernelmodel.batch_step)")
    a = ap.parse_args()
    targets = tuple(a.targets or TARGETS)
    bundles = list(a.bundle) or [build(m, a.cache, targets, a.max_seq, a.rebuild) for m in a.models]
    if a.build_only:
        return 0
    if a.batch:
        rows = [batch_rows(b, [t for t in targets if t in _gpu_targets(b)], a.batch, a.context) for b in bundles]
        if a.save_json is not None:
            a.save_json.write_text(json.dumps(rows, indent=1))
        print(render_batch([r for rs in rows for r in rs], " ".join(["python bench/kernel_stats.py", *sys.argv[1:]])))
        return 0
    from zlc.kernelmodel.report import bundle_report, render_markdown, render_text

    reports = [bundle_report(b, targets=[t for t in targets if t in _gpu_targets(b)] or None, context=a.context)
               for b in bundles]
    for r in reports:
        _add_goals(r)
    if a.save_json is not None:
        a.save_json.write_text(json.dumps(reports, indent=1))
    if a.json:
        print(json.dumps(reports, indent=1))
    elif a.markdown:
        print(render_markdown(reports, command=" ".join(["python bench/kernel_stats.py", *sys.argv[1:]])))
    else:
        for r in reports:
            print(render_text(r))
    return 0


# An absolute goal next to the per-target checks: the Llama-3.2-1B shape at Hazy Research's
# measured 0.76 ms per token on H200 (the 1.6x-floor goal is SmolLM2's; both are in the report).
GOALS_US = {("llama-1b-shape", "h200"): 760.0}


def _add_goals(rep: dict[str, object]) -> None:
    targets = rep["targets"]
    assert isinstance(targets, dict)
    for tg, entry in targets.items():
        goal = GOALS_US.get((str(rep["model"]), tg))
        if goal is None:
            continue
        us = entry["prediction"]["us"]["central"]
        floor = entry["prediction"]["floor_us"]["central"]
        entry["checks"].append({
            "target": f"predicted decode <= {goal:g} µs (Hazy Research's H200 megakernel)",
            "value": f"{us:,.1f} µs", "met": us <= goal,
            "stopped_by": "" if us <= goal else f"{us - goal:,.0f} µs over; the floor alone is {floor:,.0f} µs, so the "
                          "per-level latency term of the 1.6x-floor check is what stops it (same critical path)"})


# The aims for the batched decode step (issue 25): on h200, batch 16 <= 1.3x and batch 64
# <= 2x the single-sequence decode step (batch 1, the decode kernel).
BATCH_AIMS = {16: 1.3, 64: 2.0}


def batch_rows(bundle: Path, targets: list[str], sizes: list[int], context: int | None) -> list[dict[str, object]]:
    """Per target: the decode kernel's single-sequence step and the batched step at each size,
    with the HBM terms (weights once, every row's KV cache) that bound it."""
    from zlc.bundle import read_manifest
    from zlc.kernelmodel.batch_step import predict_batch
    from zlc.kernelmodel.latency import params_for, predict
    from zlc.kernelmodel.sass_map import KernelCode
    from zlc.kernelmodel.task_tables import table_facts
    from zlc.kernelmodel.triton_source import KernelSource

    man = read_manifest(bundle)
    src = KernelSource((bundle / man["kernel"]["source"]).read_text(), man["kernel"]["entry"])
    ctx = context or int(man["model"]["max_seq"])
    out: list[dict[str, object]] = []
    tfs: dict[str, object] = {}
    for t in targets:
        tiling = man["targets"][t]["tiling"]
        tf = tfs.setdefault(tiling, table_facts(bundle, tiling, src, man, ctx))
        one = predict(KernelCode(bundle, t, man, src, kernel="decode"), tf, man, ctx)  # type: ignore[arg-type]
        code = KernelCode(bundle, t, man, src, kernel="prefill")
        bw = params_for(t, "central").hbm_gbs * 1e3  # bytes per µs
        base = one.us["central"]
        out.append({"model": man["model"]["name"], "target": t, "context": ctx, "batch": "1 (decode kernel)",
                    "us": one.us, "ratio": 1.0, "tok_s": 1e6 / base, "weights": one.bytes_per_step, "kv": None,
                    "hbm_floor_us": one.bytes_per_step / bw, "busy": {}})
        for b in sizes:
            p = predict_batch(code, tf, man, b, ctx)  # type: ignore[arg-type]
            c = p.us["central"]
            nbytes = sum(p.bytes_per_step.values())
            row: dict[str, object] = {"model": man["model"]["name"], "target": t, "context": ctx, "batch": b,
                                      "us": p.us, "ratio": c / base, "tok_s": b * 1e6 / c,
                                      "weights": p.bytes_per_step["weights"], "kv": p.bytes_per_step["kv"],
                                      "hbm_floor_us": nbytes / bw, "kv_floor_us": p.bytes_per_step["kv"] / bw,
                                      "busy": p.per_op_busy_us, "unpriced_tasks": p.unpriced_tasks}
            aim = BATCH_AIMS.get(b)
            if aim is not None and t == "h200":
                row["aim"] = f"<= {aim:g}x batch 1"
                row["met"] = c <= aim * base
            out.append(row)
    return out


def render_batch(rows: list[dict[str, object]], command: str) -> str:
    lines = [f"`{command}` (µs central, low-high; ratio and tok/s at central)", "",
             "| model | target | batch | step µs | low-high | vs batch 1 | tok/s | weights MB | KV MB | HBM floor µs "
             "| of which KV | busy µs: linear / attention | aim |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        us = r["us"]
        assert isinstance(us, dict)
        busy = r.get("busy") or {}
        assert isinstance(busy, dict)
        kv = r.get("kv")
        aim = "" if "aim" not in r else f"{r['aim']}: {'met' if r['met'] else 'NOT met'}"
        split = "-" if not busy else f"{busy.get('linear', 0):,.0f} / {busy.get('attention', 0):,.0f}"
        lines.append(f"| {r['model']} | {r['target']} | {r['batch']} | {us['central']:,.1f} | "
                     f"{us['low']:,.0f}-{us['high']:,.0f} | {r['ratio']:.2f} | {r['tok_s']:,.0f} | "
                     f"{int(r['weights']) / 1e6:,.1f} | {'-' if kv is None else f'{int(kv) / 1e6:,.1f}'} | "  # type: ignore[call-overload]
                     f"{float(r['hbm_floor_us']):,.1f} | "  # type: ignore[arg-type]
                     f"{'-' if kv is None else format(float(r['kv_floor_us']), ',.1f')} | "  # type: ignore[arg-type]
                     f"{split} | "
                     f"{aim} |")
    return "\n".join(lines)


def _gpu_targets(bundle: Path) -> list[str]:
    man = json.loads((bundle / "manifest.json").read_text())
    return [t for t, i in man["targets"].items() if "cubin" in i]


if __name__ == "__main__":
    sys.exit(main())
