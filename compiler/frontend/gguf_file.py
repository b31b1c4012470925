"""Reading a GGUF file for the GGUF frontend (gguf.py): the metadata, typed and checked, and each
tensor as a float32 array in Hugging Face's [out, in] orientation.

Parsing is `gguf`'s (`GGUFReader`, a memory map), dequantization is `gguf.quants.dequantize`, so
zlc reads every block format llama.cpp writes exactly as llama.cpp's own Python does. A tensor in a
block format the kernels stream (ir/quant.py FORMATS) is also handed out as its blocks
(`GgufFile.packed`). Every failure is one ModelFormatError line naming the file and the field or
tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from zlc.errors import ModelFormatError
from zlc.gguf_reader import open_gguf

GGUF_MAGIC = b"GGUF"


def is_gguf(path: Any) -> bool:
    """Whether `path` (any object) names a file that starts with the GGUF magic (any suffix)."""
    if not isinstance(path, (str, Path)):
        return False
    p = Path(path)
    try:
        with p.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _reader(path: str, mtime_ns: int, size: int) -> Any:
    """The file's GGUFReader, shared with the tokenizer stage (zlc.gguf_reader: opened once per
    file version and kept)."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelFormatError(f"{Path(path).name}: reading a GGUF file needs the gguf package "
                               "(pip install 'zlc[hf]')") from None
    return open_gguf(path)


def gguf_tokenizer(model: Any) -> Path | None:
    """`model` itself when it is a GGUF file with a tokenizer (what `zlc compile` bundles), else None."""
    return Path(model) if is_gguf(model) and GgufFile(model).has("tokenizer.ggml.model") else None


def packed_tensor(path: str | Path) -> tuple[str, str] | None:
    """(name, type) of the first tensor of a GGUF file in a block format the kernels stream, if any."""
    from zlc.ir.quant import format_of_ggml

    f = GgufFile(path)
    return next(((t.name, t.tensor_type.name) for t in f.reader.tensors if format_of_ggml(t.tensor_type.name)), None)


class GgufFile:
    """One GGUF file: `meta(key)` for metadata, `weight(name)` for a tensor as float32."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.name = self.path.name
        try:
            st = self.path.stat()
            self.reader = _reader(str(self.path.resolve()), st.st_mtime_ns, st.st_size)
        except OSError as e:
            raise ModelFormatError(f"{self.name}: cannot read ({e.strerror or e})") from None
        except ModelFormatError:
            raise
        except Exception as e:  # gguf raises ValueError/IndexError/struct errors on a damaged file
            why = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelFormatError(f"{self.name}: not a readable GGUF file (truncated or corrupt: {why})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = str(self.meta("general.architecture"))

    def error(self, what: str) -> ModelFormatError:
        return ModelFormatError(f"{self.name}: {what}")

    # ---- metadata ------------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return self.reader.get_field(key.format(arch=getattr(self, "arch", ""))) is not None

    def meta(self, key: str, default: Any = ...) -> Any:
        """The value of metadata `key` ("{arch}" is replaced by the architecture); a missing key
        without a default is an error naming it."""
        key = key.format(arch=getattr(self, "arch", ""))
        field = self.reader.get_field(key)
        if field is None:
            if default is ...:
                raise self.error(f"metadata '{key}' is missing")
            return default
        try:
            return field.contents()
        except Exception as e:
            raise self.error(f"metadata '{key}' is unreadable ({type(e).__name__}: {e})") from None

    def meta_int(self, key: str, default: Any = ..., *, minimum: int = 1) -> int:
        v = self.meta(key, default)
        if isinstance(v, list):  # per-layer arrays (head counts): zlc's families keep them uniform
            if not v or any(x != v[0] for x in v):
                raise self.error(f"metadata '{key.format(arch=self.arch)}' varies per layer ({v[:4]}...), "
                                 "which zlc does not support")
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < minimum:
            raise self.error(f"metadata '{key.format(arch=self.arch)}' must be an integer >= {minimum}, got {v!r}")
        return int(v)

    def meta_float(self, key: str, default: Any = ...) -> float:
        v = self.meta(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not np.isfinite(v) or v <= 0:
            raise self.error(f"metadata '{key.format(arch=self.arch)}' must be a positive number, got {v!r}")
        return float(v)

    # ---- tensors -------------------------------------------------------------------------------
    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, outermost first (numpy / Hugging Face order; GGUF lists it reversed)."""
        return tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))

    def _tensor(self, name: str) -> Any:
        t = self.tensors.get(name)
        if t is None:
            raise self.error(f"tensor '{name}' is missing (the {self.arch} architecture needs it)")
        return t

    def weight(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor `name` as float32 of `shape` (checked against the file's, which the metadata
        implies). The one place GGUF blocks become floats: packed weight formats hand the blocks
        through from here instead."""
        from gguf.quants import dequantize

        t = self._tensor(name)
        have = self.shape(name)
        if have != tuple(shape):
            raise self.error(f"tensor '{name}' has shape {list(have)} but the metadata implies {list(shape)}")
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise self.error(f"tensor '{name}' has type {t.tensor_type.name}, which gguf cannot dequantize") from None
        except Exception as e:  # a short data section shows as a reshape/view error
            raise self.error(f"tensor '{name}' ({t.tensor_type.name}) is unreadable (truncated file? "
                             f"{type(e).__name__}: {e})") from None
        if w.size != int(np.prod(shape)):
            raise self.error(f"tensor '{name}' holds {w.size} values, not the {int(np.prod(shape))} of {list(shape)} "
                             "(truncated file?)")
        return np.ascontiguousarray(w.reshape(shape), dtype=np.float32)

    def packed(self, name: str, shape: tuple[int, int]) -> tuple[Any, str]:
        """Matrix `name` ([N, K]) as its blocks (ir/quant.QuantizedWeight, the file's bytes, not
        copied), or (None, why it is dense) where the kernels stream no such blocks."""
        from zlc.ir.quant import QuantizedWeight, format_of_ggml

        t = self._tensor(name)
        have = self.shape(name)
        if have != tuple(shape):
            raise self.error(f"tensor '{name}' has shape {list(have)} but the metadata implies {list(shape)}")
        kind = t.tensor_type.name
        fmt = format_of_ggml(kind)
        if fmt is None:
            return None, f"{kind} (no packed kernel body: dequantized)" if kind not in ("F32", "F16", "BF16") else kind
        if shape[1] % fmt.block_k:
            raise self.error(f"tensor '{name}' ({kind}) has rows of {shape[1]} values, not a multiple of its "
                             f"{fmt.block_k}-value blocks")
        blocks = np.asarray(t.data)
        if blocks.dtype != np.uint8 or blocks.size != shape[0] * (shape[1] // fmt.block_k) * fmt.block_bytes:
            raise self.error(f"tensor '{name}' ({kind}) holds {blocks.size} bytes, not the "
                             f"{shape[0] * (shape[1] // fmt.block_k) * fmt.block_bytes} of {list(shape)} "
                             "(truncated file?)")
        q = QuantizedWeight(fmt, blocks.reshape(shape[0], -1), int(shape[0]), int(shape[1]))
        q.check(f"tensor '{name}'")
        return q, ""
