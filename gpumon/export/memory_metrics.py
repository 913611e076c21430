"""Prometheus families for the live memory breakdown: what each rank's memory is made of, what
ZeRO would make of it, and which part an out-of-memory warning names.

The breakdown is sampled by the client every few seconds, so a run's block of series changes
rarely: it is rendered once per change (``RenderCache``), keyed on the breakdowns and
attributions themselves (frozen values: equal means the same series).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from prometheus_client.core import Metric

from gpumon.analysis.memory import project_zero
from gpumon.export.exposition import GaugeFamily, RenderCache
from gpumon.state.rank_totals import RankTotals
from gpumon.wire import MEMORY_COMPONENTS

RANK_LABELS = ["run", "rank"]


class _MemoryFamilySet(NamedTuple):
    breakdown: GaugeFamily
    projected: GaugeFamily
    component: GaugeFamily


def _families() -> _MemoryFamilySet:
    return _MemoryFamilySet(
        GaugeFamily("gpumon_memory_bytes",
                    "Sampled memory of the rank by component: parameters, gradients, "
                    "optimizer_states (fp32 master copies included), activations (saved for "
                    "backward), other (what the allocator holds beyond them).",
                    labels=[*RANK_LABELS, "component"]),
        GaugeFamily("gpumon_memory_zero_projected_bytes",
                    "Per-GPU bytes of the rank's measured memory under ZeRO stage `stage` over "
                    "`gpus` data-parallel GPUs (the run's world size, 2x and 4x it), from the "
                    "stage the run uses on (gpumon_rank_framework_info).",
                    labels=[*RANK_LABELS, "stage", "gpus"]),
        GaugeFamily("gpumon_oom_component_bytes",
                    "The memory component an out-of-memory warning names: the one that grew "
                    "(cause growing or appeared, value: bytes grown) or else the largest (value: "
                    "its bytes), with the remedy that shrinks it.",
                    labels=[*RANK_LABELS, "component", "cause", "remedy"]),
    )


def _fill(families: _MemoryFamilySet, ranks: list[RankTotals]) -> None:
    for state in ranks:
        labels = [state.run, str(state.rank)]
        breakdown = state.memory_breakdown
        if breakdown is not None:
            for name in MEMORY_COMPONENTS:
                value = getattr(breakdown, name)
                if value is not None:
                    families.breakdown.add_metric([*labels, name], float(value))
            for projection in project_zero(breakdown, state.world or 1,
                                           current_stage=state.zero_stage or 0):
                families.projected.add_metric(
                    [*labels, str(projection.stage), str(projection.gpus)],
                    float(projection.total))
        memory = state.analysis.memory if state.analysis is not None else None
        if memory is not None:
            families.component.add_metric(
                [*labels, memory.component, memory.cause, memory.remedy], float(memory.bytes))


class MemoryFamilies:
    """The breakdown, projection and OOM-component families, per run (one per agent)."""

    def __init__(self) -> None:
        self._cache = RenderCache(_families, _fill)

    def families(self, ranks: list[RankTotals]) -> Iterator[Metric]:
        """Series for every rank that sent a breakdown."""
        runs: dict[str, list[RankTotals]] = {}
        for state in sorted(ranks, key=lambda s: (s.run, s.rank)):
            if state.memory_breakdown is not None:
                runs.setdefault(state.run, []).append(state)
        yield from self._cache.families(
            (run, tuple((s.rank, s.world, s.memory_breakdown,
                         s.analysis.memory if s.analysis else None) for s in sources), sources)
            for run, sources in runs.items())
