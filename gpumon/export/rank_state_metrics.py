"""Prometheus families for where each rank is: its state, and while stalled, its place.

Rendered from the joined conditions (``gpumon.state.rank_states``): six series a rank, two more
while stalled, one more once exited. A run's block of text is kept with its ranks' conditions
themselves as its version (``RenderCache``; conditions are frozen values, so equal ones render
the same text): while its ranks step, their conditions stand still and the block is reused;
``gpumon_rank_stalled_seconds`` moves with the clock, so a stalled rank's run is rendered
again at each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

from prometheus_client.core import Metric

from gpumon.analysis.stall import STATES, RankCondition, waits_on_label
from gpumon.export.exposition import GaugeFamily, RenderCache

RunConditions = tuple[str, list[RankCondition]]
"""A run and its ranks' conditions, by rank."""


class _StateFamilySet(NamedTuple):
    state: GaugeFamily
    info: GaugeFamily
    stalled: GaugeFamily


def _families() -> _StateFamilySet:
    return _StateFamilySet(
        GaugeFamily("gpumon_rank_state",
                    "1 for the rank's current state (stepping, evaluating, stalled, exited: "
                    "ended without closing its monitor, finished: closed it), 0 for the "
                    "others; kept until the rank expires.", labels=["run", "rank", "state"]),
        GaugeFamily("gpumon_rank_stall_info",
                    "1 while the rank is stalled: its open phase, the collective in flight, "
                    "the innermost frame of the job's own code, the ranks it waits on; for "
                    "an exited rank, where it was last seen.",
                    labels=["run", "rank", "phase", "op", "location", "waits_on"]),
        GaugeFamily("gpumon_rank_stalled_seconds",
                    "How long the rank has made no progress while stalled (0 while stepping).",
                    labels=["run", "rank"]),
    )


def _fill(f: _StateFamilySet, source: RunConditions) -> None:
    run, conditions = source
    for cond in conditions:
        rank_label = str(cond.rank)
        for name in STATES:
            f.state.add_metric([run, rank_label, name], 1.0 if cond.state == name else 0.0)
        if cond.placed:
            f.info.add_metric([run, rank_label, cond.phase, cond.op, cond.location,
                               waits_on_label(cond.waits_on)], 1.0)
        if cond.state in ("exited", "finished"):
            continue
        f.stalled.add_metric([run, rank_label],
                             cond.stalled_s or 0.0 if cond.state == "stalled" else 0.0)


class RankStateFamilies:
    """The rank-state families, a block per run (one instance per agent; safe for concurrent
    scrapes, as ``RenderCache`` is)."""

    def __init__(self) -> None:
        self._cache = RenderCache(_families, _fill)

    def families(self, conditions: Mapping[tuple[str, int], RankCondition]) -> Iterator[Metric]:
        """``gpumon_rank_state``, ``gpumon_rank_stall_info`` and
        ``gpumon_rank_stalled_seconds``."""
        runs: dict[str, list[RankCondition]] = {}
        for (run, _), cond in sorted(conditions.items()):
            runs.setdefault(run, []).append(cond)
        yield from self._cache.families((run, tuple(conds), (run, conds))
                                        for run, conds in runs.items())


def rank_state_families(conditions: Mapping[tuple[str, int], RankCondition]) -> Iterator[Metric]:
    """``gpumon_rank_state``, ``gpumon_rank_stall_info`` and ``gpumon_rank_stalled_seconds``
    (rendered afresh; the agent keeps a ``RankStateFamilies``)."""
    return RankStateFamilies().families(conditions)
