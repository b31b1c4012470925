"""XDP ingress, the runtime side: load the bundle's BPF object, attach it to an interface, and drain
its BPF ring buffer (frames the program validated and copied) into zlc serve's frame path.

Loader choice: libbpf itself, through ctypes. libbpf is the kernel's reference loader (relocations,
BTF, map creation, the ring-buffer consumer protocol with its busy bit and discards), maintained
with the kernel and packaged everywhere (Debian: libbpf1); no maintained Python binding exists
(bcc does not work on this kind of host, pyroute2 attaches but does not load objects), and
bpftool would leave state pinned in bpffs. The program is attached through a BPF *link*
(`bpf_program__attach_xdp`): the link lives in this process's file descriptors, so the program is
detached when the process exits, even by a crash, and no pinned map or program is left behind.

Draining runs on the serving thread (the asyncio loop, woken through libbpf's epoll fd): the
request ring is single-producer, and that thread is its producer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zlc.errors import ZlcError

#: struct zlc_record's fixed part (templates/ebpf/zlc_xdp.c): frame_len, src_addr (network order),
#: src_port (network order), two reserved fields; the frame follows.
RECORD_HEAD = struct.Struct("<I4sHHI")
STATS = ("accepted", "malformed", "ring_full", "too_long")

_SAMPLE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_lib: Any = None


def libbpf() -> Any:
    """libbpf.so.1 with the signatures used here; ZlcError if it is not installed."""
    global _lib
    if _lib is not None:
        return _lib
    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:
        raise ZlcError(f"XDP ingress needs libbpf (apt install libbpf1): {e}") from None
    vp, cp, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
    for fn, res, args in [
        ("bpf_object__open_file", vp, [cp, vp]), ("bpf_object__load", i, [vp]), ("bpf_object__close", None, [vp]),
        ("bpf_object__find_program_by_name", vp, [vp, cp]), ("bpf_object__find_map_by_name", vp, [vp, cp]),
        ("bpf_map__fd", i, [vp]), ("bpf_program__attach_xdp", vp, [vp, i]), ("bpf_link__destroy", i, [vp]),
        ("bpf_map_update_elem", i, [i, vp, vp, ctypes.c_uint64]), ("bpf_map_lookup_elem", i, [i, vp, vp]),
        ("ring_buffer__new", vp, [i, _SAMPLE_FN, vp, vp]), ("ring_buffer__consume", i, [vp]),
        ("ring_buffer__epoll_fd", i, [vp]), ("ring_buffer__free", None, [vp]),
        ("libbpf_num_possible_cpus", i, []), ("libbpf_get_error", ctypes.c_long, [vp]),
    ]:
        f = getattr(lib, fn)
        f.restype, f.argtypes = res, args
    _lib = lib
    return lib


def _errno_msg(what: str) -> str:
    e = ctypes.get_errno()
    return f"{what}: {os.strerror(e) if e else 'failed'}"


class XdpIngress:
    """The attached program and its ring. ``on_frame(frame: bytes, addr: (host, port))`` is called
    for each frame by ``consume()``; ``close()`` detaches (so does process exit)."""

    def __init__(self, object_path: str | Path, interface: str, port: int,
                 on_frame: Callable[[bytes, tuple[str, int]], None]):
        self.interface, self.port, self.on_frame = interface, port, on_frame
        lib = self.lib = libbpf()
        self._obj = self._link = self._rb = None
        if os.geteuid() != 0:
            raise ZlcError("--xdp needs root (CAP_BPF and CAP_NET_ADMIN) to load and attach the program")
        try:
            self.ifindex = socket.if_nametoindex(interface)
        except OSError:
            raise ZlcError(f"--xdp {interface}: no such network interface") from None
        path = Path(object_path)
        if not path.is_file():
            raise ZlcError(f"no XDP object at {path}; build it with `zlc deploy build BUNDLE` (needs clang)")
        try:
            self._obj = lib.bpf_object__open_file(str(path).encode(), None)
            if not self._obj:
                raise ZlcError(_errno_msg(f"cannot open {path}"))
            if lib.bpf_object__load(self._obj) != 0:  # libbpf printed the verifier's log to stderr
                raise ZlcError(_errno_msg(f"the kernel refused {path.name} (libbpf's log above says why)"))
            cfg = lib.bpf_object__find_map_by_name(self._obj, b"zlc_config")
            ring = lib.bpf_object__find_map_by_name(self._obj, b"zlc_ring")
            stats = lib.bpf_object__find_map_by_name(self._obj, b"zlc_stats")
            prog = lib.bpf_object__find_program_by_name(self._obj, b"zlc_xdp")
            if not (cfg and ring and stats and prog):
                raise ZlcError(f"{path} is not zlc's XDP program (maps/program missing)")
            self._stats_fd = lib.bpf_map__fd(stats)
            key, value = ctypes.c_uint32(0), ctypes.c_uint32(port)
            if lib.bpf_map_update_elem(lib.bpf_map__fd(cfg), ctypes.byref(key), ctypes.byref(value), 0) != 0:
                raise ZlcError(_errno_msg("cannot configure the XDP program's port"))
            self._sample = _SAMPLE_FN(self._on_sample)  # kept referenced: libbpf holds the pointer
            self._rb = lib.ring_buffer__new(lib.bpf_map__fd(ring), self._sample, None, None)
            if not self._rb:
                raise ZlcError(_errno_msg("cannot map the BPF ring buffer"))
            self._link = lib.bpf_program__attach_xdp(prog, self.ifindex)
            if not self._link:
                raise ZlcError(_errno_msg(f"cannot attach XDP to {interface}") +
                               " (another XDP program attached? see `ip link show`)")
        except BaseException:
            self.close()
            raise
        self.ncpus = lib.libbpf_num_possible_cpus()

    @property
    def epoll_fd(self) -> int:
        """Readable when the program has submitted records (libbpf's epoll over the ring)."""
        return int(self.lib.ring_buffer__epoll_fd(self._rb))

    def _on_sample(self, ctx: Any, data: int, size: int) -> int:
        head = ctypes.string_at(data, RECORD_HEAD.size)
        frame_len, addr, port, _, _ = RECORD_HEAD.unpack(head)
        if frame_len > size - RECORD_HEAD.size:
            return 0  # cannot happen with our program; never read past the record
        frame = ctypes.string_at(data + RECORD_HEAD.size, frame_len)
        self.on_frame(frame, (socket.inet_ntoa(addr), socket.ntohs(port)))
        return 0

    def consume(self) -> int:
        """Hands every record in the ring to on_frame; returns how many."""
        n = int(self.lib.ring_buffer__consume(self._rb))
        if n < 0:
            raise ZlcError(f"reading the BPF ring buffer failed: {os.strerror(-n)}")
        return n

    def stats(self) -> dict[str, int]:
        """The program's counters, summed over CPUs."""
        out = {}
        values = (ctypes.c_uint64 * self.ncpus)()
        for i, name in enumerate(STATS):
            key = ctypes.c_uint32(i)
            if self.lib.bpf_map_lookup_elem(self._stats_fd, ctypes.byref(key), values) != 0:
                raise ZlcError(_errno_msg("cannot read the XDP counters"))
            out[name] = int(sum(values))
        return out

    def close(self) -> None:
        lib = self.lib
        if self._link:
            lib.bpf_link__destroy(self._link)
            self._link = None
        if self._rb:
            lib.ring_buffer__free(self._rb)
            self._rb = None
        if self._obj:
            lib.bpf_object__close(self._obj)
            self._obj = None
