"""A bundle's GPU kernels as independent jobs: per kernel (decode, prefill), build (release; with
--debug-waits the debug and trace builds too), L2-prefetch size and compute capability, one Triton
compile for every GPU target that shares them. `start` submits them to a pool (each job runs its compiler in a child
process; the compile stage submits them as soon as kernel.py is written, so they overlap the
weights and the native libraries), through the compile cache (aot_cache.py); `finish` waits for
them, writes the cubins and PTX into the bundle and returns the manifest's target entries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zlc.bundle import MODE_DECODE, MODE_PREFILL
from zlc.errors import ZlcError
from zlc.targets import Target, get_target

from .aot import check_ptx_sync
from .aot_cache import compile_cached
from .emit import ENTRY, signature
from .kcache import KernelCache

__all__ = ["BUILDS", "KernelJobs", "finish", "l2_prefetch", "start"]

# The builds of each kernel: `release` always; with --debug-waits the diagnostic ones too, which
# the CUDA executor runs for the first launch of each kernel (debug: waits time out into CTRL's
# error words) and for traced launches (trace: SM id and timestamps per task). Extra constexprs:
BUILDS: dict[str, dict[str, int]] = {"release": {}, "debug": {"DEBUG": 1}, "trace": {"TRACE": 1}}

Job = tuple[str, int, str, int, int]  # (kernel, STEP, build, PREFETCH bytes, compute capability)


@dataclass
class KernelJobs:
    """The submitted jobs of one bundle (`start`), collected by `finish`."""

    targets: list[Target]
    builds: list[str]
    prefetch: dict[str, dict[str, Any]]
    futures: dict[Job, Future[list[Any]]] = field(default_factory=dict)


def start(gp: Any, kernel_path: Path, targets: Sequence[Target], wdtype: str, debug_waits: bool, pool: Executor,
          cache: KernelCache, report: Callable[[str], None]) -> KernelJobs:
    """Submits every kernel job of the GPU program `gp` for `targets` to `pool`."""
    gpu_targets = [t for t in targets if t.is_gpu]
    # Two kernels from the one source, per target: STEP picks the prefill or the decode bodies,
    # so neither carries the other's registers (docs/megakernel.md, "Two kernels").
    builds = [k for k in BUILDS if k == "release" or debug_waits]
    # PREFETCH: the decode kernel requests up to that many bytes of the next task's weights
    # into L2 (inline PTX, which the interpreter cannot run: it keeps the default 0), sized per
    # target to its L2 (l2_prefetch; docs/megakernel.md); the prefill kernel compiles it out
    prefetch = {t.name: l2_prefetch(gp, t, wdtype) for t in gpu_targets}
    caps = sorted({int(p["bytes"]) for p in prefetch.values()})  # one decode kernel per cap (0: none)
    # one job per compute capability too: each is its own Triton process (targets of one capability
    # share its cubins)
    ccs = sorted({int(t.compute_capability) for t in gpu_targets if t.compute_capability is not None})
    jobs: list[Job] = [("decode", MODE_DECODE, build, cap, cc) for build in builds for cap in caps for cc in ccs
                       if any(_of(t, cc) and prefetch[t.name]["bytes"] == cap for t in gpu_targets)] + \
                      [("prefill", MODE_PREFILL, build, 0, cc) for build in builds for cc in ccs]
    for t in gpu_targets:
        report(f"{t.name}: L2 prefetch of the next task's weights {'on' if prefetch[t.name]['on'] else 'off'}: "
               f"{prefetch[t.name]['why']}")

    def run(job: Job) -> list[Any]:
        kind, step, build, cap, cc = job
        tgs = [t for t in gpu_targets if _of(t, cc) and (kind != "decode" or prefetch[t.name]["bytes"] == cap)]
        what = kind if build == "release" else f"{kind} ({build})"
        consts = {**gp.constexprs(debug=False), "STEP": step, "TRACE": 0, "PREFETCH": cap, **BUILDS[build]}
        results, hit = compile_cached(cache, kernel_path, ENTRY, signature(wdtype), consts, tgs,
                                      num_warps=gp.tiling.num_warps, on_progress=lambda s: report(f"{what}: {s}"))
        report(f"{what} kernel: {', '.join(t.name for t in tgs)} " + ("(cached)" if hit else "(ptxas)"))
        for r in {r.arch: r for r in results}.values():
            for c in r.cubins[1:]:
                report(f"{what}: {r.arch}: assembled again with ptxas {c.toolkit} (PTX ISA {c.ptx_isa}) "
                       f"in {c.seconds:.1f} s")
            if r.fallback_skipped:
                report(f"{what}: {r.arch}: no cubin from the older ptxas: {r.fallback_skipped}")
        for r in results:
            for i, c in enumerate(r.cubins):
                cache.note(_stem(r.target, kind, build) + ("" if i == 0 else f".cu{c.toolkit.replace('.', '')}")
                           + ".cubin", hit)
        return results

    return KernelJobs(gpu_targets, builds, prefetch, {job: pool.submit(run, job) for job in jobs})


def finish(jobs: KernelJobs, root: Path) -> dict[str, dict[str, Any]]:
    """Waits for the jobs, writes their files under `root` and returns {target: manifest entry}."""
    entries: dict[str, dict[str, dict[str, Any]]] = {}
    for (kind, _, build, _, _), fut in jobs.futures.items():
        for r in fut.result():
            entries.setdefault(r.target, {}).setdefault(kind, {})[build] = _kernel_entry(root, r, kind, build)
    out: dict[str, dict[str, Any]] = {}
    for name in (t.name for t in jobs.targets if t.name in entries):  # the targets' order, not the jobs'
        dec, pre = entries[name]["decode"], entries[name]["prefill"]
        # the target's own fields: the decode kernel's release build, what a step runs
        info = {"arch": dec["release"].pop("arch"), "tiling": "gpu", "grid": get_target(name).sms, **dec["release"]}
        prefill = {k: v for k, v in pre["release"].items() if k != "arch"}
        for build in jobs.builds[1:]:
            info[build] = {k: v for k, v in dec[build].items() if k != "arch"}
            prefill[build] = {k: v for k, v in pre[build].items() if k != "arch"}
        out[name] = {**info, "prefill": prefill, "l2_prefetch": jobs.prefetch[name]}
    return out


def l2_prefetch(prog: Any, target: Any, wdtype: str) -> dict[str, Any]:
    """Whether, and how much of, the next task's weights `target`'s decode kernel prefetches into L2
    (PREFETCH: the most bytes one prefetch requests, 0 for none): half the L2 shared by one
    prefetch per program (the other half for the KV cache, activations and partials;
    docs/kernel-model.md prices lines beyond it as evicted before use: their bytes cross HBM
    twice), on where that share is at least what a task requests into its registers before its
    wait (gemv_plan.PREFETCH_BYTES): below it the L2 prefetch adds little but its instructions."""
    from .gemv_plan import PREFETCH_BYTES
    from .program import PF_UNIT

    item = 4 if wdtype == "fp32" else 2
    sizes = [r[1] * PF_UNIT * item * (2 if r[2] >= 0 else 1)
             for r in (prog.prefetch_record(t) for t in prog.tables["decode"]) if r[1] > 0]
    mean = sum(sizes) / len(sizes) if sizes else 0.0
    have = target.l2_mb * 1e6 / 2
    share = int(have / target.sms) // 1024 * 1024
    on = bool(sizes) and share >= PREFETCH_BYTES
    return {"on": on, "bytes": share if on else 0,
            "why": f"half the L2 ({have / 1e6:.0f} MB) over {target.sms} programs = {share / 1024:.0f} KB per prefetch "
                   f"{'>=' if on else '<'} {PREFETCH_BYTES / 1024:.0f} KB (a task's own requests before its wait); "
                   f"the decode step's tasks prefetch {mean / 1024:.0f} KB each on average"
                   + (f", at most {share / 1024:.0f} KB" if on else "")}


def _of(t: Target, cc: int) -> bool:
    return t.compute_capability is not None and int(t.compute_capability) == cc


def _stem(target: str, kind: str, build: str) -> str:
    return "kernels/" + target + ("" if kind == "decode" else ".prefill") + ("" if build == "release" else f".{build}")


def _kernel_entry(root: Path, r: Any, kind: str, build: str) -> dict[str, Any]:
    """Writes one compiled kernel's files (every toolkit's cubin, the PTX) and returns its manifest
    entry: `kernels/<target>[.prefill][.<build>].cubin` is Triton's own ptxas's, `....cu129.cubin`
    the older ptxas's (e.g. CUDA 12.9) from the same PTX; `cubins` lists them, preferred first."""
    problems = check_ptx_sync(r.ptx)
    if problems:
        raise ZlcError(f"{r.target} ({kind} kernel, {build} build): the PTX lacks the memory ordering the "
                       f"megakernel relies on: {'; '.join(problems)} (a Triton upgrade changed its lowering?)")
    stem = _stem(r.target, kind, build)
    (root / "kernels").mkdir(exist_ok=True)
    (root / f"{stem}.ptx").write_text(r.ptx)
    cubins = []
    for i, c in enumerate(r.cubins):
        path = f"{stem}.cubin" if i == 0 else f"{stem}.cu{c.toolkit.replace('.', '')}.cubin"
        (root / path).write_bytes(c.cubin)
        cubins.append(c.entry(path))
    entry: dict[str, Any] = {
        "cubin": cubins[0]["cubin"], "ptx": f"{stem}.ptx", "metadata": r.metadata, "params": r.params,
        "resources": asdict(r.resources), "compile_seconds": round(r.seconds, 3), "arch": r.arch, "cubins": cubins}
    if r.fallback_skipped:
        entry["fallback_skipped"] = r.fallback_skipped
    return entry
