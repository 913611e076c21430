"""Rendering ahead of the scrape: the ranks' blocks rendered on a thread of their own once the
ranks' data changed, so that the next scrape finds them ready.

A run's series are kept as text per version of its ranks (``exposition.RenderCache``); the
scrape after the ranks' step used to render the whole run again (64 ranks: about 4,900 series,
4-8 ms of CPU on a 2-vCPU machine) while ingest decoded the next datagrams, and those scrapes
set the p99 (benchmarks/RESULTS.md, "Scrape"). Here the agent says when the data changed (ingest
has emptied its queue, housekeeping has advanced the analyses), and this thread runs the
collector's families once (``AgentCollector.render_ranks``), which renders the runs that moved
into their caches.

Nothing is served from here: a scrape still reads the ranks at its own time and checks every
block's version, so its data is as fresh as it was, and its bytes the same; it only finds the
blocks already rendered. A scrape that comes while this renders waits for the block
(``RenderCache`` renders a block once), instead of rendering it beside this thread.

Changes are coalesced: a pass starts once changes have stopped for ``quiet_s`` (the datagrams
of a step of every rank), covers every change before it, and passes are at least ``min_gap_s``
apart, which bounds the CPU this costs however often ranks step. And a pass is paced by the
scrapes (``wait_s``, the collector's ``render_wait_s``): it waits until shortly before the
scrape expected next, so that a Prometheus scraping every 15 s costs one pass per scrape, not
one per change (three a second at 64 ranks), while a client scraping back to back is served
after every change.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

MIN_GAP_S = 0.1
"""Passes at most ten times a second. At 64 ranks stepping twice a second and housekeeping
once, that is three passes a second of 3-6 ms each."""

QUIET_S = 0.005
"""A pass starts once changes have stopped this long: the datagrams of one step of every rank
come back to back, well within it."""


class RenderAhead:
    """A thread that calls ``render()`` after each ``changed()``, coalesced."""

    def __init__(self, render: Callable[[], object], min_gap_s: float = MIN_GAP_S,
                 quiet_s: float = QUIET_S, wait_s: Callable[[], float] = lambda: 0.0) -> None:
        self._render = render
        self._wait_s = wait_s
        self._stopped = threading.Event()
        self._min_gap_s = min_gap_s
        self._quiet_s = quiet_s
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpumon-render-ahead",
                                        daemon=True)
        self.passes_total = 0
        """Passes run (each renders whatever moved since the one before)."""

    def start(self) -> None:
        """Start the thread; it sleeps until the first ``changed()``."""
        self._thread.start()

    def changed(self) -> None:
        """The data behind the blocks moved: render them again soon (cheap; any thread)."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread (after the pass it is in, if any)."""
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        last = float("-inf")
        while True:
            self._wake.wait()
            if self._stopped.is_set():
                return
            # What changes meanwhile is covered by this same pass.
            delay = max(last + self._min_gap_s - time.monotonic(), self._wait_s())
            if delay > 0 and self._stopped.wait(delay):
                return
            self._quiet()
            if self._stopped.is_set():
                return
            self._wake.clear()  # before reading: a change from now on wakes another pass
            last = time.monotonic()
            try:
                self._render()
            except Exception:  # a scrape would meet the same error and report it
                log.debug("rendering ahead failed", exc_info=True)
            self.passes_total += 1

    def _quiet(self) -> None:
        """Wait until nothing changed for ``quiet_s`` (at most ``min_gap_s``): the ranks' step
        comes as several datagrams, and ingest's queue may empty between them."""
        deadline = time.monotonic() + self._min_gap_s
        while time.monotonic() < deadline and not self._stopped.is_set():
            self._wake.clear()
            time.sleep(self._quiet_s)
            if not self._wake.is_set():
                return
