"""The XDP ingress program, for real: compiled with clang, accepted by this kernel's verifier,
attached by `zlc serve --xdp` to a veth in a network namespace, fed UDP frames from a client in
another namespace. Every frame's tokens reach the request ring through the BPF ring buffer and its
result comes back; malformed frames are counted and never reach the ring (the socket answers
them); at overload (a ring smaller than the burst) every frame still arrives, through the ring or
the fallback socket: accepted + passed = sent, nothing lost.

Skipped, with the reason, where root, clang, libbpf or network namespaces are missing."""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from zlc.runtime.serve.ingress import frames

CLIENT = Path(__file__).with_name("xdp_client.py")
SERVER_IP, CLIENT_IP, PORT = "10.201.0.1", "10.201.0.2", 9000


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, BPF)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    from zlc.deploy import ebpf

    if ebpf.find_clang() is None:
        return "needs clang (apt install clang libbpf-dev)"
    if ctypes.util.find_library("bpf") is None:
        return "needs libbpf (apt install libbpf1)"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def netns() -> Iterator[tuple[str, str, str]]:
    """(server namespace, client namespace, server-side interface), joined by a veth pair."""
    tag = uuid.uuid4().hex[:6]
    srv, cli, veth = f"zlcs-{tag}", f"zlcc-{tag}", f"zx{tag}"
    try:
        sh("ip", "netns", "add", srv)
        sh("ip", "netns", "add", cli)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
    try:
        sh("ip", "link", "add", veth, "netns", srv, "type", "veth", "peer", "name", veth + "p", "netns", cli)
        sh("ip", "-n", srv, "addr", "add", f"{SERVER_IP}/24", "dev", veth)
        sh("ip", "-n", cli, "addr", "add", f"{CLIENT_IP}/24", "dev", veth + "p")
        for ns, dev in ((srv, veth), (cli, veth + "p"), (srv, "lo"), (cli, "lo")):
            sh("ip", "-n", ns, "link", "set", dev, "up")
        yield srv, cli, veth
    finally:
        for ns in (srv, cli):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def xdp_bundle(src: Path, dest: Path, ring_bytes: int, max_tokens: int = 1024) -> Path:
    """A copy of the chat bundle with its XDP program rebuilt for these record and ring sizes
    (small rings make overload easy to reach)."""
    from zlc.deploy import ebpf

    shutil.copytree(src, dest)
    built = ebpf.build_into_bundle(dest, ring_bytes=ring_bytes, max_tokens=max_tokens)
    assert built.object is not None, built.reason
    return dest


def run_client(cli_ns: str, tmp: Path, jobs: dict[str, Any]) -> dict[str, Any]:
    path = tmp / f"jobs-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps(jobs))
    out = subprocess.run(["ip", "netns", "exec", cli_ns, sys.executable, str(CLIENT), SERVER_IP, str(PORT),
                          str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def start(server_process: Any, bundle: Path, netns: tuple[str, str, str], *args: str) -> Any:
    srv, _, veth = netns
    return server_process(bundle, "--device", "reference", "--host", SERVER_IP, "--xdp", veth, "--insecure-frames",
                          *args, prefix=("ip", "netns", "exec", srv), ports=("--port", "0", "--udp-port", str(PORT)))


def scrape(server: Any, srv_ns: str) -> str:
    out = subprocess.run(["ip", "netns", "exec", srv_ns, sys.executable, "-c",
                          "import sys, urllib.request; "
                          f"sys.stdout.write(urllib.request.urlopen('http://{server.host}:{server.port}/metrics', "
                          "timeout=10).read().decode())"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric `name` whose labels include `labels` (Prometheus text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def test_the_verifier_accepts_the_program(tmp_path: Path) -> None:
    from zlc.deploy import ebpf

    built = ebpf.build(tmp_path)
    assert built.object is not None, built.reason
    pin = Path("/sys/fs/bpf")
    if not (pin / ".").exists() or subprocess.run(["mountpoint", "-q", str(pin)]).returncode != 0:
        subprocess.run(["mount", "-t", "bpf", "bpf", str(pin)], capture_output=True)
    if shutil.which("bpftool") is None:
        pytest.skip("bpftool not installed (the serving tests below load the program through libbpf anyway)")
    name = pin / f"zlc_verify_{uuid.uuid4().hex[:6]}"
    try:
        out = subprocess.run(["bpftool", "prog", "load", str(built.object), str(name), "type", "xdp"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        show = subprocess.run(["bpftool", "prog", "show", "pinned", str(name)], capture_output=True, text=True)
        assert "zlc_xdp" in show.stdout
    finally:
        name.unlink(missing_ok=True)


def test_frames_through_xdp_reach_the_ring_and_come_back(chat_bundle: Path, netns: Any, tmp_path: Path,
                                                          server_process: Any) -> None:
    import zlc

    bundle = xdp_bundle(chat_bundle, tmp_path / "xdp.zlc", ring_bytes=1 << 22)
    ref = zlc.load(chat_bundle)
    prompts = [[72, 105], [1, 2, 3], [200, 10, 30, 40], [257, 117, 10]]
    expected = {i: ref.generate(p, 3, device="reference", eos=ref.eos_token_ids) for i, p in enumerate(prompts)}
    s = start(server_process, bundle, netns)
    try:
        assert s.info["xdp"] == [netns[2], PORT]
        jobs = {"frames": [frames.encode_request(i, p, 3).hex() for i, p in enumerate(prompts)],
                "expect_replies": list(range(len(prompts)))}
        got = run_client(netns[1], tmp_path, jobs)
        assert got["missing"] == []
        for i in range(len(prompts)):
            replies = got["replies"][str(i)]
            assert [r[1] for r in replies] == expected[i]
            assert replies[-1][0] & frames.FrameFlag.LAST
        text = scrape(s, netns[0])
        assert value(text, "zlc_xdp_program_frames", outcome="accepted") == len(prompts)
        assert value(text, "zlc_frames_total", outcome="accepted", transport="xdp") == len(prompts)
        assert value(text, "zlc_frames_total", outcome="accepted", transport="udp") == 0
    finally:
        s.stop()
    # detached on exit: no XDP program left on the interface
    link = subprocess.run(["ip", "-n", netns[0], "link", "show", netns[2]], capture_output=True, text=True)
    assert "prog/xdp" not in link.stdout


def test_malformed_frames_are_counted_and_never_reach_the_ring(chat_bundle: Path, netns: Any, tmp_path: Path,
                                                               server_process: Any) -> None:
    # records of 64 tokens: a 200-token frame (824 bytes) still fits one packet but not a record
    bundle = xdp_bundle(chat_bundle, tmp_path / "xdp.zlc", ring_bytes=1 << 22, max_tokens=64)
    good = frames.encode_request(50, [72, 105], 2)
    bad_magic = b"XXXX" + good[4:]
    short = good[:20]
    lying = frames.HEADER.pack(frames.MAGIC, frames.VERSION, 0, 51, 2, 10) + b"\0" * 8  # says 10 tokens, has 2
    bad_version = frames.HEADER.pack(frames.MAGIC, 9, 0, 52, 2, 1) + b"\1\0\0\0"
    oversize = frames.encode_request(53, [5] * 200, 2)  # more tokens than a ring record holds
    s = start(server_process, bundle, netns)
    try:
        jobs = {"frames": [x.hex() for x in (bad_magic, short, lying, bad_version, oversize, good)],
                "expect_replies": [51, 52, 53, 50], "linger_s": 0.5}
        got = run_client(netns[1], tmp_path, jobs)
        assert got["missing"] == []
        code = {int(k): v[-1] for k, v in got["replies"].items()}
        assert code[51] == [frames.FrameFlag.ERROR | frames.FrameFlag.LAST, frames.FrameErrorCode.MALFORMED]
        assert code[52] == [frames.FrameFlag.ERROR | frames.FrameFlag.LAST, frames.FrameErrorCode.MALFORMED]
        # too long for a record -> passed to the socket, which refuses it against the context (128)
        assert code[53] == [frames.FrameFlag.ERROR | frames.FrameFlag.LAST, frames.FrameErrorCode.BAD_REQUEST]
        assert code[50][0] & frames.FrameFlag.LAST and not code[50][0] & frames.FrameFlag.ERROR
        text = scrape(s, netns[0])
        assert value(text, "zlc_xdp_program_frames", outcome="malformed") == 4  # bad magic, short, lying, version
        assert value(text, "zlc_xdp_program_frames", outcome="too_long") == 1
        assert value(text, "zlc_xdp_program_frames", outcome="accepted") == 1  # only the good one
        assert value(text, "zlc_frames_total", outcome="accepted", transport="xdp") == 1
        assert value(text, "zlc_frames_total", outcome="malformed", transport="udp") == 4
    finally:
        s.stop()


def test_overload_loses_nothing(chat_bundle: Path, netns: Any, tmp_path: Path, server_process: Any) -> None:
    """A BPF ring of 4 records and a burst of 400 frames: the ring overflows, the rest goes to the
    socket; every frame gets its reply and accepted + passed = sent."""
    n = 400
    bundle = xdp_bundle(chat_bundle, tmp_path / "xdp.zlc", ring_bytes=1 << 14)
    s = start(server_process, bundle, netns, "--max-queue", str(n))
    try:
        jobs = {"frames": [frames.encode_request(1000 + i, [72, 105, i % 200], 1).hex() for i in range(n)],
                "expect_replies": [1000 + i for i in range(n)], "timeout_s": 90}
        got = run_client(netns[1], tmp_path, jobs)
        assert got["missing"] == [], f"{len(got['missing'])} frames got no reply"
        errors = [v[-1] for v in got["replies"].values() if v[-1][0] & frames.FrameFlag.ERROR]
        assert all(e[1] == frames.FrameErrorCode.OVERLOADED for e in errors), errors[:3]
        text = scrape(s, netns[0])
        accepted = value(text, "zlc_xdp_program_frames", outcome="accepted")
        passed = sum(value(text, "zlc_xdp_program_frames", outcome=o) for o in ("ring_full", "malformed", "too_long"))
        assert value(text, "zlc_xdp_program_frames", outcome="ring_full") > 0, "the ring never filled up"
        assert accepted + passed == n
        seen = value(text, "zlc_frames_total", transport="xdp") + value(text, "zlc_frames_total", transport="udp")
        assert seen == n  # every frame reached the server: through the ring or the socket
        print(f"xdp overload: {n} sent, {accepted:.0f} through the ring, {passed:.0f} through the socket, "
              f"{len(errors)} answered OVERLOADED, 0 lost")
    finally:
        s.stop()
