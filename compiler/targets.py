"""Named compilation targets (the `TARGETS` table below), the CPU ISA levels of the native kernel,
and the batch-1 decode roofline.

The latency floor of a batch-1 decode step is the bytes it must read (weights once, the KV cache
up to the current context) divided by the memory bandwidth. `zlc compile --target` names one of
these (docs/cli.md lists them); this module is the single table of their facts.

`ISA_LEVELS` is shared by the two sides of the native CPU kernel: codegen compiles one shared
library per level (its compiler flags), the runtime picks the best level the host's CPU flags
allow (its `requires`). Both read it here because neither may import the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .abi.formats import FORMATS
from .bundle import check_numerics
from .errors import ZlcError

if TYPE_CHECKING:  # the IR (and torch) load only where traffic is priced: the native runtime imports this
    from .ir import DType, Graph


@dataclass(frozen=True)
class Target:
    name: str
    arch: str  # "sm_86", ... or "interpreter" (Triton's CPU interpreter)
    compute_capability: int | None  # 86 for sm_86; None for the CPU target
    bandwidth_gbs: float | None  # spec memory bandwidth, GB/s (lower bound where SKUs differ)
    sms: int = 2  # streaming multiprocessors: the persistent grid (the CPU target: programs)
    l2_mb: float = 0.0  # L2 cache, MB (the latency model's, and the build's L2 prefetch rule)

    @property
    def is_gpu(self) -> bool:
        return self.compute_capability is not None

    @property
    def weight_formats(self) -> frozenset[str]:
        """The packed weight formats (zlc.abi.formats) its kernel streams as a Linear's weights; a
        matrix in any other format is compiled dense for it (passes/quantize.py)."""
        return TRITON_WEIGHT_FORMATS if self.is_gpu else NATIVE_WEIGHT_FORMATS

    def streams(self, weight_format: str) -> bool:
        return weight_format in self.weight_formats


# Capabilities of the kernels, per target kind. The Triton kernel (every GPU target) streams the
# GGUF blocks whose fields it reads as planes (runtime/q_planes.py): q8_0, q4_0, q4_1. The native
# CPU kernel streams every format.
TRITON_WEIGHT_FORMATS = frozenset({"q8_0", "q4_0", "q4_1"})
NATIVE_WEIGHT_FORMATS = frozenset(FORMATS)


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("a10", "sm_86", 86, 600.0, 72, 6),
    Target("a100", "sm_80", 80, 1555.0, 108, 40),  # 40 GB SKU; the 80 GB SKU has 2039 GB/s
    Target("l4", "sm_89", 89, 300.0, 58, 48),
    Target("rtx3090", "sm_86", 86, 936.0, 82, 6),
    Target("rtx4090", "sm_89", 89, 1008.0, 128, 72),
    Target("h100", "sm_90", 90, 3350.0, 132, 50),
    Target("h200", "sm_90", 90, 4800.0, 132, 50),
    Target("cpu", "interpreter", None, None),
)}


def streamed_by(weight_format: str, targets: Sequence[str]) -> bool:
    """Whether every target named streams `weight_format` (Target.weight_formats)."""
    return all(get_target(t).streams(weight_format) for t in targets)


def get_target(name: str) -> Target:
    t = TARGETS.get(name.lower())
    if t is None:
        raise ZlcError(f"unknown target '{name}'; known targets: {', '.join(TARGETS)}")
    return t


@dataclass(frozen=True)
class IsaLevel:
    """One build of the native CPU kernel: a psABI microarchitecture level on x86-64, or the
    compiler's default for the machine elsewhere."""

    name: str  # "x86-64-v4"; also the library's file name in the bundle (native/<name>.so)
    machine: str  # platform.machine() of the hosts it runs on
    cflags: tuple[str, ...]  # what the C compiler gets for this level
    requires: tuple[str, ...]  # /proc/cpuinfo flags a host needs to run it


_V2 = ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
_V3 = _V2 + ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")

# Best first: the runtime takes the first one the host can run.
ISA_LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("x86-64-v4", "x86_64", ("-march=x86-64-v4",), _V4),  # AVX-512: 16 lanes
    IsaLevel("x86-64-v3", "x86_64", ("-march=x86-64-v3",), _V3),  # AVX2 + FMA: 8 lanes
    IsaLevel("x86-64-v2", "x86_64", ("-march=x86-64-v2",), _V2),  # SSE4.2: 4 lanes, no FMA
)


# The integer dot-product extensions, built only for `fast` numerics (the exact kernel has no use
# for them): each is its base level plus the one extension, preferred to that base where granted.
VNNI_LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("x86-64-v4-vnni", "x86_64", ("-march=x86-64-v4", "-mavx512vnni"), _V4 + ("avx512_vnni",)),
    IsaLevel("x86-64-v3-vnni", "x86_64", ("-march=x86-64-v3", "-mavxvnni"), _V3 + ("avx_vnni",)),
)


def isa_levels_for(machine: str, numerics: str = "exact") -> list[IsaLevel]:
    """The levels to build on (and for) a `machine`, best first: the x86-64 levels (with `fast`
    numerics each VNNI level just before its base), else one generic build."""
    levels = [lv for lv in ISA_LEVELS if lv.machine == machine]
    if check_numerics(numerics) == "fast":
        vnni = {lv.name.removesuffix("-vnni"): lv for lv in VNNI_LEVELS if lv.machine == machine}
        levels = [x for lv in levels for x in ([vnni[lv.name]] if lv.name in vnni else []) + [lv]]
    return levels or [IsaLevel(f"{machine}-generic", machine, (), ())]



@dataclass(frozen=True)
class DecodeTraffic:
    weight_bytes: int  # read once per decode step
    kv_bytes_per_token: int  # KV cache read per token of context
    context: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes_per_token * self.context

    def floor_us(self, target: Target) -> float | None:
        """Bandwidth floor in microseconds on `target` (None for the CPU target)."""
        if target.bandwidth_gbs is None:
            return None
        return self.total_bytes / (target.bandwidth_gbs * 1e9) * 1e6


def decode_traffic(decode: Graph, *, context: int, weight_dtype: DType | None = None) -> DecodeTraffic:
    """Bytes one decode step reads: every weight the graph uses, except that an Embedding reads
    one row per token (a tied LM head still reads the whole table), plus the KV cache up to
    `context` tokens. `weight_dtype` prices weights and cache as that type (e.g. bf16 on a GPU)."""
    row_only: dict[int, int] = {}  # embedding tables: bytes of one row
    full: set[int] = set()
    for n in decode.nodes:
        for i, v in enumerate(n.inputs):
            if v is None or v.kind != "const" or v.shape is None:
                continue
            if n.op == "Embedding" and i == 0:  # a packed table: one row of blocks
                row_only[id(v)] = v.quant.nbytes // v.quant.n if v.quant is not None else \
                    int(v.shape[1]) * _size(v.dtype, weight_dtype)  # type: ignore[arg-type]
            elif n.op == "RoPE" and i in (1, 2):
                row_only.setdefault(id(v), int(v.shape[-1]) * _size(v.dtype, weight_dtype))  # type: ignore[arg-type]
            else:
                full.add(id(v))
    weights = 0
    for v in decode.consts.values():
        if id(v) in full and v.quant is not None:  # packed blocks: their own bytes
            weights += v.quant.nbytes
        elif id(v) in full:
            weights += (v.type.numel() or 0) * _size(v.dtype, weight_dtype)
        elif id(v) in row_only:
            weights += row_only[id(v)]
    kv = 0
    for s in decode.state:
        shape = s.shape or ()
        if len(shape) == 4:  # [1, kv_heads, max_seq, head_dim]: one position is heads * head_dim
            kv += int(shape[1]) * int(shape[3]) * _size(s.dtype, weight_dtype)  # type: ignore[arg-type]
    return DecodeTraffic(weights, kv, context)


def _size(dt: DType, override: DType | None) -> int:
    if override is not None and dt.is_float:
        return override.itemsize
    return dt.itemsize
