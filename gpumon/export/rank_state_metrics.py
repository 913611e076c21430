"""Prometheus families for where each rank is: its state, and while stalled, its place.

Rendered at every scrape from the joined conditions (``gpumon.state.rank_states``): few series
(six a rank, two more while stalled, one more once exited), and ``gpumon_rank_stalled_seconds`` moves with the
clock, so nothing is kept between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import Metric

from gpumon.analysis.stall import STATES, RankCondition, waits_on_label
from gpumon.export.exposition import GaugeFamily


def rank_state_families(conditions: Mapping[tuple[str, int], RankCondition]) -> Iterator[Metric]:
    """``gpumon_rank_state``, ``gpumon_rank_stall_info`` and ``gpumon_rank_stalled_seconds``."""
    state = GaugeFamily("gpumon_rank_state",
                        "1 for the rank's current state (stepping, evaluating, stalled, exited: "
                        "ended without closing its monitor, finished: closed it), 0 for the "
                        "others; kept until the rank expires.", labels=["run", "rank", "state"])
    info = GaugeFamily("gpumon_rank_stall_info",
                       "1 while the rank is stalled: its open phase, the collective in flight, "
                       "the innermost frame of the job's own code, the ranks it waits on; for "
                       "an exited rank, where it was last seen.",
                       labels=["run", "rank", "phase", "op", "location", "waits_on"])
    stalled = GaugeFamily("gpumon_rank_stalled_seconds",
                          "How long the rank has made no progress while stalled (0 while stepping).",
                          labels=["run", "rank"])
    for (run, rank), cond in sorted(conditions.items()):
        rank_label = str(rank)
        for name in STATES:
            state.add_metric([run, rank_label, name], 1.0 if cond.state == name else 0.0)
        if cond.placed:
            info.add_metric([run, rank_label, cond.phase, cond.op, cond.location,
                             waits_on_label(cond.waits_on)], 1.0)
        if cond.state in ("exited", "finished"):
            continue
        stalled.add_metric([run, rank_label], cond.stalled_s or 0.0 if cond.state == "stalled" else 0.0)
    yield state
    yield info
    yield stalled
