"""`zlc serve --devices SPEC`: which executors the server runs, one engine process each.

    cpu:0-1,cpu:2-3      two native (C megakernel) engines, on cores 0-1 and 2-3
    cpu:0,2,cpu:1,3      the same with core lists: numbers without a kind continue the previous list
    cuda:0,cuda:1        one engine per GPU (its process sees only that GPU: CUDA_VISIBLE_DEVICES;
                         the numbers count the GPUs this process sees)
    reference:0,reference:1   the bundle's IR with torch, one engine per core
    cpu                  one native engine on every core this process may use (= --device cpu)

A device with cores confines its engine process (and so its executor's threads) to them
(sched_setaffinity), so engines on disjoint cores never compete for a core. Without --devices
the server runs one engine on --device, as it always has.

Everything wrong with a SPEC is one ZlcError line naming the part at fault.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from zlc.deploy.topology import format_cpulist
from zlc.errors import ZlcError

# Kinds an engine can run, and what follows their colon: CPU executors take cores, cuda one GPU.
CORE_KINDS = ("cpu", "reference")
GPU_KINDS = ("cuda",)
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class DeviceSpecError(ZlcError):
    """A --devices string that does not name a valid set of executors."""


@dataclass(frozen=True)
class Device:
    """One engine's executor: ``kind`` is the engine's --device; ``cores`` the CPUs its process
    is confined to (None: all of this process's); ``gpu`` the GPU index it sees as its only one."""

    kind: str
    cores: frozenset[int] | None = None
    gpu: int | None = None

    @property
    def label(self) -> str:
        """How it is written in a SPEC, and named in /metrics and /health (`cpu:0-1`, `cuda:1`)."""
        if self.gpu is not None:
            return f"{self.kind}:{self.gpu}"
        if self.cores is not None:
            return f"{self.kind}:{format_cpulist(self.cores)}"
        return self.kind

    def env(self, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
        """Environment the engine process adds: a GPU engine sees only its GPU (as device 0). The
        index counts the GPUs this process sees: through CUDA_VISIBLE_DEVICES when that is set."""
        if self.gpu is None:
            return {}
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return {"CUDA_VISIBLE_DEVICES": str(self.gpu)}
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if self.gpu >= len(ids):
            raise DeviceSpecError(f"bad --devices part '{self.label}': CUDA_VISIBLE_DEVICES={visible} leaves "
                                  f"{len(ids)} GPU(s) visible (cuda:0-{len(ids) - 1})" if ids else
                                  f"bad --devices part '{self.label}': CUDA_VISIBLE_DEVICES is empty: no GPU visible")
        return {"CUDA_VISIBLE_DEVICES": ids[self.gpu]}

    def threads(self, requested: int | None) -> int:
        """The executor's threads: --threads when given (per engine), else one per core of the
        device (1 without a core list, today's default)."""
        if requested is not None:
            if self.cores is not None and requested > len(self.cores):
                raise DeviceSpecError(f"--threads {requested} is more than the {len(self.cores)} core(s) of "
                                      f"{self.label}: its threads would share cores")
            return requested
        return len(self.cores) if self.cores is not None else 1


def _cores(text: str, part: str) -> set[int]:
    m = _RANGE.fullmatch(text)
    if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
        raise DeviceSpecError(f"bad --devices part '{part}': '{text}' is not a core number or range like 2-5")
    lo = int(m.group(1))
    return set(range(lo, int(m.group(2) or lo) + 1))


def parse_devices(spec: str, allowed_cores: Iterable[int] | None = None) -> list[Device]:
    """The devices a SPEC names, in order (engine i is the i-th). `allowed_cores`: the CPUs the
    engines may use (default: this process's affinity); a core outside them, or on two devices,
    is an error, as is a GPU named twice or a device kind zlc has no engine for."""
    allowed = frozenset(os.sched_getaffinity(0) if allowed_cores is None else allowed_cores)
    # (kind, its text as written, core or GPU numbers); numbers without a kind join the previous
    parts: list[tuple[str, str, list[set[int]]]] = []
    for token in spec.split(","):
        item = token.strip()
        if not item:
            raise DeviceSpecError(f"bad --devices '{spec}': an empty part (two commas, or one at an end)")
        kind, colon, rest = item.partition(":")
        if not colon and item[0].isdigit():  # a core number or range continuing the previous list
            if not parts or not parts[-1][2]:
                raise DeviceSpecError(f"bad --devices part '{item}': a number needs a device kind before it "
                                      f"(cpu:{item})")
            k, text, nums = parts[-1]
            parts[-1] = (k, f"{text},{item}", [*nums, _cores(item, f"{text},{item}")])
            continue
        kind = kind.strip().lower()
        if kind not in CORE_KINDS + GPU_KINDS:
            raise DeviceSpecError(f"bad --devices part '{item}': unknown device '{kind}' (devices: "
                                  f"{', '.join(CORE_KINDS + GPU_KINDS)}, e.g. cpu:0-1,cpu:2-3 or cuda:0,cuda:1)")
        if colon and not rest.strip():
            raise DeviceSpecError(f"bad --devices part '{item}': nothing after the colon")
        if kind in GPU_KINDS and not colon:
            raise DeviceSpecError(f"bad --devices part '{item}': name the GPU ({kind}:0)")
        parts.append((kind, item, [_cores(rest.strip(), item)] if colon else []))
    devices: list[Device] = []
    owner: dict[int, str] = {}  # core -> the part that has it
    gpus: dict[int, str] = {}
    for kind, text, nums in parts:
        numbers = set().union(*nums) if nums else set()
        if kind in GPU_KINDS:
            if len(numbers) != 1:
                raise DeviceSpecError(f"bad --devices part '{text}': one engine drives one GPU; write "
                                      + ",".join(f"{kind}:{g}" for g in sorted(numbers)))
            (gpu,) = numbers
            if gpu in gpus:
                raise DeviceSpecError(f"bad --devices: GPU {gpu} is named twice ('{gpus[gpu]}' and '{text}')")
            gpus[gpu] = text
            devices.append(Device(kind, gpu=gpu))
            continue
        if not nums:  # a bare CPU kind: every core this process may use
            numbers = set(allowed)
        for c in sorted(numbers):
            if c not in allowed:
                raise DeviceSpecError(f"bad --devices part '{text}': core {c} is not one this process may run "
                                      f"on ({format_cpulist(allowed)})")
            if c in owner:
                raise DeviceSpecError(f"bad --devices: core {c} is in both '{owner[c]}' and '{text}'; engines "
                                      "need disjoint cores")
            owner[c] = text
        devices.append(Device(kind, cores=frozenset(numbers) if nums else None))
    return devices
