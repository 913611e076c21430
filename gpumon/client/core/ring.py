"""The process's step ring (``gpumon.wire.ring``): its last completed steps, in a memory file
the agent keeps, so that a crash loses at most the step in progress.

The sender thread hands the file's descriptor to the agent (``Sender``, over the ingest
socket), and marks in its header how far it has sent; the core writes every completed step
into it as the step ends (the C core straight into the mapping; the Python core through
``write``). The agent reads it once the process has gone and ingests what was not sent.

``GPUMON_RING=0`` turns it off: the process then loses what its sender had not sent when it
dies, as before the ring. Where the kernel offers no ``memfd`` (not Linux) there is no ring.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from time import perf_counter

from gpumon.wire import ring as layout

_SENT = struct.Struct("=q")
_OFFSET = struct.Struct("=d")
_ENTRY_PACK = layout.ENTRY.pack_into
_WRITTEN_PACK = _SENT.pack_into
_HEADER_BYTES = layout.HEADER.size
_ENTRY_BYTES = layout.ENTRY.size
_NAN = float("nan")


def enabled() -> bool:
    """Whether this process keeps a ring (``GPUMON_RING`` is not ``0``)."""
    return os.environ.get("GPUMON_RING", "1").strip() not in ("0", "false", "no", "off")


class StepRing:
    """The memory file and its mapping; ``write`` is the Python core's path into it."""

    def __init__(self, capacity: int = layout.CAPACITY) -> None:
        """Make the file (sealed at its size: the agent reads a file that cannot shrink
        under it) and map it; raises OSError where the kernel refuses."""
        size = layout.ring_bytes(capacity)
        self.capacity = capacity
        self.fd = os.memfd_create(layout.MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.view = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self.view[:layout.HEADER.size] = layout.header(capacity, time.time() - perf_counter())
        self._written = 0

    def write(self, seq: int, step: object, t0: float, t1: float, samples: object,
              tokens: object, flops: object) -> None:
        """Write one completed step and count it (the C core does the same in C)."""
        written = self._written
        # Inline tests for the common values (None, a plain int): a call each costs more.
        _ENTRY_PACK(self.view, _HEADER_BYTES + (written % self.capacity) * _ENTRY_BYTES, seq,
                    -1 if step is None else _count(step), t0, t1,
                    -1 if samples is None else _count(samples),
                    -1 if tokens is None else _count(tokens),
                    _NAN if flops is None else _flops(flops))
        self._written = written = written + 1
        _WRITTEN_PACK(self.view, layout.WRITTEN_AT, written)

    def mark_sent(self, seq_end: int) -> None:
        """Every step below ``seq_end`` reached the agent's socket (the sender thread)."""
        _SENT.pack_into(self.view, layout.SENT_AT, seq_end)

    def set_unix_offset(self, offset: float) -> None:
        """``time.time() - perf_counter()`` now: how the agent places the ring's steps."""
        _OFFSET.pack_into(self.view, layout.OFFSET_AT, offset)

    def close(self) -> None:
        """Unmap and close (the core must have let go of the mapping: ``set_ring(None)``)."""
        try:
            self.view.close()
        except BufferError:  # still exported to a core: the process's end frees it
            return
        os.close(self.fd)


def open_ring() -> StepRing | None:
    """A ring for this process, or None when turned off or the kernel has no memfd."""
    if not enabled() or not hasattr(os, "memfd_create"):
        return None
    try:
        return StepRing()
    except OSError:
        return None


def _count(value: object) -> int:
    """A count or step number as the ring holds it: a non-negative int, else -1."""
    if type(value) is int and 0 <= value <= layout.MAX_INT_STORED:
        return value
    return -1


def _flops(value: object) -> float:
    """FLOPs as the ring holds them: an int or float as a float, else NaN."""
    if type(value) is float:
        return value
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:
            return float("nan")
    return float("nan")
