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
    from gguf import GGUFReader

    return GGUFReader(path)


def open_gguf(path: str | Path) -> Any:
    """The GGUFReader of `path` as it is now (a changed file is read again)."""
    p = Path(path)
    st = p.stat()
    return _open(str(p.resolve()), st.st_mtime_ns, st.st_size)


def field(reader: Any, key: str, default: Any = None) -> Any:
    """Metadata `key` as Python values (a string, a number, a list), or `default` when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()
