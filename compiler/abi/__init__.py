"""The host-kernel ABI: the only declaration of every layout the host and the kernels share.

- `tables`: the task table (header, rows, prefetch records), the control block, the batch block,
  the counters, and the codes descriptors carry (norms, rotary, activations);
- `descriptors`: each op's descriptor words, by field;
- `formats`: the packed weight formats' codes and block geometry;
- `engine_stats`: the engine's stats record (the serving engine and the ingress share it).

Both kernel templates get their constants from `constants()` (Triton folds `tl.constexpr`s, the C
compiler its `#define`s: the machine code is what literals gave); Python writers and readers index
by the names here. This package sits below the IR and the bundle format and imports nothing of
zlc: codegen, the runtime, the serving engine and the kernel model all read it.
"""

from __future__ import annotations

from . import tables
from .descriptors import (
    DESCS,
    ArgmaxDesc,
    AttentionDesc,
    CacheAppendDesc,
    CombineDesc,
    Desc,
    EmbedDesc,
    Field,
    LinearDesc,
    RowNormDesc,
    all_fields,
)
from .descriptors import constants as desc_constants
from .engine_stats import ENGINE_SLOT, ENGINE_STATS, engine_record
from .formats import BY_CODE, FORMATS, WeightFormat, format_constants
from .tables import *  # noqa: F403 (the layouts' names are this package's surface)
from .tables import batch_sections, mode_rows, row_waits, table_header, task_row

__all__ = ["DESCS", "ArgmaxDesc", "AttentionDesc", "CacheAppendDesc", "CombineDesc", "Desc", "EmbedDesc", "Field",
           "LinearDesc", "RowNormDesc", "all_fields", "desc_constants", "ENGINE_SLOT", "ENGINE_STATS",
           "engine_record", "BY_CODE", "FORMATS", "WeightFormat", "format_constants", "batch_sections",
           "mode_rows", "row_waits", "table_header", "task_row", "constants",
           *(k for k in vars(tables) if k.isupper())]


def constants() -> dict[str, int]:
    """Every integer the kernels are built with: the tables' words and codes (`tables`), the
    descriptor words (DI_/DF_), the format codes (QF_). Names are unique across the three."""
    out = {k: v for k, v in vars(tables).items() if k.isupper() and isinstance(v, int)}
    for part in (desc_constants(), {k: v for k, v in format_constants().items() if isinstance(v, int)}):
        clash = set(part) & set(out)
        if clash:
            raise ValueError(f"ABI constants named twice: {sorted(clash)}")
        out.update(part)
    return out
