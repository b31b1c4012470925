"""Where the NVIDIA binary tools are: the ones Triton's wheel ships (`ptxas`, `cuobjdump`,
`nvdisasm`), so compiling (`aot`) and reading the machine code back (`zlc.kernelmodel.sass`) need
no CUDA toolkit.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from zlc.errors import ZlcError

__all__ = ["ToolNotFoundError", "find_tool"]


class ToolNotFoundError(ZlcError):
    """An NVIDIA binary tool is neither in Triton's wheel nor on PATH."""


def find_tool(name: str) -> str:
    """Path of an NVIDIA binary tool (`nvdisasm`, `cuobjdump`): $TRITON_<NAME>_PATH, Triton's wheel
    (located without importing triton: slow, and TRITON_INTERPRET may be set), else PATH."""
    env = os.environ.get(f"TRITON_{name.upper()}_PATH")
    if env:
        return env
    spec = importlib.util.find_spec("triton")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "backends" / "nvidia" / "bin" / name
        if p.is_file():
            return str(p)
    found = shutil.which(name)
    if found is None:
        raise ToolNotFoundError(f"{name} not found (neither in the triton wheel nor on PATH)")
    return found
