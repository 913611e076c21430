"""Prometheus families for each MoE layer's expert load: one series per (run, rank, layer),
never one per expert (a 64-expert x 32-layer model would be 2,048 series a rank).

The client summarises each layer over its last steps (docs/moe.md); a rank's block is
rendered once per summary it sends (``RenderCache``, keyed on the frozen summary itself).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from prometheus_client.core import Metric

from gpumon.export.exposition import GaugeFamily, RenderCache
from gpumon.state.rank_totals import RankTotals

LAYER_LABELS = ["run", "rank", "layer"]


class _MoeFamilySet(NamedTuple):
    max_ratio: GaugeFamily
    cv: GaugeFamily
    dead: GaugeFamily
    experts: GaugeFamily
    window: GaugeFamily


def _families() -> _MoeFamilySet:
    return _MoeFamilySet(
        GaugeFamily("gpumon_moe_expert_load_max_ratio",
                    "Tokens the MoE layer's busiest expert received over the mean per expert, "
                    "over the rank's last gpumon_moe_window_steps steps: 1 when balanced; the "
                    "ranks holding that expert compute while the others wait in the all-to-all.",
                    labels=LAYER_LABELS),
        GaugeFamily("gpumon_moe_expert_load_cv",
                    "Coefficient of variation of the tokens the MoE layer's experts received over "
                    "the rank's last gpumon_moe_window_steps steps (0 when balanced).",
                    labels=LAYER_LABELS),
        GaugeFamily("gpumon_moe_dead_experts",
                    "Experts of the MoE layer that received no token in the rank's last "
                    "gpumon_moe_window_steps steps: they get no gradient and stop learning.",
                    labels=LAYER_LABELS),
        GaugeFamily("gpumon_moe_experts",
                    "Experts of the MoE layer, as its router counts them.",
                    labels=LAYER_LABELS),
        GaugeFamily("gpumon_moe_window_steps",
                    "Steps the rank's MoE expert-load figures cover (the client's window, fewer "
                    "at the start of a run).",
                    labels=["run", "rank"]),
    )


def _fill(families: _MoeFamilySet, state: RankTotals) -> None:
    moe = state.moe
    if moe is None:
        return
    rank = str(state.rank)
    families.window.add_metric([state.run, rank], float(moe.window))
    for load in moe.layers:
        labels = [state.run, rank, load.layer]
        families.max_ratio.add_metric(labels, load.max_ratio)
        families.cv.add_metric(labels, load.cv)
        families.dead.add_metric(labels, float(load.dead))
        families.experts.add_metric(labels, float(load.experts))


class MoeFamilies:
    """The expert-load families, a block per rank (one instance per agent)."""

    def __init__(self) -> None:
        self._cache = RenderCache(_families, _fill)

    def families(self, ranks: list[RankTotals]) -> Iterator[Metric]:
        """Series for every rank that sent an expert-load summary."""
        yield from self._cache.families(
            ((state.run, state.rank), state.moe, state)
            for state in sorted(ranks, key=lambda s: (s.run, s.rank)) if state.moe is not None)
