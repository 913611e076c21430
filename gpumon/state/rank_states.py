"""Each rank's state (stepping, evaluating, stalled, exited, finished) and place, from the store.

The rank store keeps what arrived (the hook's latest ``state`` record, when steps arrived,
whether the process was seen to end); here each run's ranks are put as ages at one moment
and joined by ``gpumon.analysis.stall`` (the rule, and who waits on whom, are there).
"""

from __future__ import annotations

from collections import defaultdict

from gpumon.analysis.stall import RankCondition, RankProgress, join_run
from gpumon.state.rank_totals import RankTotals


def rank_conditions(ranks: list[RankTotals], now_monotonic: float) -> dict[tuple[str, int], RankCondition]:
    """(run, rank) -> its condition now, every run's ranks joined."""
    runs: defaultdict[str, list[RankProgress]] = defaultdict(list)
    for state in ranks:
        runs[state.run].append(_progress(state, now_monotonic))
    return {(run, cond.rank): cond for run, progress in runs.items() for cond in join_run(progress)}


def _progress(state: RankTotals, now: float) -> RankProgress:
    seen = state.report_monotonic
    step = state.last_step_monotonic
    return RankProgress(
        rank=state.rank,
        report=state.report,
        report_age_s=None if seen is None else max(0.0, now - seen),
        step_after_report=seen is not None and step is not None and step > seen,
        silent_s=max(0.0, now - state.last_seen_monotonic),
        steps_total=state.steps_total,
        exited=state.exited_monotonic is not None,
        process_alive=None if state.kernel_pid is None else state.exited_monotonic is None,
    )
