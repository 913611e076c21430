"""Where the agent finds a rank's trace channel, and what a trace file is called.

Both ends derive these from what they share, the agent's ingest socket path, the run and the
rank (``gpumon.client.trace_control`` listens, ``gpumon.agent.traces`` asks): nothing has to be
announced, and two agents on one node (two sockets) never reach each other's ranks.
"""

from __future__ import annotations

import hashlib
import os
import re

CHANNEL_PREFIX = b"\0gpumon-trace/"
TRACE_SUFFIX = ".pt.trace.json.gz"
MAX_TRACE_STEPS = 50
"""Steps one trace may cover: a trace of every op grows by megabytes per step."""


def channel_address(socket_path: str, run: str, rank: int) -> bytes:
    """The abstract socket a rank listens on for trace requests."""
    key = f"{os.path.realpath(socket_path)}\0{run}\0{rank}".encode()
    return CHANNEL_PREFIX + hashlib.sha256(key).hexdigest()[:40].encode()


def trace_file_name(run: str, rank: int, first_step: int) -> str:
    """``<run>.rank<N>.step<S>.pt.trace.json.gz``, the run's ``/`` and ``:`` written ``_``."""
    safe = re.sub(r"[/:]", "_", run)
    return f"{safe}.rank{rank}.step{first_step}{TRACE_SUFFIX}"
