"""Progress a rank makes outside its steps, counted: what tells an evaluation from a hang.

The stall watch (``stall``) reads one number, ``count()``, at each wake-up; a rank with no step
for its threshold whose count moved within that threshold is ``evaluating``, one whose count
stood still is ``stalled``. The count adds up events that the hooks see as they happen:

- **collectives launched** (``comm_inflight.IN_FLIGHT.launched``), counted by the collective
  tap at every launch, always;
- **module calls on the training thread**, counted by a probe that the watch *arms* only once a
  rank has gone ``SAMPLE_FROM`` of its threshold without a step (``arm``), and that takes
  itself out at the first call it sees: torch's global forward pre-hook, registered again at
  the next wake-up (every 0.25 s) while the wait lasts. A stepping rank never has it; an
  evaluating one pays for one hook call per wake-up, not per module call;
- **model calls ``gpumon run``'s wrapper sees** (``noted``, one increment each).

Counting beats looking: a forward launched on a GPU returns in microseconds and the thread then
waits in ``.item()`` or a metric's sync, outside any module call, so a sample of the thread's
stack rarely lands inside one, while a count cannot miss a call that began and ended between
two looks. A forward that never returns is counted once, when it began, and the rank reads
stalled a threshold later.

The module probe is not armed in a process that has run ``torch.compile``: the compiler guards
on torch's global hooks, and a hook coming and going would have it compile again. There a
compiled model's evaluation is told by its collectives and by ``gpumon run``'s model-call
wrapper.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from gpumon.client.core.comm_inflight import IN_FLIGHT, InFlightCollectives

_get_ident = threading.get_ident


class ProgressEvents:
    """The process's count of progress events: hooks add to ``noted`` from the training
    thread's hot paths (one attribute increment); ``count``, ``arm`` and ``disarm`` are the
    watch's."""

    def __init__(self, in_flight: InFlightCollectives = IN_FLIGHT) -> None:
        self.noted = 0
        """Events the hooks noted (``gpumon run``'s model calls)."""
        self.module_calls = 0
        """Module calls the armed probe saw (at most one per arming)."""
        self._in_flight = in_flight
        self._handle: Any = None  # the registered probe's removable handle, while armed

    def count(self) -> int:
        """Every event counted so far; only its changes mean anything."""
        return self.noted + self.module_calls + self._in_flight.launched

    @property
    def armed(self) -> bool:
        """Whether the module-call probe is in torch now."""
        return self._handle is not None

    def arm(self, thread: int | None) -> None:
        """Count the next module call of ``thread`` (a no-op while armed, without torch, or in
        a process that compiles)."""
        if self._handle is not None or thread is None or torch_compiled():
            return
        module = sys.modules.get("torch.nn.modules.module")
        register = getattr(module, "register_module_forward_pre_hook", None)
        if register is None:
            return

        def probe(_module: Any, _args: Any) -> None:
            if _get_ident() != thread:
                return
            self.module_calls += 1
            handle, self._handle = self._handle, None
            if handle is not None:
                handle.remove()

        try:
            self._handle = register(probe)
        except Exception:  # a torch that refuses: the count goes on without module calls
            self._handle = None

    def disarm(self) -> None:
        """Take the probe out (the rank steps again, or its monitor closed)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            try:
                handle.remove()
            except Exception:
                pass


def torch_compiled() -> bool:
    """Whether ``torch.compile`` has traced code in this process: what it traced is guarded on
    the module hooks and wrappers it met, and would be compiled again if they changed."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return False
    try:
        return bool(utils.counters["frames"]["total"])
    except Exception:
        return True


PROGRESS = ProgressEvents()
"""This process's progress events (one per process, as the collective tap is)."""
