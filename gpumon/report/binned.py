"""The page's bins filled in a child process, beside the verdict engine.

A report reads the recording for two things: the bins (each step's and GPU sample's figures
into the page's time bins, ``recording._Filler``) and the verdicts (the engine over the
steps, ``replay.replay``). Each reads every line; in one process they take turns, and a day of
64 ranks took a minute. Where the process may run on two cores, a forked child fills the bins
while the parent runs the engine, and hands its filler's state back through a pipe, pickled: a
few megabytes of bins, not the steps. Both sides parse the file, so the report costs a tenth to
a fifth more CPU time than in one process, for about 0.7 of its wall time
(``benchmarks/RESULTS.md`` §14).

The page is the same: the child fills the same bins in the same order (``replay.in_order``),
as ``tests/report/test_binned.py`` holds. A child that fails leaves the bins to the parent,
which fills them itself after the engine, as on one core.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

VERDICT_STATE = frozenset({"walls", "hints", "causes", "mfu"})
"""The filler's attributes the parent's engine fills: the child's are not sent."""


def worth_it() -> bool:
    """Whether a child may fill the bins: a second core to run on, and a process without
    other threads (a fork copies only the calling thread, and with it any lock another held)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return hasattr(os, "fork") and cores >= 2 and threading.active_count() == 1


class Binned:
    """A forked child running ``fill()`` into ``filler``, and taking its bins back."""

    def __init__(self, fill: Callable[[], None], filler: Any) -> None:
        self._fill = fill
        self._filler = filler
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: fill, send, and leave without the parent's exit handlers
            os.close(reader)
            code = 1
            try:
                fill()
                state = {k: v for k, v in vars(filler).items() if k not in VERDICT_STATE}
                with os.fdopen(writer, "wb") as out:
                    out.write(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
                code = 0
            except BaseException:  # noqa: BLE001 -- any failure: the parent fills the bins
                pass
            finally:
                os._exit(code)
        os.close(writer)
        self._pid, self._reader = pid, reader

    def take_into(self, filler: Any) -> None:
        """The child's bins into ``filler`` (its model's tables, all but the verdicts); filled
        here instead where the child failed."""
        with os.fdopen(self._reader, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(self._pid, 0)
        if status != 0 or not data:
            log.warning("the child filling the report's bins failed (status %d): filling them "
                        "here", status)
            self._fill()
            return
        state = pickle.loads(data)  # noqa: S301 -- our own child's, through our own pipe
        model = state.pop("model")
        for f in dataclasses.fields(model):
            if f.name != "verdicts":
                setattr(filler.model, f.name, getattr(model, f.name))
        for name, value in state.items():
            setattr(filler, name, value)

    def abandon(self) -> None:
        """The parent failed: end the child and its pipe."""
        os.close(self._reader)
        try:
            os.kill(self._pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self._pid, 0)
