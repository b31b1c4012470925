"""Compile-time benchmark (CPU): how long `zlc.lower` takes per pipeline stage, and how long a whole
`zlc.compile` takes (lowering, verification, scheduling, weights, AOT cubins, manifest).

    python bench/compile_time.py                   # the tiny example model (zoo llama, opset 20)
    python bench/compile_time.py --smollm2         # plus SmolLM2-135M (zoo export, ~540 MB, once)
    python bench/compile_time.py MODEL.onnx ...    # any ONNX files
    python bench/compile_time.py --cold-warm --targets cpu,a10 --max-seq 128 --repeat 0
                                                   # the compile cache: each stage cold, then warm

Each model is lowered --repeat times in this process; the table shows the median seconds per
stage (the first run also pays one-time imports, so it is reported separately), node counts and
the peak resident memory of the process. Each model runs in its own process (exports first, so
exporting does not count). The peer, measured in the same process and run: building an ONNX
Runtime session with all graph optimizations for the same file (what a user of ORT waits for
before the first token); the ratio zlc / ORT is printed. `zlc.compile` for --targets (default
a10 and h100) runs once per model after the lowering runs, into a temporary directory; its stage
times and total are printed with the same peer ratio. Output is markdown, ready for
docs/performance.md.

--cold-warm: `zlc.compile` three times into temporary directories, with a compile cache of its
own (ZLC_KERNEL_CACHE in a temporary directory): cold (empty cache: every library and cubin
built, the jobs side by side), warm (every one from the cache), and cold with --jobs 1 (one build
at a time, as before the cache and the pool); seconds per stage for each, and the process's peak
RSS. With --repeat 0 the lowering runs and the ORT peer are skipped.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import zlc


def lower_times(path: Path, repeat: int, max_seq: int) -> tuple[float, dict[str, float], zlc.Lowered]:
    """(first run's total, median seconds per stage over the runs after it, last result)."""
    runs: list[dict[str, float]] = []
    first = 0.0
    lowered = None
    for i in range(repeat + 1):
        t = time.perf_counter()
        lowered = zlc.lower(path, options=zlc.CompileOptions(max_seq=max_seq))
        if i == 0:
            first = time.perf_counter() - t
        else:
            runs.append({s.name: s.seconds for s in lowered.stages})
    assert lowered is not None
    return first, {k: statistics.median(r[k] for r in runs) for k in runs[0]}, lowered


def ort_session_time(path: Path, repeat: int) -> float:
    """Median seconds to build an optimized ONNX Runtime CPU session for `path` (the peer)."""
    import onnxruntime as ort

    times = []
    for _ in range(repeat + 1):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        t = time.perf_counter()
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def compile_time(path: Path, targets: list[str], max_seq: int) -> tuple[dict[str, float], dict]:
    """Stage seconds of one `zlc.compile` into a temporary directory, and its manifest."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        res = zlc.compile(path, targets=targets, out=Path(d) / "b.zlc", max_seq=max_seq)
        return res.seconds, res.manifest


def cold_warm(path: Path, targets: list[str], max_seq: int) -> list[str]:
    """Stage seconds of a cold, a warm and a one-job cold compile, each with a fresh or the same
    private cache, as a markdown table."""
    import os
    import tempfile

    runs: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        os.environ["ZLC_KERNEL_CACHE"] = str(Path(d) / "cache")
        for label, kw in (("cold", {}), ("warm", {}), ("cold, --jobs 1", {"jobs": 1, "cache": False})):
            res = zlc.compile(path, targets=targets, out=Path(d) / "b.zlc", max_seq=max_seq, **kw)
            runs[label] = res.seconds
            c = res.manifest["cache"]
            print(f"  {label}: {len(c['hits'])} from the cache, {len(c['built'])} built", file=sys.stderr)
    stages = [k for k in next(iter(runs.values())) if k != "total"]
    lines = [f"`zlc.compile({path.name}, targets={targets}, max_seq={max_seq})`, seconds per stage:", "",
             "| stage | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    lines += [f"| {k} | " + " | ".join(f"{r[k]:.2f}" for r in runs.values()) + " |" for k in stages]
    lines += ["| **total** | " + " | ".join(f"**{r['total']:.2f}**" for r in runs.values()) + " |", "",
              f"peak RSS {peak_rss_mb():.0f} MB", ""]
    return lines


def report(path: Path, repeat: int, max_seq: int, targets: list[str], cache_runs: bool = False) -> list[str]:
    if cache_runs:
        return cold_warm(path, targets, max_seq)
    first, med, lowered = lower_times(path, repeat, max_seq)
    rss = peak_rss_mb()  # before the peer loads its own copy of the weights
    peer = ort_session_time(path, repeat)
    nodes = {s.name: s.nodes for s in lowered.stages}
    size_mb = sum(f.stat().st_size for f in (path, path.with_name(path.name + ".data")) if f.exists()) / 1e6
    lines = [f"**{path.name}** ({size_mb:.1f} MB, max_seq {max_seq}): first run {first:.2f} s, "
             f"then median of {repeat}: {sum(med.values()):.2f} s", "",
             "| stage | seconds | nodes after |", "|---|---|---|"]
    lines += [f"| {k} | {v:.3f} | {nodes[k]} |" for k, v in med.items()]
    before, after = sum(lowered.histogram_before.values()), sum(lowered.histogram_after.values())
    total = sum(med.values())
    lines += ["", f"nodes {before} → {after}; peak RSS {rss:.0f} MB (zlc, before the peer ran)",
              f"peer: ONNX Runtime optimized session build {peer:.3f} s; zlc lower / ORT = {total / peer:.2f}x", ""]
    if targets:
        secs, man = compile_time(path, targets, max_seq)
        stages = ", ".join(f"{k} {v:.2f} s" for k, v in secs.items() if k != "total")
        tasks = {k: v["summary"]["tasks"]["decode"] for k, v in man["tilings"].items()}
        res = "; ".join(f"{t} {man['targets'][t]['arch']}: {man['targets'][t]['resources']['registers']} registers, "
                        f"spills {man['targets'][t]['resources']['spill_stores']} B" for t in targets
                        if man["targets"][t].get("resources"))
        lines += [f"`zlc.compile(targets={targets})`: **{secs['total']:.1f} s** wall ({stages}); "
                  f"zlc compile / ORT session = **{secs['total'] / peer:.1f}x**",
                  f"tasks per decode step: {tasks}; {res}", ""]
    return lines


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M-Instruct (zoo export)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--targets", default="a10,h100", help="zlc.compile targets, comma-separated ('' skips)")
    ap.add_argument("--cold-warm", action="store_true",
                    help="compile cold, warm and cold with one job, each stage's seconds (the compile cache)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child process: one model
    args = ap.parse_args()
    if args.one:
        targets = [t for t in args.targets.split(",") if t]
        print("\n".join(report(args.models[0], args.repeat, args.max_seq, targets, args.cold_warm)), flush=True)
        return
    from zlc.testing import zoo

    models = list(args.models) or [zoo.cached("stateless", "llama", 20)]
    if args.smollm2:
        models.append(zoo.cached_smollm2())
    print(f"{platform.machine()}, {_cpus()} CPUs, Python {platform.python_version()}, torch "
          f"{_version('torch')}, onnxruntime {_version('onnxruntime')}\n", flush=True)
    for m in models:
        subprocess.run([sys.executable, __file__, "--one", str(m), "--repeat", str(args.repeat),
                        "--max-seq", str(args.max_seq), "--targets", args.targets,
                        *(["--cold-warm"] if args.cold_warm else [])], check=True)


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    main()
