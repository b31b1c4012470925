"""Session start and resident weight memory of the native kernel: the mapped weight layout
(native/<level>.weights, read in place) beside the copying start (the library lays W and Q out in
memory of its own), same run.

    python bench/session_start.py                        # SmolLM2-135M bf16 + the zoo's tiny Llama
    python bench/session_start.py --rounds 9 --threads 2 PATH.zlc ...

Per bundle:
- `zlc.load`: the quick check every load runs (sizes, small files hashed, large ones sampled)
  beside the full sha256 of every file (`zlc.load(path, full_check=True)`, `zlc inspect`).
- session start: `NativeBackend` (tables, arenas, the library's create: worker threads, scratch,
  weights) to the end of its first launch (a one-token prefill), mapped and copied alternating
  round by round; medians (and the create alone). The page cache is warm (the bundle was just
  read or written): a cold start reads the file from disk first, in either mode.
- decode: tok/s of one mapped and one copied session side by side (--steps greedy steps after a
  short prompt, alternating round by round): the mapped file must stream as fast as the copy.
- resident memory: two processes each holding a session that ran a prefill, per mode; from
  /proc/<pid>/smaps the weight layout's mapping (Rss, Pss, private kB) and from smaps_rollup the
  process's anonymous memory (where the copying start keeps its copy).

The default SmolLM2 bundle is bench/cpu_decode.py's (bf16, max_seq 512, cached in --workdir; the
tiny one is compiled into it too).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def smollm2(workdir: Path) -> Path:
    import zlc
    from zlc.testing import zoo

    out = workdir / "smollm2-bf16.zlc"
    if not (out / "manifest.json").is_file() or not _has_layout(out):
        zlc.compile(zoo.cached_smollm2(), targets=["cpu"], dtype="bf16", max_seq=512,
                    tokenizer=zoo.smollm2_gguf_path(), out=out, verify=False, name="smollm2", force=True)
    return out


def tiny(workdir: Path) -> Path:
    import zlc
    from zlc.testing import zoo

    out = workdir / "tiny-llama-fp32.zlc"
    if not (out / "manifest.json").is_file() or not _has_layout(out):
        zlc.compile(zoo.cached("stateless", "llama", 20), targets=["cpu"], out=out, max_seq=64, dtype="fp32",
                    verify=False, force=True)
    return out


def _has_layout(path: Path) -> bool:
    import json

    man = json.loads((path / "manifest.json").read_text())
    return any("weights" in lv for lv in (man.get("native") or {}).get("levels", {}).values())


def _ms(f: Any) -> float:
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) * 1e3


def start(path: Path, man: dict[str, Any], threads: int, mapped: bool) -> tuple[float, float]:
    """(ms to create the backend, ms to the end of its first launch)."""
    from zlc.runtime.native import NativeBackend

    t0 = time.perf_counter()
    nb = NativeBackend(path, man, threads=threads, mapped=mapped)
    t1 = time.perf_counter()
    nb.launch(0, [1], 0, False, False)
    t2 = time.perf_counter()
    nb.close()
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3


def decode(path: Path, man: dict[str, Any], threads: int, rounds: int, steps: int) -> dict[bool, float]:
    """Median greedy decode tok/s per mode, the two sessions alive together, alternating."""
    from zlc.runtime.megakernel import MegakernelSession
    from zlc.runtime.native import NativeBackend

    sess = {}
    for mapped in (True, False):
        nb = NativeBackend(path, man, threads=threads, mapped=mapped)
        sess[mapped] = MegakernelSession(nb, chunk=nb.chunk, max_seq=int(man["model"]["max_seq"]),
                                         vocab=int(man["model"]["vocab"]))
    got: dict[bool, list[float]] = {True: [], False: []}
    n = min(steps, int(man["model"]["max_seq"]) - 9)
    for i in range(rounds):
        for mapped in ((True, False) if i % 2 == 0 else (False, True)):
            s = sess[mapped]
            s.reset()
            tok = s.prefill([1, 2, 3, 4, 5, 6, 7, 8])[0]
            t0 = time.perf_counter()
            for _ in range(n):
                tok = s.step(tok)[0]
            got[mapped].append(n / (time.perf_counter() - t0))
    for s in sess.values():
        s.close()
    return {m: statistics.median(v) for m, v in got.items()}


def smaps(pid: int, name: str) -> dict[str, int]:
    """kB fields of the mappings of a file whose path ends with `name`, summed."""
    out: dict[str, int] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            inside = line.rstrip().endswith(name)
        elif inside and len(head) >= 3 and head[-1] == "kB":
            out[head[0][:-1]] = out.get(head[0][:-1], 0) + int(head[1])
    return out


def rollup(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        head = line.split()
        if len(head) >= 3 and head[-1] == "kB":
            out[head[0][:-1]] = int(head[1])
    return out


CHILD = """
import sys
from zlc.runtime.megakernel import MegakernelSession
from zlc.runtime.native import NativeBackend
import zlc
b = zlc.load(sys.argv[1])
nb = NativeBackend(b.path, b.manifest, threads=int(sys.argv[2]), mapped=sys.argv[3] == "mapped")
s = MegakernelSession(nb, chunk=nb.chunk, max_seq=b.max_seq, vocab=b.vocab)
s.prefill([1, 2, 3])
print("ready", flush=True)
sys.stdin.readline()
"""


def resident(path: Path, threads: int, mode: str, layout: str) -> list[dict[str, int]]:
    """Two processes with a session each; per process its layout mapping and rollup (kB)."""
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(threads), mode], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        rows = []
        for p in procs:
            m, r = smaps(p.pid, layout), rollup(p.pid)
            rows.append({"rss": m.get("Rss", 0), "pss": m.get("Pss", 0),
                         "private": m.get("Private_Clean", 0) + m.get("Private_Dirty", 0),
                         "anon": r.get("Anonymous", 0), "proc_pss": r.get("Pss", 0)})
        return rows
    finally:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("\n")
            p.stdin.close()
            p.wait(timeout=120)


def bench(path: Path, rounds: int, threads: int, steps: int) -> None:
    import zlc
    from zlc.bundle import read_manifest
    from zlc.runtime.native import select_level

    man = read_manifest(path)
    level = select_level(man["native"])
    layout = man["native"]["levels"][level]["weights"]
    quick = statistics.median(_ms(lambda: zlc.load(path)) for _ in range(rounds))
    full = statistics.median(_ms(lambda: zlc.load(path, full_check=True)) for _ in range(max(1, rounds // 3)))
    mb = layout["bytes"] / 2**20
    print(f"\n{man['model']['name']} ({man['dtype']['weights']}, {level}, layout {mb:.1f} MiB, {threads} threads)")
    print(f"  zlc.load: quick check {quick:7.1f} ms   full sha256 {full:7.1f} ms")
    got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(rounds):
        for mapped in ((True, False) if i % 2 == 0 else (False, True)):
            got[mapped].append(start(path, man, threads, mapped))
    for mapped in (True, False):
        create = statistics.median(c for c, _ in got[mapped])
        first = statistics.median(f for _, f in got[mapped])
        print(f"  session start, {'mapped' if mapped else 'copied'}: create {create:7.1f} ms, to the end of the "
              f"first launch {first:7.1f} ms (median of {rounds})")
    tps = decode(path, man, threads, rounds, steps)
    print(f"  decode: mapped {tps[True]:6.1f} tok/s, copied {tps[False]:6.1f} tok/s (x{tps[True] / tps[False]:.3f}; "
          f"median of {rounds}, {steps} steps)")
    for mode in ("mapped", "copied"):
        rows = resident(path, threads, mode, layout["file"])
        for i, r in enumerate(rows):
            print(f"  two processes, {mode}, #{i + 1}: weight mapping Rss {r['rss'] / 1024:6.1f} MiB, Pss "
                  f"{r['pss'] / 1024:6.1f} MiB, private {r['private'] / 1024:6.1f} MiB; process anonymous "
                  f"{r['anon'] / 1024:6.1f} MiB, Pss {r['proc_pss'] / 1024:6.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="*", type=Path, help="bundles (default: SmolLM2-135M bf16 and the tiny Llama)")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("ZLC_BENCH_DIR", "out/bench-cpu")))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per round")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    paths = a.bundles or [smollm2(a.workdir), tiny(a.workdir)]
    for p in paths:
        bench(p, a.rounds, a.threads, a.steps)


if __name__ == "__main__":
    main()
