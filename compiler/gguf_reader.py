"""One reader of GGUF files for the GGUF frontend (frontend/gguf_file.py) and the bundled
tokenizer (runtime/tokenizer.py): `gguf`'s GGUFReader (a read-only memory map), opened once per
file version and kept, because parsing a real vocabulary's metadata (49k-152k tokens and merges,
one numpy view per string) takes seconds and a compile reads the file several times (import,
verify's import, the tokenizer). Errors are the callers' to word: ImportError without `gguf`,
OSError, and ValueError / IndexError / struct errors from a damaged file.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

__all__ = ["field", "open_gguf"]


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int) -> Any:
    return _lean_reader()(path)


@functools.cache
def _lean_reader() -> type:
    """GGUFReader with each array field kept as one view (numbers) or one byte run and its offsets
    (strings) instead of gguf's numpy view per element: a 152k-token vocabulary's tokens, types,
    scores and merges cost ~400 MB of Python objects the other way, more than a 0.5B model's
    weights take above 1x (issue 33's compile memory). `contents()` returns the same lists."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType
    from gguf.gguf_reader import ReaderField

    class StringArray(ReaderField):
        __slots__ = ()

        def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
            blob, starts, ends = self.parts[-3], self.parts[-2], self.parts[-1]
            one = lambda i: str(blob[starts[i]:ends[i]].tobytes(), encoding="utf-8")  # noqa: E731
            if isinstance(index_or_slice, int):
                return one(index_or_slice)
            return [one(i) for i in range(len(starts))[index_or_slice]]

    class NumberArray(ReaderField):
        __slots__ = ()

        def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
            vals = self.parts[-1]
            return vals[index_or_slice].tolist()

    class LeanReader(GGUFReader):  # type: ignore[misc]
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, n, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                vals = self._get(offs, nptype, n)
                return offs + int(vals.nbytes) - orig_offs, [raw_itype, alen, vals], [2], [GGUFValueType.ARRAY, itype]
            if itype != GGUFValueType.STRING:  # arrays of arrays: gguf's own parts
                return super()._get_field_parts(orig_offs, raw_type)
            starts, ends = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
            pos = offs
            for i in range(n):
                ln = int(self._get(pos, np.uint64)[0])  # in the file's byte order
                starts[i], ends[i] = pos + 8 - offs, pos + 8 + ln - offs
                pos += 8 + ln
            blob = self.data[offs:pos]
            return pos - orig_offs, [raw_itype, alen, blob, starts, ends], [2], [GGUFValueType.ARRAY, itype]

        def _push_field(self, field: ReaderField, skip_sum: bool = False) -> int:
            if field.types[:1] == [GGUFValueType.ARRAY] and len(field.types) == 2:
                cls = StringArray if field.types[1] == GGUFValueType.STRING else NumberArray
                if cls is StringArray or self.gguf_scalar_to_np.get(field.types[1]) is not None:
                    field = cls(*field)
            return super()._push_field(field, skip_sum)

    return LeanReader


def open_gguf(path: str | Path) -> Any:
    """The GGUFReader of `path` as it is now (a changed file is read again)."""
    p = Path(path)
    st = p.stat()
    return _open(str(p.resolve()), st.st_mtime_ns, st.st_size)


def field(reader: Any, key: str, default: Any = None) -> Any:
    """Metadata `key` as Python values (a string, a number, a list), or `default` when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()
