"""The step analyzer as the agent runs it: fed by ingest, advanced by housekeeping, read by scrapes.

``analysis.stream.StepAnalyzer`` is pure and not thread-safe; here it sits behind one lock
shared by three threads. Its per-rank state lives on the rank store's records, which the store
keeps, expires and evicts (``state.ranks``). Data flows one way: ingest hands it accepted
steps, housekeeping hands it a copy of the node's GPU samples taken once per pass, and scrapes
read its analyses with the store's copies. It never reads the node state itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

from gpumon.analysis.stream import RankAnalysis, RankKey, StepAnalyzer
from gpumon.analysis.thresholds import Thresholds
from gpumon.collectors.samples import GpuSample
from gpumon.state.gpu_history import Packed
from gpumon.state.gpu_history import window as gpu_window
from gpumon.state.node import NodeSnapshot
from gpumon.state.ranks import RankStore
from gpumon.wire import StepRecord


class SharedAnalyzer:
    """A ``StepAnalyzer`` behind a lock, with its passes cut into slices; ``ranks`` is the
    store whose records hold its per-rank state (without one, a table of its own)."""

    def __init__(self, resolution_s: float, thresholds: Thresholds,
                 ranks: RankStore | None = None) -> None:
        self._analyzer = StepAnalyzer(resolution_s=resolution_s, thresholds=thresholds,
                                      ranks=ranks)
        self._store = ranks
        self._lock = threading.Lock()

    @property
    def thresholds(self) -> Thresholds:
        """The thresholds the next pass uses."""
        return self._analyzer.thresholds

    def set_thresholds(self, thresholds: Thresholds) -> None:
        """Use new thresholds from the next pass on (a pass under way keeps its own)."""
        with self._lock:
            self._analyzer.thresholds = thresholds

    def add(self, steps: list[StepRecord], received_t: float,
            pids: Mapping[RankKey, int | None]) -> None:
        """Queue steps ingest accepted (``pids``: each rank's pid from the kernel)."""
        with self._lock:
            self._analyzer.add(steps, received_t, pids)

    def advance(self, now: float, node: NodeSnapshot,
                gpu_history: Mapping[int, Sequence[Packed]]) -> None:
        """Analyse every step whose window is complete.

        ``gpu_history`` is each GPU's recent samples, copied from the node state for this
        pass; the ranks' layouts are read from the store once per pass. A whole pass at 64
        ranks holds the GIL for milliseconds (benchmarks/RESULTS.md, "Causes and fixes"). In
        slices, with the lock released and the GIL offered (sleep) between them, a scrape or an
        ingest waits for one slice instead; the results are the same (see
        ``StepAnalyzer.process_in_slices``).
        """

        def window(index: int, t0: float, t1: float) -> list[GpuSample]:
            return gpu_window(gpu_history.get(index, ()), index, t0, t1)

        layouts = self._store.layouts() if self._store is not None else {}
        with self._lock:
            slices = self._analyzer.process_in_slices(
                now, window, node.gpus, node.latest,
                xid_gpus={gpu for (gpu, _), count in node.xid_counts.items() if count},
                layouts=layouts)
        while True:
            with self._lock:
                if next(slices, None) is None:
                    break
            time.sleep(0)

    def has_ranks(self) -> bool:
        """Whether any rank is held: without one a pass has nothing to do, and the copies of
        the node's samples it is handed need not be made (an idle node's housekeeping)."""
        with self._lock:
            return self._analyzer.has_ranks()

    def analyses(self) -> list[RankAnalysis]:
        """Every rank's current analysis (never changed once handed out)."""
        with self._lock:
            return self._analyzer.analyses()
