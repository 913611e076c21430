"""The step ring: the binary layout a training process keeps its latest steps in, in shared
memory the agent holds, so that a process that dies (``os._exit``, SIGKILL, a segfault) loses
at most the step it was in, not the steps still waiting to be sent (docs/reliability.md).

A process makes an anonymous memory file (``memfd``) of this layout, hands its descriptor to
the agent once over the ingest socket (a ``ring`` datagram carrying it as SCM_RIGHTS), and
from then on writes each completed step into it as the step ends (the hook's C core: a few
stores, no Python object). Its sender thread writes in the header how far it has sent. The
agent reads the file only once the process has ended, with ``pread`` (never a mapping, so a
sender that shrinks its file cannot fault the agent), and takes the entries past that mark as
the process's last steps. The layout is native-endian: both ends run on one node.

Header (``HEADER``, 64 bytes): magic, version, capacity (entries), entry size, entries written
(ever, by the process), the sequence number below which every step was sent, and the offset
from the process's ``perf_counter`` clock to Unix time, refreshed at each flush. Entry
(``ENTRY``): the step's sequence number (the hook's count of completed steps), the caller's
step number (-1: none), its start and end (``perf_counter``), samples and tokens (-1: none)
and FLOPs (NaN: none). Entry ``i`` (0-based, in writing order) lives in slot ``i % capacity``.

Standard library only: the client writes it, the agent reads it (``collectors/rings.py``).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from gpumon.errors import GpumonError
from gpumon.wire.limits import MAX_INT, MAX_RUN_CHARS, PROTOCOL_VERSION, is_label

MAGIC = 0x676D5247  # "GRmg"
VERSION = 1
HEADER = struct.Struct("=IIIIqqd24x")
"""magic, version, capacity, entry size, written, sent, unix offset."""
ENTRY = struct.Struct("=qqddqqd")
"""seq, step, t0, t1, samples, tokens, flops."""
WRITTEN_AT = 16
"""Byte offset of ``written`` in the header (the C core stores it there)."""
SENT_AT = 24
OFFSET_AT = 32
CAPACITY = 1024
"""Entries a ring holds: the last 1,024 steps, ~57 KiB a process."""
MAX_CAPACITY = 65536
"""The most entries the agent accepts in a ring it is handed (3.5 MiB)."""
MEMFD_NAME = "gpumon-ring"
"""The name the memory file is made with; the agent keeps only files of this name."""
MAX_INT_STORED = MAX_INT
"""The largest step number or count an entry holds (-1 stands for none)."""
KIND = "ring"
"""The ``kind`` of the datagram that hands a ring over."""


def ring_bytes(capacity: int) -> int:
    """The size of a ring of ``capacity`` entries."""
    return HEADER.size + capacity * ENTRY.size


def header(capacity: int, unix_offset: float) -> bytes:
    """A fresh ring's header."""
    return HEADER.pack(MAGIC, VERSION, capacity, ENTRY.size, 0, 0, unix_offset)


@dataclass(frozen=True, slots=True)
class RingEntry:
    """One completed step as the ring holds it (times on the process's ``perf_counter``)."""

    seq: int
    step: int | None
    t0: float
    t1: float
    samples: int | None
    tokens: int | None
    flops: float | None


@dataclass(frozen=True, slots=True)
class RingContents:
    """What a ring says: the entries not yet sent (oldest first), and the clock offset."""

    unix_offset: float
    unsent: list[RingEntry]
    written: int
    sent: int


class RingError(GpumonError, ValueError):
    """A ring's contents are not a ring; ``reason`` names why (a drop reason)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def read_header(data: bytes) -> tuple[int, int, int]:
    """(capacity, written, sent) of a ring's header; raises RingError if it is none."""
    if len(data) < HEADER.size:
        raise RingError("ring_truncated", f"{len(data)} bytes: shorter than a ring's header")
    magic, version, capacity, entry_size, written, sent, _ = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or entry_size != ENTRY.size:
        raise RingError("ring_garbage", "not a gpumon step ring of this version")
    if not 0 < capacity <= MAX_CAPACITY:
        raise RingError("ring_garbage", f"capacity {capacity} outside 1-{MAX_CAPACITY}")
    if written < 0 or sent < 0:
        raise RingError("ring_garbage", f"written {written}, sent {sent}: negative")
    return capacity, written, sent


def parse(data: bytes) -> RingContents:
    """The unsent entries of the ring ``data`` (the whole file); raises RingError when its
    header or an entry past the sent mark is not what a hook writes. Never trusts a number
    it reads: sizes, order and values are checked before use."""
    capacity, written, sent = read_header(data)
    if len(data) < ring_bytes(capacity):
        raise RingError("ring_truncated", f"{len(data)} bytes for {capacity} entries")
    unix_offset = HEADER.unpack_from(data)[6]
    if not math.isfinite(unix_offset):
        raise RingError("ring_garbage", "the clock offset is not a number")
    unsent: list[RingEntry] = []
    previous = -1
    for i in range(max(0, written - capacity), written):
        seq, step, t0, t1, samples, tokens, flops = ENTRY.unpack_from(
            data, HEADER.size + (i % capacity) * ENTRY.size)
        if seq <= previous or not (math.isfinite(t0) and math.isfinite(t1)) or t1 < t0:
            raise RingError("ring_garbage", f"entry {i}: out of order or not a step")
        previous = seq
        if seq < sent:
            continue
        unsent.append(RingEntry(seq, step if 0 <= step <= MAX_INT else None, t0, t1,
                                samples if samples >= 0 else None,
                                tokens if tokens >= 0 else None,
                                None if math.isnan(flops) else flops))
    return RingContents(unix_offset, unsent, written, sent)


def handover(run: str, rank: int) -> bytes:
    """The datagram that carries a ring's descriptor: whose steps the ring holds."""
    return json.dumps({"v": PROTOCOL_VERSION, "kind": KIND, "run": run, "rank": rank},
                      separators=(",", ":")).encode()


def parse_handover(data: bytes) -> tuple[str, int]:
    """(run, rank) of a ``ring`` datagram; raises RingError (``ring_bad_datagram``) when it
    is not one."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        value = None
    if (isinstance(value, dict) and value.get("v") == PROTOCOL_VERSION
            and value.get("kind") == KIND and isinstance(value.get("run"), str)
            and is_label(value["run"], MAX_RUN_CHARS) and type(value.get("rank")) is int
            and 0 <= value["rank"] <= MAX_INT):
        return value["run"], value["rank"]
    raise RingError("ring_bad_datagram", "a descriptor came with no valid ring datagram")


def step_wire(entry: RingEntry, run: str, rank: int, pid: int | None,
              unix_offset: float) -> dict[str, object]:
    """The wire form of ``entry`` (the fields a ring holds), to decode as any step record is,
    with every check the wire makes."""
    record: dict[str, object] = {
        "v": PROTOCOL_VERSION, "kind": "step", "run": run, "rank": rank,
        "step": entry.seq if entry.step is None else entry.step,
        "duration": entry.t1 - entry.t0, "t_start": entry.t0 + unix_offset,
    }
    for key, value in (("samples", entry.samples), ("tokens", entry.tokens),
                       ("flops", entry.flops), ("pid", pid)):
        if value is not None:
            record[key] = value
    return record
