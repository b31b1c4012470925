"""The packed weight formats the kernels stream: each format's code (the Linear descriptor's
w_format word, the Embed descriptor's table_format word), its block geometry and its fields.

A packed matrix [N, K] is N rows of K / block_k blocks of block_bytes bytes; `fields` is a block's
layout, in byte order (what each run of bytes holds). The IR's side (what each format means, the
dequantization oracle) is zlc.ir.quant; the plane layout the Triton kernel reads
(runtime/q_planes.py) is `fields` split into one plane per field; which formats a kernel streams is
a target's capability (zlc.targets). The C kernel's block tables are generated from `FORMATS`
(`format_constants()`: QF_<NAME> codes, QF_BLOCK_BYTES); the Triton kernel compares w_format with
the same QF_ names.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK = 32  # K-values per (sub-)block of the GGUF formats: the kernels' unit of activation sums
NBITS_BLOCKS = tuple(16 << i for i in range(7))  # MatMulNBits block sizes with a format: 16 .. 1024
NBITS_HEAD = 5  # bytes before a nbits4 block's quants: f32 scale, u8 zero point


@dataclass(frozen=True)
class WeightFormat:
    name: str
    code: int  # the descriptors' format word (0: dense, in the W arena)
    block_bytes: int
    block_k: int = BLOCK  # K-values per block (256: the K-quants' super-blocks)
    quantizable: bool = True  # gguf's Python quantizer writes it (the K-quants: llama.cpp's only)
    # a block's fields in byte order: (name, bytes); d and m f16 scales, q the quants
    fields: tuple[tuple[str, int], ...] = ()

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / self.block_k

    @property
    def constant(self) -> str:
        """The kernels' name of its code: QF_Q4_0, QF_NBITS4_B32."""
        return f"QF_{self.name.upper()}"


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("q8_0", 1, 34, fields=(("d", 2), ("q", 32))),
    WeightFormat("q4_0", 2, 18, fields=(("d", 2), ("q", 16))),
    WeightFormat("q4_1", 3, 20, fields=(("d", 2), ("m", 2), ("q", 16))),
    WeightFormat("q5_0", 4, 22, fields=(("d", 2), ("qh", 4), ("q", 16))),
    WeightFormat("q5_1", 5, 24, fields=(("d", 2), ("m", 2), ("qh", 4), ("q", 16))),
    WeightFormat("q4_k", 6, 144, 256, False, (("d", 2), ("dmin", 2), ("scales", 12), ("q", 128))),
    WeightFormat("q5_k", 7, 176, 256, False, (("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("q", 128))),
    WeightFormat("q6_k", 8, 210, 256, False, (("ql", 128), ("qh", 64), ("scales", 16), ("d", 2))),
)}
FORMATS.update({f"nbits4_b{b}": WeightFormat(f"nbits4_b{b}", FORMATS["q6_k"].code + 1 + i, NBITS_HEAD + b // 2, b,
                                             False, (("s", 4), ("z", 1), ("q", b // 2)))
                for i, b in enumerate(NBITS_BLOCKS)})
BY_CODE: dict[int, WeightFormat] = {f.code: f for f in FORMATS.values()}
assert sorted(BY_CODE) == list(range(1, len(FORMATS) + 1)), "format codes run 1..n without gaps"
assert all(sum(n for _, n in f.fields) == f.block_bytes for f in FORMATS.values()), "fields fill each block"

QF_MAX = max(BY_CODE)  # the highest code
QF_NBITS = FORMATS[f"nbits4_b{NBITS_BLOCKS[0]}"].code  # the first nbits4 format (block 16): 16 << (f - QF_NBITS)
QF_KQUANT = FORMATS["q4_k"].code  # the first K-quant (256-value super-blocks)
QF_GGUF_MAX = FORMATS["q6_k"].code  # the last GGUF format (the C kernel's block-size table)


def format_constants() -> dict[str, int | str]:
    """The kernels' format constants: QF_<NAME> per code, QF_MAX, QF_NBITS, QF_KQUANT, QF_GGUF_MAX,
    NB_HD (a nbits4 block's head bytes) and QF_BLOCK_BYTES, the C initializer of the GGUF formats'
    bytes per block by code (0 for dense)."""
    out: dict[str, int | str] = {f.constant: f.code for f in FORMATS.values()}
    out.update(QF_MAX=QF_MAX, QF_NBITS=QF_NBITS, QF_KQUANT=QF_KQUANT, QF_GGUF_MAX=QF_GGUF_MAX, NB_HD=NBITS_HEAD,
               QF_BLOCK=BLOCK)
    out["QF_BLOCK_BYTES"] = "{" + ", ".join(str(BY_CODE[c].block_bytes if c else 0)
                                            for c in range(QF_GGUF_MAX + 1)) + "}"
    return out
