"""Per-frame cost of the XDP ingress path against the plain UDP socket path, same run.

Two network namespaces joined by a veth pair; `zlc serve` in one, serving the no-layer model
(bench/nolayer_model.py: embedding straight into the LM head, so the model's time is small) with
`--udp-port`; a client in the other sends binary token frames (max_tokens 1) one at a time and
times request sent -> result frame received. The server runs twice, alternating in blocks: with
`--xdp` (frames reach the request ring through the XDP program and its BPF ring buffer) and without
(frames reach it through the UDP socket). It also reports the XDP program's own run time per frame
from the kernel's BPF statistics (kernel.bpf_stats_enabled, switched on for the run and restored).

    python bench/xdp_frames.py [--requests 5000] [--blocks 4] [--burst 2000] [--json OUT]   (root; clang, libbpf)

At the end, a burst per path (frames sent back to back, replies collected): how many were answered
(none may be lost), how long it took, and the XDP program's cost per frame when it is busy.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SERVER_IP, CLIENT_IP, PORT = "10.202.0.1", "10.202.0.2", 9100

CLIENT_CODE = r"""
import json, socket, sys, time
from zlc.runtime.serve.ingress import frames
n, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect((host, port)); s.settimeout(5)
out = []
for i in range(n + 200):
    msg = frames.encode_request(i, [1, 2, 3, 4], 1)
    t0 = time.perf_counter_ns(); s.send(msg); data = s.recv(65536); t1 = time.perf_counter_ns()
    f = frames.decode_results(bytearray(data))
    assert f and f[0].request_id == i and f[0].flags & frames.FrameFlag.LAST, f
    if i >= 200:
        out.append(t1 - t0)
print(json.dumps(out))
"""


BURST_CODE = r"""
import json, socket, sys, time
from zlc.runtime.serve.ingress import frames
n, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
s.connect((host, port)); s.settimeout(0.5)
msgs = [frames.encode_request(i, [1, 2, 3, 4], 1) for i in range(n)]
t0 = time.perf_counter_ns()
for m in msgs:
    s.send(m)
t_sent = time.perf_counter_ns()
last, codes = set(), {}
deadline = time.monotonic() + 60
while len(last) < n and time.monotonic() < deadline:
    try:
        data = s.recv(65536)
    except TimeoutError:
        continue
    for f in frames.decode_results(bytearray(data)):
        if f.flags & frames.FrameFlag.LAST:
            last.add(f.request_id)
            if f.flags & frames.FrameFlag.ERROR:
                codes[f.tokens[0]] = codes.get(f.tokens[0], 0) + 1
t1 = time.perf_counter_ns()
print(json.dumps({"sent": n, "answered": len(last), "errors": codes, "send_us": (t_sent - t0) / 1000,
                  "all_answered_us": (t1 - t0) / 1000}))
"""


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout


def build_bundle(work: Path) -> Path:
    import zlc
    from zlc.deploy import ebpf

    spec = importlib.util.spec_from_file_location("nolayer_model", HERE / "nolayer_model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    onnx_path = mod.export_nolayer(work / "nolayer.onnx", vocab=264)
    out = work / "nolayer.zlc"
    zlc.compile(onnx_path, targets=["cpu"], out=out, max_seq=128, name="nolayer")  # builds deploy/ebpf too
    if not (out / "deploy" / "ebpf" / ebpf.OBJECT_NAME).is_file():
        sys.exit(f"the XDP program was not built: {ebpf.build(work / 'ebpf').reason}")
    return out


def start_server(ns: str, bundle: Path, xdp: str | None, max_queue: int = 32) -> subprocess.Popen[bytes]:
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "zlc.cli", "serve", str(bundle), "--device",
           "reference", "--host", SERVER_IP, "--port", "0", "--udp-port", str(PORT), "--api-key", "bench",
           "--max-queue", str(max_queue)]
    if xdp:
        cmd += ["--xdp", xdp]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 120)
    if not ready or not p.stdout.readline():
        p.kill()
        sys.exit("zlc serve did not start")
    return p


def stop(p: subprocess.Popen[bytes]) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        p.kill()


def xdp_prog_stats() -> tuple[int, int]:
    """(run_time_ns, run_cnt) summed over loaded programs named zlc_xdp."""
    progs = json.loads(sh("bpftool", "-j", "prog", "show"))
    ns = sum(p.get("run_time_ns", 0) for p in progs if p.get("name") == "zlc_xdp")
    cnt = sum(p.get("run_cnt", 0) for p in progs if p.get("name") == "zlc_xdp")
    return ns, cnt


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=5000, help="timed requests per block")
    ap.add_argument("--blocks", type=int, default=4, help="blocks per path, alternating xdp/socket")
    ap.add_argument("--burst", type=int, default=2000, help="frames sent back to back, per path, at the end")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces, XDP)")
    if shutil.which("bpftool") is None:
        sys.exit("needs bpftool (for the program's own run-time statistics)")
    tag = uuid.uuid4().hex[:6]
    srv, cli, veth = f"zbs-{tag}", f"zbc-{tag}", f"zb{tag}"
    stats_path = Path("/proc/sys/kernel/bpf_stats_enabled")
    stats_before = stats_path.read_text().strip()
    work = Path(tempfile.mkdtemp(prefix="zlc-xdp-bench-"))
    try:
        print("building the no-layer bundle with its XDP program…", file=sys.stderr)
        bundle = build_bundle(work)
        sh("ip", "netns", "add", srv)
        sh("ip", "netns", "add", cli)
        sh("ip", "link", "add", veth, "netns", srv, "type", "veth", "peer", "name", veth + "p", "netns", cli)
        sh("ip", "-n", srv, "addr", "add", f"{SERVER_IP}/24", "dev", veth)
        sh("ip", "-n", cli, "addr", "add", f"{CLIENT_IP}/24", "dev", veth + "p")
        for ns, dev in ((srv, veth), (cli, veth + "p"), (srv, "lo"), (cli, "lo")):
            sh("ip", "-n", ns, "link", "set", dev, "up")
        stats_path.write_text("1")
        client = work / "client.py"
        client.write_text(CLIENT_CODE)
        rtt: dict[str, list[float]] = {"xdp": [], "socket": []}
        prog_ns = prog_cnt = 0
        for b in range(args.blocks * 2):
            path = "xdp" if b % 2 == 0 else "socket"
            p = start_server(srv, bundle, veth if path == "xdp" else None)
            try:
                before = xdp_prog_stats() if path == "xdp" else (0, 0)
                out = sh("ip", "netns", "exec", cli, sys.executable, str(client), str(args.requests), SERVER_IP,
                         str(PORT))
                if path == "xdp":
                    after = xdp_prog_stats()
                    prog_ns += after[0] - before[0]
                    prog_cnt += after[1] - before[1]
                rtt[path] += [x / 1000 for x in json.loads(out)]
            finally:
                stop(p)
            print(f"block {b + 1}/{args.blocks * 2} ({path}): p50 {statistics.median(rtt[path]):.1f} µs",
                  file=sys.stderr)
        burst_file = work / "burst.py"
        burst_file.write_text(BURST_CODE)
        bursts: dict[str, Any] = {}
        for path in ("xdp", "socket"):
            p = start_server(srv, bundle, veth if path == "xdp" else None, max_queue=args.burst)
            try:
                before = xdp_prog_stats() if path == "xdp" else (0, 0)
                bursts[path] = json.loads(sh("ip", "netns", "exec", cli, sys.executable, str(burst_file),
                                             str(args.burst), SERVER_IP, str(PORT)))
                if path == "xdp":
                    after = xdp_prog_stats()
                    bursts[path]["program_ns_per_frame"] = round((after[0] - before[0]) / max(1, after[1] - before[1]), 1)
            finally:
                stop(p)
            print(f"burst ({path}): {bursts[path]}", file=sys.stderr)
        res: dict[str, Any] = {"requests_per_path": len(rtt["xdp"]), "blocks": args.blocks, "burst": bursts}
        for k, xs in rtt.items():
            res[k] = {"p50_us": round(pct(xs, 0.5), 1), "p99_us": round(pct(xs, 0.99), 1)}
        res["xdp_program_ns_per_frame"] = round(prog_ns / max(prog_cnt, 1), 1)
        res["xdp_program_runs"] = prog_cnt
        res["ratio_socket_over_xdp_p50"] = round(res["socket"]["p50_us"] / res["xdp"]["p50_us"], 3)
        res["ratio_socket_over_xdp_p99"] = round(res["socket"]["p99_us"] / res["xdp"]["p99_us"], 3)
        print(f"\nround trip, frame in -> result frame out (no-layer model, max_tokens 1, veth between namespaces, "
              f"{res['requests_per_path']} requests per path)")
        print(f"{'path':<8} {'p50 µs':>8} {'p99 µs':>8}")
        for k in ("xdp", "socket"):
            print(f"{k:<8} {res[k]['p50_us']:>8} {res[k]['p99_us']:>8}")
        print(f"socket/xdp: p50 {res['ratio_socket_over_xdp_p50']}x, p99 {res['ratio_socket_over_xdp_p99']}x")
        print(f"XDP program: {res['xdp_program_ns_per_frame']} ns per packet on the serving interface "
              f"({prog_cnt} runs, kernel BPF stats)")
        for k in ("xdp", "socket"):
            b_ = bursts[k]
            extra = f", XDP program {b_['program_ns_per_frame']} ns/frame" if k == "xdp" else ""
            print(f"burst of {b_['sent']} frames via {k}: {b_['answered']} answered ({b_['errors'] or 'no'} errors), "
                  f"sent in {b_['send_us'] / 1000:.1f} ms, all answered after {b_['all_answered_us'] / 1000:.1f} ms"
                  f"{extra}")
        if args.json:
            args.json.write_text(json.dumps(res, indent=2) + "\n")
    finally:
        stats_path.write_text(stats_before)
        for ns in (srv, cli):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
