"""The engine's counters, shared with the ingress: the engine process writes them after every step
into a memfd the ingress created and passed (``--stats-fd``); the ingress maps the same file and
reads it when /metrics is scraped. No ring traffic, nothing on the hot path but a few stores.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from zlc.abi import ENGINE_SLOT, ENGINE_STATS, engine_record


class EngineStats:
    """The engine's counters in a shared file: the engine writes them after every step, the
    ingress maps the same file (an fd it passed) and reads them when /metrics is scraped. f64 slots
    (a torn read of one slot is impossible on 64-bit hosts; slots are read independently)."""

    FIELDS = ENGINE_STATS  # the record's slots (zlc.abi.engine_stats)

    def __init__(self, fd: int | None = None):
        size = 8 * len(self.FIELDS)
        if fd is None:
            fd = os.memfd_create("zlc-engine-stats", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd = fd
        self._map = mmap.mmap(fd, size)
        self.values = np.frombuffer(self._map, dtype=np.float64)

    def get(self, name: str) -> float:
        return float(self.values[ENGINE_SLOT[name]])

    def put(self, **values: float) -> None:
        """Writes the whole record, every counter by name (a missing or unknown name is an error)."""
        self.values[:] = engine_record(values)

    def close(self) -> None:
        """Unmaps and closes the fd (idempotent)."""
        if self.fd < 0:
            return
        self.values = np.zeros(len(self.FIELDS))
        try:
            self._map.close()
        except BufferError:  # a scrape still holds a view; the mapping goes with the process
            pass
        os.close(self.fd)
        self.fd = -1
